"""serving.properties syntax: every corner of `java.util.Properties.load`.

The expected values were checked against Java 17's `Properties.load(Reader)`.
"""

from __future__ import annotations

import pytest

from lmserve.properties.javaprops import PropertiesSyntaxError, PropertyEntry, parse_properties


def pairs(text: str) -> list[tuple[str, str]]:
    return [(entry.key, entry.value) for entry in parse_properties(text)]


def loaded(text: str) -> dict[str, str]:
    """What `Properties.load` ends up holding: a later duplicate key wins."""
    return {entry.key: entry.value for entry in parse_properties(text)}


# --- separators -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "line",
    [
        "key=value",
        "key:value",
        "key value",
        "key\tvalue",
        "key = value",
        "key : value",
        "key\t=\tvalue",
        "key    value",
        "key \t: value",
        "   key=value",
        "\t key = value",
    ],
)
def test_separators_and_surrounding_whitespace(line):
    assert pairs(line + "\n") == [("key", "value")]


@pytest.mark.parametrize(
    ("line", "key", "value"),
    [
        ("a==b", "a", "=b"),  # only the first separator separates
        ("a::b", "a", ":b"),
        ("a:=b", "a", "=b"),
        ("a = = b", "a", "= b"),  # whitespace then one '=' separates; the next one is value
        ("a b=c", "a", "b=c"),  # whitespace separated: a later '=' is part of the value
        ("a b c", "a", "b c"),
        ("url=http://host:8080/x?y=z", "url", "http://host:8080/x?y=z"),
    ],
)
def test_only_the_first_separator_counts(line, key, value):
    assert pairs(line) == [(key, value)]


def test_value_keeps_internal_and_trailing_whitespace():
    assert loaded("a = b c   d\nz : 3 \t\nt=x\ty \n") == {
        "a": "b c   d",
        "z": "3 \t",
        "t": "x\ty ",
    }


@pytest.mark.parametrize("line", ["a=", "a:", "a", "a   ", "a =  ", "a\t"])
def test_key_with_empty_value(line):
    assert pairs(line + "\n") == [("a", "")]


def test_line_with_only_a_separator_has_an_empty_key():
    assert pairs("=v\n") == [("", "v")]
    assert pairs("   : w\n") == [("", "w")]


# --- comments and blank lines ---------------------------------------------------------------


def test_comment_lines_and_blank_lines_are_skipped():
    text = (
        "# a comment = with a separator\n"
        "! another comment: style\n"
        "    # indented comment\n"
        "\t! tab-indented comment\n"
        "\n"
        "   \n"
        "\t\n"
        "x=1\n"
        "#y=2\n"
        "!z=3\n"
    )
    assert pairs(text) == [("x", "1")]


@pytest.mark.parametrize("text", ["", "\n\n", "# only\n! comments\n", "   \n\t\n"])
def test_nothing_but_blanks_and_comments_gives_no_entries(text):
    assert parse_properties(text) == []


def test_hash_or_bang_after_the_line_start_is_not_a_comment():
    assert loaded("a=b # not a comment\nc#d=e\nf=!g\n") == {
        "a": "b # not a comment",
        "c#d": "e",
        "f": "!g",
    }


def test_escaped_hash_starts_a_key_not_a_comment():
    assert pairs("\\#x=y\n\\!z=w\n") == [("#x", "y"), ("!z", "w")]


def test_comment_ending_in_backslash_does_not_continue():
    assert pairs("# comment \\\nx=1\n") == [("x", "1")]


# --- line continuation ----------------------------------------------------------------------


def test_continuation_drops_leading_whitespace_of_the_next_line():
    assert pairs("a=b\\\n   c\n") == [("a", "bc")]
    assert pairs("a=b\\\n\t \tc\n") == [("a", "bc")]


def test_continuation_keeps_whitespace_before_the_backslash():
    assert pairs("a=b  \\\n   c\n") == [("a", "b  c")]


def test_continuation_over_several_lines():
    text = "list = one, \\\n       two, \\\n       three\nnext=1\n"
    assert pairs(text) == [("list", "one, two, three"), ("next", "1")]


def test_continuation_inside_a_key():
    assert pairs("lo\\\n   ng=v\n") == [("long", "v")]
    assert pairs("a\\\n=b\n") == [("a", "b")]


def test_continued_line_that_looks_like_a_comment_is_content():
    assert pairs("a=b\\\n  #c\n") == [("a", "b#c")]
    assert pairs("a=b\\\n!c\n") == [("a", "b!c")]


def test_blank_line_after_a_continuation_ends_the_entry():
    assert pairs("a=b\\\n\nc=d\n") == [("a", "b"), ("c", "d")]


def test_continuation_with_crlf_line_endings():
    assert pairs("a=b\\\r\n   c\r\nd=e\r\n") == [("a", "bc"), ("d", "e")]


def test_backslash_on_the_last_line_of_the_file_is_dropped():
    assert pairs("a=b\\") == [("a", "b")]
    assert pairs("a=b\\\n") == [("a", "b")]
    assert pairs("a\\") == [("a", "")]


def test_whitespace_only_line_with_backslash_joins_the_next_line():
    assert pairs("   \\\na=b\n") == [("a", "b")]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("a=b\\\\\nc=d\n", [("a", "b\\"), ("c", "d")]),  # 2 backslashes: one literal, no join
        ("a=b\\\\\\\\\nc=d\n", [("a", "b\\\\"), ("c", "d")]),  # 4: two literal, no join
        ("a=b\\\\\\\n   c\n", [("a", "b\\c")]),  # 3: one literal, then a continuation
    ],
)
def test_only_an_odd_number_of_trailing_backslashes_continues(text, expected):
    assert pairs(text) == expected


