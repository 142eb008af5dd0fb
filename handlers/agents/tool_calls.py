"""Tool calls in chat: OpenAI's `tools`, `tool_choice` and `parallel_tool_calls`, read from the
request; `required` and a named function enforced with a grammar, so even a small model
answers with a call that parses; and the model's own tool-call text (`auto`) read into
`tool_calls`, whole or while the text grows (a stream).

Each format reads the text from its start every time (answers are short) into the content so
far and the calls so far, each call with its name once complete and its arguments' JSON text
so far. Whatever is read from a longer text extends what was read from a shorter one, so a
stream sends the differences: a call's name in one delta, its arguments in pieces, and no
markup in `content` (a tail that may be the start of a call's markup waits).

The formats (option.tool_call_parser, as vLLM names them):
- `hermes` (Hermes, Qwen 2.5/3): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
  repeated; text around the calls is content;
- `llama3_json` (Llama 3.1+): an answer that is a JSON object `{"name", "parameters"}` (its
  `<|python_tag|>` is a special token, left out of the text), several joined by `;`;
- `mistral`: `[TOOL_CALLS]` (a special token, so maybe not in the text) then a JSON list of
  `{"name", "arguments"}`; text before it is content.
`tool_choice: "required"` generates a JSON list of `{"name", "parameters"}` (read like
mistral's), a named function its arguments object alone. Torch-free.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from ..job import BadRequest
from .structured_output import json_schema_grammar

_DECODER = json.JSONDecoder()
_SPACE = re.compile(r"\s*")


@dataclass(frozen=True)
class ToolChoice:
    """`mode`: none, auto, required, or function (`name` says which)."""

    mode: str
    name: str | None = None
    parallel: bool = True  # parallel_tool_calls: several calls in one answer

    @property
    def forced(self) -> bool:
        return self.mode in ("required", "function")


def read_tools(value: Any) -> list[dict[str, Any]] | None:
    """OpenAI's `tools`: each `{"type": "function", "function": {"name", "description",
    "parameters"}}`, passed to the chat template as given."""
    if value is None:
        return None
    if not isinstance(value, list):
        raise BadRequest("tools", "expected a list of tool objects")
    for index, tool in enumerate(value):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise BadRequest(f"tools[{index}].function", 'expected {"name", "parameters"}')
        parameters = function.get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            raise BadRequest(f"tools[{index}].function.parameters", "expected a JSON schema")
    return value or None


def read_tool_choice(payload: dict[str, Any], tools: list[dict] | None) -> ToolChoice:
    """`tool_choice` (default: auto with tools, none without) and `parallel_tool_calls`."""
    value = payload.get("tool_choice")
    parallel = payload.get("parallel_tool_calls", True)
    if parallel is None:
        parallel = True
    if not isinstance(parallel, bool):
        raise BadRequest("parallel_tool_calls", f"expected true or false, got {parallel!r}")
    if value is None:
        return ToolChoice("auto" if tools else "none", parallel=parallel)
    if value in ("none", "auto", "required"):
        if value != "none" and not tools:
            raise BadRequest("tool_choice", f"{value!r} needs `tools`")
        return ToolChoice(value, parallel=parallel)
    function = value.get("function") if isinstance(value, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str):
        raise BadRequest(
            "tool_choice",
            'expected "none", "auto", "required" or {"type": "function", "function": {"name"}}',
        )
    if name not in _functions(tools):
        raise BadRequest("tool_choice.function.name", f"no tool named {name!r} in `tools`")
    return ToolChoice("function", name, parallel)


def forced_grammar(choice: ToolChoice, tools: list[dict]) -> str:
    """The grammar of the answer a forced choice allows: the named function's arguments, or
    (required) a JSON list of calls, one or more (exactly one without parallel_tool_calls)."""
    functions = _functions(tools)
    if choice.mode == "function":
        return json_schema_grammar(_parameters(functions[choice.name]), "tool_choice")
    calls = [
        {
            "type": "object",
            "properties": {"name": {"const": name}, "parameters": _parameters(function)},
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for name, function in functions.items()
    ]
    schema = {"type": "array", "items": {"anyOf": calls}, "minItems": 1}
    if not choice.parallel:
        schema["maxItems"] = 1
    return json_schema_grammar(schema, "tools")


def _functions(tools: list[dict] | None) -> dict[str, dict]:
    return {tool["function"]["name"]: tool["function"] for tool in tools or ()}


def _parameters(function: dict) -> dict:
    return function.get("parameters") or {"type": "object"}


# --- reading calls out of text ------------------------------------------------------------


@dataclass
class CallText:
    """One call as far as the text shows it: `name` once its string is complete, the
    arguments' JSON text so far, and whether the call's JSON is complete."""

    name: str | None = None
    arguments: str = ""
    complete: bool = False


@dataclass
class Reading:
    """A text read as an answer: its content so far and its calls so far. `malformed`: the
    calls' markup started but is not valid (the whole text is then content)."""

    content: str
    calls: list[CallText] = field(default_factory=list)
    malformed: bool = False


class _Malformed(ValueError):
    pass


class ToolCallFormat:
    """Reads calls out of a model's text; `final`: the text is the whole answer."""

    def read(self, text: str, final: bool) -> Reading:
        try:
            reading = self._read(text, final)
        except _Malformed:
            return Reading(text, malformed=True)
        if final and any(not call.complete or call.name is None for call in reading.calls):
            return Reading(text, malformed=True)  # cut short (length) or never closed
        return reading

    def _read(self, text: str, final: bool) -> Reading:
        raise NotImplementedError


class HermesFormat(ToolCallFormat):
    START, END = "<tool_call>", "</tool_call>"

    def _read(self, text: str, final: bool) -> Reading:
        content, calls, position = [], [], 0
        while True:
            start = text.find(self.START, position)
            if start < 0:
                rest = text[position:]
                content.append(rest if final else without_partial(rest, self.START))
                break
            content.append(text[position:start])
            call, end = _read_call(text, start + len(self.START))
            calls.append(call)
            if end is None:
                break
            closing = _SPACE.match(text, end).end()
            if not text.startswith(self.END, closing):
                if not self.END.startswith(text[closing:]):
                    raise _Malformed(f"expected {self.END}")
                break  # the closing tag is still coming
            position = closing + len(self.END)
        return Reading("".join(content), calls)


class JsonListFormat(ToolCallFormat):
    """A JSON list of calls, after `marker` when there is one (text before it is content);
    without the marker in the text, an answer starting with `[` is the list (mistral's
    [TOOL_CALLS] is a special token that decoding leaves out)."""

    def __init__(self, marker: str | None = None):
        self.marker = marker

    def _read(self, text: str, final: bool) -> Reading:
        start = text.find(self.marker) if self.marker else -1
        if start >= 0:
            content, position = text[:start], start + len(self.marker)
        else:
            position = _SPACE.match(text).end()
            if position == len(text) and not final:
                return Reading("")
            if not text.startswith("[", position):
                if self.marker and not final:
                    return Reading(without_partial(text, self.marker))
                if self.marker:
                    return Reading(text)
                raise _Malformed("expected a JSON list of calls")
            content = ""
        return Reading(content, _read_list(text, position))


class Llama3JsonFormat(ToolCallFormat):
    """An answer that starts with `{` is one or more calls joined by `;`; any other answer is
    content."""

    def _read(self, text: str, final: bool) -> Reading:
        position = _SPACE.match(text).end()
        if position == len(text):
            return Reading(text if final else "")
        if text[position] != "{":
            return Reading(text)
        calls = []
        while True:
            call, end = _read_call(text, position)
            calls.append(call)
            if end is None:
                return Reading("", calls)
            position = _SPACE.match(text, end).end()
            if position == len(text):
                return Reading("", calls)
            if text[position] != ";":
                raise _Malformed("expected ; between calls")
            position = _SPACE.match(text, position + 1).end()
            if position == len(text):
                return Reading("", calls)


class NamedFunctionFormat(ToolCallFormat):
    """`tool_choice` names the function: the whole answer is its arguments."""

    def __init__(self, name: str):
        self.name = name

    def _read(self, text: str, final: bool) -> Reading:
        return Reading("", [CallText(self.name, text, final)])


def _read_list(text: str, position: int) -> list[CallText]:
    """The calls of a JSON list that opens at `position`."""
    calls: list[CallText] = []
    position = _SPACE.match(text, position + 1).end()
    if text.startswith("]", position):
        return calls
    while position < len(text):
        call, end = _read_call(text, position)
        calls.append(call)
        if end is None:
            break
        position = _SPACE.match(text, end).end()
        if position == len(text) or text[position] == "]":
            break
        if text[position] != ",":
            raise _Malformed("expected , between calls")
        position = _SPACE.match(text, position + 1).end()
    return calls


_ARGUMENT_KEYS = ("arguments", "parameters")


def _read_call(text: str, position: int) -> tuple[CallText, int | None]:
    """The call whose JSON object starts at `position` (after spaces), and where it ends (None
    while it is incomplete). Members are read one by one, so an incomplete object still shows
    its name and the arguments so far."""
    position = _SPACE.match(text, position).end()
    call = CallText()
    if position == len(text):
        return call, None
    if text[position] != "{":
        raise _Malformed("expected a JSON object")
    position += 1
    while True:
        position = _SPACE.match(text, position).end()
        if position == len(text):
            return call, None
        if text[position] == "}":
            call.complete = True
            return call, position + 1
        if text[position] == ",":
            position = _SPACE.match(text, position + 1).end()
        key, position = _json_value(text, position)
        if position is None:
            return call, None
        position = _SPACE.match(text, position).end()
        if position == len(text):
            return call, None
        if text[position] != ":":
            raise _Malformed("expected : after a key")
        start = _SPACE.match(text, position + 1).end()
        value, position = _json_value(text, start)
        if key == "name" and position is not None:
            call.name = value if isinstance(value, str) else None
        elif key in _ARGUMENT_KEYS:
            call.arguments = _arguments_text(text, start, position, value)
        if position is None:
            return call, None


def _json_value(text: str, position: int) -> tuple[Any, int | None]:
    """The JSON value at `position` and where it ends; (None, None) while it is incomplete.
    A number at the end of the text may still grow: incomplete too."""
    try:
        value, end = _DECODER.raw_decode(text, position)
    except json.JSONDecodeError as error:
        if _may_continue(text, error):
            return None, None
        raise _Malformed(str(error)) from None
    if end == len(text) and isinstance(value, (int, float)) and not isinstance(value, bool):
        return None, None
    return value, end


def _may_continue(text: str, error: json.JSONDecodeError) -> bool:
    """Whether JSON that failed to decode is only cut short: the error is at the text's end,
    in a string still open, or at a literal's or number's start (where the decoder reports
    those)."""
    if error.pos >= len(text) or error.msg.startswith("Unterminated string"):
        return True
    rest = text[error.pos :]
    return error.msg == "Expecting value" and any(
        word.startswith(rest) for word in ("true", "false", "null", "-")
    )


def _arguments_text(text: str, start: int, end: int | None, value: Any) -> str:
    """A call's arguments as OpenAI sends them, a JSON text: as generated (so far, while
    incomplete). Arguments a model wrote as a JSON string are that string, once complete."""
    if text.startswith('"', start):
        return value if end is not None and isinstance(value, str) else ""
    return text[start:end]


def without_partial(text: str, marker: str) -> str:
    """`text` less a tail that may be the start of `marker`."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return text[:-size]
    return text


def tool_call_format(choice: ToolChoice, parser: str | None) -> ToolCallFormat | None:
    """How a chat answer's tool calls are read: by the forced choice's own shape, or with
    `auto` by the model's format (option.tool_call_parser); None: no calls are read."""
    if choice.mode == "function":
        return NamedFunctionFormat(choice.name)
    if choice.mode == "required":
        return JsonListFormat()
    if choice.mode == "auto" and parser is not None:
        return _PARSERS[parser]()
    return None


_PARSERS = {
    "hermes": HermesFormat,
    "llama3_json": Llama3JsonFormat,
    "mistral": lambda: JsonListFormat("[TOOL_CALLS]"),
}


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def openai_tool_calls(calls: list[CallText]) -> list[dict]:
    """OpenAI's `message.tool_calls` of a whole answer's calls."""
    return [
        {
            "id": call_id(),
            "type": "function",
            "function": {"name": call.name, "arguments": call.arguments},
        }
        for call in calls
    ]
