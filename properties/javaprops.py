"""Java `.properties` syntax, as `java.util.Properties.load` reads it.

DJL users write serving.properties by hand and copy snippets from Java docs, so every corner of
the format matters: `=`, `:` or whitespace between key and value, `#`/`!` comment lines,
backslash line continuation (leading whitespace of the next line dropped), and escapes
(`\\t`, `\\n`, `\\uXXXX`, `\\=`, `\\:`, `\\ `, ...).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_SEPARATORS = "=:"
_WHITESPACE = " \t\f"
_ESCAPES = {"t": "\t", "n": "\n", "r": "\r", "f": "\f"}
# Java ends lines only here; str.splitlines() would also split at \f, \v, \x85, \u2028 ...
_LINE_BREAK = re.compile(r"\r\n|\r|\n")


class PropertiesSyntaxError(ValueError):
    pass


@dataclass(frozen=True)
class PropertyEntry:
    key: str
    value: str
    line_number: int  # where the (first physical line of the) entry starts


def parse_properties(text: str) -> list[PropertyEntry]:
    """Entries in file order; a later duplicate key overrides an earlier one for callers that
    build a dict, exactly as Java does."""
    return [_split_entry(line, number) for line, number in _logical_lines(text)]


def _logical_lines(text: str):
    """Yields (logical line, first line number), joining continued lines and skipping blanks and
    comments. A line continues when it ends in an odd number of backslashes."""
    pending: list[str] = []
    start = 0
    for number, raw in enumerate(_LINE_BREAK.split(text), start=1):
        line = raw.lstrip(_WHITESPACE)
        if not pending:
            if not line or line[0] in "#!":
                continue
            start = number
        trailing = len(line) - len(line.rstrip("\\"))
        if trailing % 2 == 1:
            pending.append(line[:-1])
            continue
        pending.append(line)
        yield "".join(pending), start
        pending = []
    if pending:  # a continuation on the last line simply ends the entry, as in Java
        yield "".join(pending), start


def _split_entry(line: str, number: int) -> PropertyEntry:
    end = _key_end(line)
    rest = line[end:].lstrip(_WHITESPACE)
    if rest and rest[0] in _SEPARATORS:
        rest = rest[1:].lstrip(_WHITESPACE)
    return PropertyEntry(_unescape(line[:end], number), _unescape(rest, number), number)


def _key_end(line: str) -> int:
    i = 0
    while i < len(line):
        char = line[i]
        if char == "\\":
            i += 2
            continue
        if char in _SEPARATORS or char in _WHITESPACE:
            return i
        i += 1
    return len(line)


def _unescape(text: str, number: int) -> str:
    out: list[str] = []
    i = 0
    while i < len(text):
        char = text[i]
        if char != "\\":
            out.append(char)
            i += 1
            continue
        if i + 1 >= len(text):
            i += 1  # a lone trailing backslash (only possible on the file's last line)
            continue
        code = text[i + 1]
        if code == "u":
            digits = text[i + 2 : i + 6]
            if len(digits) != 4 or any(c not in "0123456789abcdefABCDEF" for c in digits):
                raise PropertiesSyntaxError(
                    f"line {number}: malformed \\uXXXX escape {text[i : i + 6]!r}"
                )
            out.append(chr(int(digits, 16)))
            i += 6
            continue
        out.append(_ESCAPES.get(code, code))
        i += 2
    return "".join(out)
