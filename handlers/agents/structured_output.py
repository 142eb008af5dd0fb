"""Structured outputs: what a request asks its generated text to follow, as one grammar.

The names clients send, on every route that takes them:

- OpenAI's `response_format`: `{"type": "json_object"}` or `{"type": "json_schema",
  "json_schema": {"name", "schema", "strict"}}` (`{"type": "text"}`: no constraint);
- vLLM's `structured_outputs`: one of `json` (a schema), `regex`, `choice` (a list of
  strings), `grammar` (EBNF: llama.cpp's GBNF or Lark) or `json_object: true`; its older
  top-level `guided_json`, `guided_regex`, `guided_choice` and `guided_grammar` too;
- TGI's `parameters.grammar`: `{"type": "json" | "regex", "value": ...}`.

Each becomes an llguidance grammar (a JSON string), checked here so a bad schema or grammar is
a 400 naming its field before anything reaches the engine. The engine compiles it against the
model's vocabulary and masks each step's logits with it (rolling_batch/core/grammar.py). llguidance
was chosen over xgrammar: no dependencies (xgrammar pulls triton and a TVM runtime), a lazy
lexer that builds a grammar in about a millisecond (no compile step to wait for), and
validation without a tokenizer, which keeps this side torch-free. Torch-free.
"""

from __future__ import annotations

import json
from typing import Any

import llguidance

from ..job import BadRequest

# JSON is written as Python's json.dumps writes it: one space after ',' and ':', no other
# whitespace. A grammar that allows any whitespace lets a small model spend its tokens on
# newlines and indents (or never stop); a schema's own `x-guidance` options may still ask.
_JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_VLLM_KINDS = ("json", "regex", "choice", "grammar", "json_object")
_LEGACY_VLLM = {f"guided_{kind}": kind for kind in ("json", "regex", "choice", "grammar")}


def json_schema_grammar(schema: Any, field: str) -> str:
    """The grammar of JSON text that validates against `schema` (an object, or JSON text)."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as error:
            raise BadRequest(field, f"not JSON: {error}") from None
    if not isinstance(schema, (dict, bool)):
        raise BadRequest(field, f"expected a JSON schema object, got {schema!r}")
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=_JSON_LAYOUT)
    except (ValueError, TypeError) as error:
        raise BadRequest(field, f"not a usable JSON schema: {error}") from None
    return _checked(grammar, field)


def openai_structured_output(payload: dict[str, Any]) -> str | None:
    """The grammar an OpenAI body (chat or completions) asks for, or None."""
    sources = {
        name: payload[name]
        for name in ("response_format", "structured_outputs", *_LEGACY_VLLM)
        if payload.get(name) is not None
    }
    if not sources:
        return None
    if len(sources) > 1:
        raise BadRequest(", ".join(sources), "set one of these, not several")
    ((name, value),) = sources.items()
    if name == "response_format":
        return _response_format(value)
    if name == "structured_outputs":
        return _vllm_structured_outputs(value)
    return _vllm_kind(_LEGACY_VLLM[name], value, name)


def tgi_grammar(value: Any, field: str = "parameters.grammar") -> str | None:
    """TGI's `parameters.grammar`: `{"type": "json", "value": schema}` or `{"type": "regex",
    "value": pattern}`."""
    if value is None:
        return None
    if not isinstance(value, dict) or "value" not in value:
        raise BadRequest(field, 'expected {"type": "json" | "regex", "value": ...}')
    kind = value.get("type")
    if kind in ("json", "json_schema"):
        return json_schema_grammar(value["value"], f"{field}.value")
    if kind == "regex":
        return _vllm_kind("regex", value["value"], f"{field}.value")
    raise BadRequest(f"{field}.type", f'expected "json" or "regex", got {kind!r}')


def _response_format(value: Any) -> str | None:
    field = "response_format"
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return json_schema_grammar({"type": "object"}, field)
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise BadRequest(f"{field}.json_schema", 'expected {"name", "schema", "strict"}')
        return json_schema_grammar(spec["schema"], f"{field}.json_schema.schema")
    raise BadRequest(f"{field}.type", f"expected text, json_object or json_schema, got {kind!r}")


def _vllm_structured_outputs(value: Any) -> str | None:
    field = "structured_outputs"
    if not isinstance(value, dict):
        raise BadRequest(field, f"expected an object with one of {', '.join(_VLLM_KINDS)}")
    # vLLM's own knobs beside the constraint (which backend, whitespace) change nothing here.
    given = [kind for kind in _VLLM_KINDS if value.get(kind) not in (None, False)]
    if len(given) != 1:
        raise BadRequest(field, f"set exactly one of {', '.join(_VLLM_KINDS)}")
    (kind,) = given
    return _vllm_kind(kind, value[kind], f"{field}.{kind}")


def _vllm_kind(kind: str, value: Any, field: str) -> str:
    if kind == "json":
        return json_schema_grammar(value, field)
    if kind == "json_object":
        return json_schema_grammar({"type": "object"}, field)
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(v, str) for v in value):
            raise BadRequest(field, "expected a non-empty list of strings")
        lark = "start: " + " | ".join(json.dumps(choice) for choice in value)
        return _checked(llguidance.LLMatcher.grammar_from_lark(lark), field)
    if not isinstance(value, str) or not value:
        raise BadRequest(field, "expected a non-empty string")
    if kind == "regex":
        return _checked(llguidance.LLMatcher.grammar_from_regex(value), field)
    try:  # GBNF or Lark, told apart by llguidance
        grammar = llguidance.grammar_from("grammar", value)
    except ValueError as error:
        raise BadRequest(field, str(error)) from None
    return _checked(grammar, field)


def _checked(grammar: str, field: str) -> str:
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:
        raise BadRequest(field, f"invalid: {error.strip()}")
    return grammar