def test_backslash_followed_by_trailing_space_does_not_continue():
    # The last character is a space, so this is an escaped space, not a continuation.
    assert pairs("a=b\\ \nc=d\n") == [("a", "b "), ("c", "d")]


# --- line endings ---------------------------------------------------------------------------


def test_cr_and_crlf_line_endings():
    assert pairs("a=b\rc=d\r\n e = f\r") == [("a", "b"), ("c", "d"), ("e", "f")]


# --- escapes --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("escaped", "value"),
    [
        ("\\t", "\t"),
        ("\\n", "\n"),
        ("\\r", "\r"),
        ("\\f", "\f"),
        ("\\u0041", "A"),
        ("\\u00e9\\u00E9", "\u00e9\u00e9"),  # hex digits in either case
        ("\\u20AC", "\u20ac"),
        ("\\u00411", "A1"),  # exactly four digits are taken
        ("\\\\", "\\"),
        ("\\z", "z"),  # an unknown escape is the character itself
        ("\\U", "U"),  # only a lower-case u starts a unicode escape
        ("\\=\\:\\ \\#\\!", "=: #!"),
        ("x\\ty", "x\ty"),
    ],
)
def test_escapes_in_values(escaped, value):
    assert pairs(f"k={escaped}\n") == [("k", value)]


def test_escaped_leading_space_in_value_is_kept():
    assert pairs("a=\\  b\n") == [("a", "  b")]


def test_escaped_separators_in_values_are_plain_characters():
    assert pairs("a=b\\=c\\:d\n") == [("a", "b=c:d")]


@pytest.mark.parametrize(
    ("line", "key", "value"),
    [
        ("a\\=b=c", "a=b", "c"),
        ("d\\:e:f", "d:e", "f"),
        ("g\\ h i", "g h", "i"),
        ("a\\ =b", "a ", "b"),
        ("a\\\\=b", "a\\", "b"),  # escaped backslash, then a real separator
        ("a\\u003db=c", "a=b", "c"),  # a \u-escaped '=' does not separate
        ("tab\\tkey=v", "tab\tkey", "v"),
    ],
)
def test_escapes_in_keys(line, key, value):
    assert pairs(line + "\n") == [(key, value)]


@pytest.mark.parametrize("bad", ["\\u12G4", "\\u12", "\\u", "\\uZZZZ", "\\u 041"])
def test_malformed_unicode_escape_names_the_line(bad):
    text = f"first=1\n# comment\nsecond={bad}\n"
    with pytest.raises(PropertiesSyntaxError, match=r"line 3\b.*\\uXXXX"):
        parse_properties(text)


def test_malformed_unicode_escape_in_a_key_names_the_line():
    with pytest.raises(PropertiesSyntaxError, match=r"line 2\b"):
        parse_properties("a=1\nbad\\u00zzkey=2\n")


def test_malformed_unicode_escape_on_a_continued_entry_names_its_first_line():
    with pytest.raises(PropertiesSyntaxError, match=r"line 2\b"):
        parse_properties("a=1\nb=ok \\\n   then \\u12\nc=3\n")


def test_syntax_error_is_a_value_error():
    with pytest.raises(ValueError):
        parse_properties("k=\\uXYZW")


# --- order, duplicates and line numbers -----------------------------------------------------


def test_duplicate_keys_are_all_returned_in_file_order():
    entries = parse_properties("a=1\nb=x\na=2\n")
    assert entries == [
        PropertyEntry("a", "1", 1),
        PropertyEntry("b", "x", 2),
        PropertyEntry("a", "2", 3),
    ]
    assert loaded("a=1\nb=x\na=2\n")["a"] == "2"


def test_line_numbers_count_comments_blank_lines_and_continuations():
    text = (
        "# header\n"  # 1
        "\n"  # 2
        "first=1\n"  # 3
        "second = a \\\n"  # 4
        "   b \\\n"  # 5
        "   c\n"  # 6
        "! comment\n"  # 7
        "   third : 3\n"  # 8
        "\n"  # 9
        "fourth\n"  # 10
    )
    assert [(e.key, e.value, e.line_number) for e in parse_properties(text)] == [
        ("first", "1", 3),
        ("second", "a b c", 4),
        ("third", "3", 8),
        ("fourth", "", 10),
    ]


def test_line_numbers_with_crlf():
    entries = parse_properties("a=1\r\n\r\nb=2\r\n")
    assert [(e.key, e.line_number) for e in entries] == [("a", 1), ("b", 3)]


# --- characters Java does not treat as line ends ------------------------------------


@pytest.mark.parametrize(
    "line",
    ["key\fvalue", "key\f=\fvalue", "key =\t\f value", "key\f:value"],
)
def test_form_feed_is_whitespace_like_space_and_tab(line):
    # Java: key "key", value "value". lmserve: the form feed splits the line into
    # several entries (e.g. "key" -> "" and "value" -> "").
    assert pairs(line + "\n") == [("key", "value")]


@pytest.mark.parametrize("char", ["\u2028", "\u2029", "\x85", "\x0b", "\x1c"])
def test_unicode_line_separators_stay_inside_the_value(char):
    # Java: one entry whose value holds the character; the next entry is on line 2.
    text = f"greeting=hello{char}world\nnext=1\n"
    entries = parse_properties(text)
    assert [(e.key, e.value, e.line_number) for e in entries] == [
        ("greeting", f"hello{char}world", 1),
        ("next", "1", 2),
    ]
