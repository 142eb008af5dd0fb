"""Every way clients ask for structured output reaches the engine as a grammar (OpenAI's
`response_format`, vLLM's `structured_outputs` and `guided_*`, TGI's `parameters.grammar`, on
chat, completions and /invocations alike), and a bad schema, regex or grammar is a 400 naming
its field before anything reaches the engine."""

from __future__ import annotations

import json

import llguidance
import pytest

from lmserve.handlers.djl.request_parsing import parse_payload
from lmserve.handlers.job import BadRequest
from lmserve.handlers.openai.chat import parse_chat
from lmserve.handlers.openai.completions import parse_completion

MESSAGES = [{"role": "user", "content": "hi"}]
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def chat_grammar(**fields) -> str | None:
    return parse_chat({"messages": MESSAGES, **fields}).params.grammar


@pytest.fixture(scope="module")
def vocabulary(smollm2_dir) -> llguidance.LLTokenizer:
    return llguidance.LLTokenizer((smollm2_dir / "tokenizer.json").read_text())


def accepts(vocabulary, grammar: str, text: str) -> bool:
    """Whether `grammar` matches `text` whole."""
    matcher = llguidance.LLMatcher(vocabulary, grammar, log_level=0)
    tokens = vocabulary.tokenize_str(text)
    return matcher.validate_tokens(tokens) == len(tokens) and (
        matcher.consume_tokens(tokens) and matcher.is_accepting()
    )


@pytest.mark.parametrize(
    "fields",
    [
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": SCHEMA},
            }
        },
        {"structured_outputs": {"json": SCHEMA}},
        {"guided_json": json.dumps(SCHEMA)},
    ],
)
def test_json_schema_in_each_spelling(vocabulary, fields):
    grammar = chat_grammar(**fields)
    assert accepts(vocabulary, grammar, '{"a": 5}')
    assert not accepts(vocabulary, grammar, '{"a": "five"}') and not accepts(
        vocabulary, grammar, "{}"
    )


def test_json_object_regex_choice_and_grammar(vocabulary):
    assert accepts(
        vocabulary, chat_grammar(response_format={"type": "json_object"}), '{"k": [1, 2]}'
    )
    assert not accepts(vocabulary, chat_grammar(response_format={"type": "json_object"}), "[1]")
    assert chat_grammar(response_format={"type": "text"}) is None
    regex = chat_grammar(structured_outputs={"regex": "[0-9]{3}"})
    assert accepts(vocabulary, regex, "123") and not accepts(vocabulary, regex, "12a")
    choice = chat_grammar(structured_outputs={"choice": ["yes", "no"]})
    assert accepts(vocabulary, choice, "no") and not accepts(vocabulary, choice, "maybe")
    gbnf = chat_grammar(structured_outputs={"grammar": 'root ::= "a" "b"*'})
    assert accepts(vocabulary, gbnf, "abbb") and not accepts(vocabulary, gbnf, "ba")
    lark = chat_grammar(guided_grammar='start: "x" | "y"')
    assert accepts(vocabulary, lark, "y")


def test_completions_and_tgi_take_them_too(vocabulary):
    completion = parse_completion({"prompt": "p", "structured_outputs": {"regex": "a+"}})
    assert accepts(vocabulary, completion.params.grammar, "aaa")
    tgi = parse_payload(
        {"inputs": "p", "parameters": {"grammar": {"type": "json", "value": SCHEMA}}}
    )
    assert accepts(vocabulary, tgi.params.grammar, '{"a": 1}')
    regex = parse_payload(
        {"inputs": "p", "parameters": {"grammar": {"type": "regex", "value": "b"}}}
    )
    assert accepts(vocabulary, regex.params.grammar, "b")
    # /invocations with OpenAI's bodies goes through the same parsers (llm_handler.dialect_of).


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"schema": {"type": "nope"}},
                }
            },
            "response_format.json_schema.schema",
        ),
        ({"structured_outputs": {"regex": "[a-"}}, "structured_outputs.regex"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
        ({"structured_outputs": {"grammar": "root ::= undefined"}}, "structured_outputs.grammar"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
        ({"structured_outputs": "json"}, "structured_outputs"),
        ({"guided_json": "{not json"}, "guided_json"),
        ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "response_format"),
        ({"structured_outputs": {"json": {"$ref": "#/missing"}}}, "structured_outputs.json"),
    ],
)
def test_bad_structured_outputs_are_400_naming_the_field(fields, field):
    with pytest.raises(BadRequest) as refused:
        chat_grammar(**fields)
    assert refused.value.status == 400
    assert refused.value.field.startswith(field)


@pytest.mark.parametrize(
    ("grammar", "field"),
    [
        ({"type": "xml", "value": "x"}, "parameters.grammar.type"),
        ({"type": "regex"}, "parameters.grammar"),
        ({"type": "regex", "value": "("}, "parameters.grammar.value"),
        ({"type": "json", "value": {"type": 5}}, "parameters.grammar.value"),
    ],
)
def test_bad_tgi_grammars_are_400_naming_the_field(grammar, field):
    with pytest.raises(BadRequest) as refused:
        parse_payload({"inputs": "p", "parameters": {"grammar": grammar}})
    assert refused.value.field == field
