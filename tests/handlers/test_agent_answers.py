"""Tool calls and reasoning read out of scripted model output (a fake engine speaking the real
protocol, SmolLM2's tokenizer, so markup arrives split across tokens), through the chat
handler, streamed and not: each parser's calls land in `tool_calls` with finish_reason
"tool_calls" and text around them in `content`; a stream sends each call's name in one delta
and its arguments in pieces that add up, never markup as content; malformed calls stay
content; reasoning goes to `reasoning_content`, also where the template opened `<think>`.
Forced choices (`required`, a named function) send a grammar to the engine."""

from __future__ import annotations

import json

import llguidance
import pytest

from lmserve.handlers.agents.tool_calls import ToolChoice, forced_grammar, read_tool_choice
from lmserve.handlers.interface import Route
from lmserve.handlers.job import BadRequest
from lmserve.handlers.tokenizer import Tokenizer

from .test_llm_handler import call, make_handler, stream_lines
from .test_structured_output import accepts

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
ASK = [{"role": "user", "content": "Weather in Paris and the time?"}]
PARIS = {"city": "Paris", "days": 2}

SCRIPTS = {  # parser -> (model output, content expected, calls expected)
    "hermes": (
        "Let me check.\n<tool_call>\n"
        + json.dumps({"name": "get_weather", "arguments": PARIS})
        + "\n</tool_call>\n<tool_call>\n"
        + json.dumps({"name": "get_time", "arguments": {}})
        + "\n</tool_call>",
        "Let me check.",
        [("get_weather", PARIS), ("get_time", {})],
    ),
    "llama3_json": (
        json.dumps({"name": "get_weather", "parameters": PARIS})
        + "; "
        + json.dumps({"name": "get_time", "parameters": {}}),
        None,
        [("get_weather", PARIS), ("get_time", {})],
    ),
    "mistral": (
        "Sure. [TOOL_CALLS]"
        + json.dumps(
            [{"name": "get_weather", "arguments": PARIS}, {"name": "get_time", "arguments": {}}]
        ),
        "Sure.",
        [("get_weather", PARIS), ("get_time", {})],
    ),
}


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    return Tokenizer(smollm2_dir)


@pytest.fixture(scope="module")
def vocabulary(smollm2_dir) -> llguidance.LLTokenizer:
    return llguidance.LLTokenizer((smollm2_dir / "tokenizer.json").read_text())


def handler_saying(smollm2_dir, tokenizer, reply: str, **options):
    environ = {f"OPTION_{key.upper()}": value for key, value in options.items()}
    environ["OPTION_MAX_MODEL_LEN"] = "512"
    handler, engine = make_handler(smollm2_dir, tokenizer, **environ)
    engine.reply_ids = tokenizer.encode(reply, add_special_tokens=False)
    return handler, engine


def chat(handler, stream=False, **fields):
    payload = {"messages": ASK, "max_tokens": 120, "tools": [WEATHER, TIME], "stream": stream}
    return call(handler, {**payload, **fields}, Route.CHAT_COMPLETIONS)


def chunks(answer) -> list[dict]:
    lines = [line[6:] for line in stream_lines(answer) if line.startswith("data: {")]
    return [json.loads(line) for line in lines]


def gathered(answer) -> dict:
    """A stream's deltas put together: content, reasoning, each call's name and argument
    pieces, the finish reason."""
    result = {"content": "", "reasoning": "", "calls": {}, "finish": None}
    for chunk in chunks(answer):
        (choice,) = chunk["choices"]
        delta = choice["delta"]
        result["content"] += delta.get("content") or ""
        result["reasoning"] += delta.get("reasoning_content") or ""
        for piece in delta.get("tool_calls", []):
            call = result["calls"].setdefault(piece["index"], {"names": [], "pieces": []})
            if "name" in piece.get("function", {}):
                call["names"].append(piece["function"]["name"])
                assert piece["id"].startswith("call_") and piece["type"] == "function"
            if piece["function"].get("arguments"):
                call["pieces"].append(piece["function"]["arguments"])
        result["finish"] = choice["finish_reason"] or result["finish"]
    return result


@pytest.mark.parametrize("parser", sorted(SCRIPTS))
def test_auto_tool_calls_are_read_whole(smollm2_dir, tokenizer, parser):
    reply, content, expected = SCRIPTS[parser]
    handler, _ = handler_saying(
        smollm2_dir, tokenizer, reply, enable_auto_tool_choice="true", tool_call_parser=parser
    )
    (choice,) = chat(handler).json["choices"]
    assert choice["finish_reason"] == "tool_calls"
    message = choice["message"]
    assert message["content"] == content
    calls = [
        (c["function"]["name"], json.loads(c["function"]["arguments"]))
        for c in message["tool_calls"]
    ]
    assert calls == expected
    assert all(
        c["id"].startswith("call_") and c["type"] == "function" for c in message["tool_calls"]
    )


@pytest.mark.parametrize("parser", sorted(SCRIPTS))
def test_auto_tool_calls_stream_names_whole_and_arguments_in_pieces(smollm2_dir, tokenizer, parser):
    reply, content, expected = SCRIPTS[parser]
    handler, _ = handler_saying(
        smollm2_dir, tokenizer, reply, enable_auto_tool_choice="true", tool_call_parser=parser
    )
    result = gathered(chat(handler, stream=True))
    assert result["finish"] == "tool_calls"
    assert result["content"].strip() == (content or "")
    for marker in ("<tool_call>", "</tool_call>", "[TOOL_CALLS]", '"name"'):
        assert marker not in result["content"]
    calls = [result["calls"][index] for index in sorted(result["calls"])]
    assert [(c["names"], json.loads("".join(c["pieces"]))) for c in calls] == [
        ([name], arguments) for name, arguments in expected
    ]
    assert len(calls[0]["pieces"]) > 1  # the arguments came as they were generated


def test_text_after_a_call_is_kept_and_a_malformed_call_is_content(smollm2_dir, tokenizer):
    after = '<tool_call>{"name": "get_time", "arguments": {}}</tool_call> Done.'
    handler, _ = handler_saying(
        smollm2_dir, tokenizer, after, enable_auto_tool_choice="true", tool_call_parser="hermes"
    )
    (choice,) = chat(handler).json["choices"]
    assert choice["message"]["content"] == "Done." and len(choice["message"]["tool_calls"]) == 1
    broken = '<tool_call>{"name": "get_time", "arguments": {"x": </tool_call>'
    # Streamed, the call's name went out before the arguments broke: the answer then ends as
    # "stop", with no markup as content. Whole, the text is content.
    handler, _ = handler_saying(
        smollm2_dir, tokenizer, broken, enable_auto_tool_choice="true", tool_call_parser="hermes"
    )
    result = gathered(chat(handler, stream=True))
    assert result["finish"] == "stop" and "<tool_call>" not in result["content"]
    (choice,) = chat(handler).json["choices"]
    assert choice["message"]["content"] == broken and choice["finish_reason"] == "stop"
    truncated = '<tool_call>{"na'  # cut before its name: nothing went out as a call
    for stream in (False, True):
        handler, _ = handler_saying(
            smollm2_dir,
            tokenizer,
            truncated,
            enable_auto_tool_choice="true",
            tool_call_parser="hermes",
        )
        answer = chat(handler, stream=stream)
        if stream:
            result = gathered(answer)
            assert result["content"] == truncated and not result["calls"]
            assert result["finish"] == "stop"
        else:
            (choice,) = answer.json["choices"]
            assert choice["message"]["content"] == truncated
            assert "tool_calls" not in choice["message"] and choice["finish_reason"] == "stop"


def test_auto_needs_the_server_options(smollm2_dir, tokenizer):
    handler, engine = handler_saying(smollm2_dir, tokenizer, "hi")
    answer = chat(handler)
    assert (
        answer.status == 400 and "option.enable_auto_tool_choice" in answer.json["error"]["message"]
    )
    assert answer.json["error"]["param"] == "tool_choice" and not engine.messages
    assert chat(handler, tool_choice="none").json["choices"][0]["message"]["content"] == "hi"


def test_forced_choices_send_their_grammar(smollm2_dir, tokenizer, vocabulary):
    arguments = json.dumps(PARIS)
    handler, engine = handler_saying(smollm2_dir, tokenizer, arguments)
    named = {"type": "function", "function": {"name": "get_weather"}}
    (choice,) = chat(handler, tool_choice=named).json["choices"]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    (call_,) = choice["message"]["tool_calls"]
    assert call_["function"] == {"name": "get_weather", "arguments": arguments}
    grammar = engine.messages[-1].params.grammar
    assert accepts(vocabulary, grammar, arguments) and not accepts(vocabulary, grammar, "{}")

    listed = json.dumps(
        [{"name": "get_weather", "parameters": PARIS}, {"name": "get_time", "parameters": {}}]
    )
    handler, engine = handler_saying(smollm2_dir, tokenizer, listed)
    result = gathered(chat(handler, stream=True, tool_choice="required"))
    assert [c["names"] for c in result["calls"].values()] == [["get_weather"], ["get_time"]]
    grammar = engine.messages[-1].params.grammar
    assert accepts(vocabulary, grammar, listed) and not accepts(vocabulary, grammar, "[]")
    single = forced_grammar(ToolChoice("required", parallel=False), [WEATHER, TIME])
    assert not accepts(vocabulary, single, listed)
    assert accepts(vocabulary, single, json.dumps([{"name": "get_time", "parameters": {}}]))


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"tool_choice": "required", "tools": None}, "tool_choice"),
        (
            {"tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice.function.name",
        ),
        ({"tool_choice": "sometimes"}, "tool_choice"),
        ({"parallel_tool_calls": "yes"}, "parallel_tool_calls"),
        ({"tools": [{"type": "function"}]}, "tools[0].function"),
        ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ],
)
def test_bad_tool_fields_are_400_naming_the_field(smollm2_dir, tokenizer, fields, field):
    handler, engine = handler_saying(smollm2_dir, tokenizer, "hi")
    answer = chat(handler, **fields)
    assert answer.status == 400 and answer.json["error"]["param"] == field
    assert not engine.messages


def test_tool_choice_defaults():
    assert read_tool_choice({}, None) == ToolChoice("none")
    assert read_tool_choice({}, [WEATHER]) == ToolChoice("auto")
    with pytest.raises(BadRequest):
        read_tool_choice({"tool_choice": "auto"}, None)


THOUGHT = "The user asks about Paris. I should answer."


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    ("parser", "reply", "reasoning", "content"),
    [
        ("deepseek_r1", f"<think>{THOUGHT}</think>\n\nIt is sunny.", THOUGHT, "It is sunny."),
        (
            "deepseek_r1",
            f"{THOUGHT}</think>It is sunny.",
            THOUGHT,
            "It is sunny.",
        ),  # opened by R1's template
        ("deepseek_r1", THOUGHT, THOUGHT, ""),  # cut before the answer
        (
            "qwen3",
            f"<think>\n{THOUGHT}\n</think>\n\nIt is sunny.",
            f"\n{THOUGHT}\n",
            "It is sunny.",
        ),
        ("qwen3", "It is sunny.", "", "It is sunny."),  # no thinking
    ],
)
def test_reasoning_is_apart_from_the_answer(
    smollm2_dir, tokenizer, parser, reply, reasoning, content, stream
):
    handler, _ = handler_saying(smollm2_dir, tokenizer, reply, reasoning_parser=parser)
    answer = call(
        handler, {"messages": ASK, "max_tokens": 120, "stream": stream}, Route.CHAT_COMPLETIONS
    )
    if stream:
        result = gathered(answer)
        assert (result["reasoning"], result["content"]) == (reasoning, content)
    else:
        message = answer.json["choices"][0]["message"]
        assert (message["reasoning_content"] or "", message["content"]) == (reasoning, content)


def test_reasoning_then_a_tool_call(smollm2_dir, tokenizer):
    reply = (
        f"<think>{THOUGHT}</think>\n<tool_call>"
        + json.dumps({"name": "get_time", "arguments": {}})
        + "</tool_call>"
    )
    options = {
        "enable_auto_tool_choice": "true",
        "tool_call_parser": "hermes",
        "reasoning_parser": "qwen3",
    }
    handler, _ = handler_saying(smollm2_dir, tokenizer, reply, **options)
    message = chat(handler).json["choices"][0]["message"]
    assert message["reasoning_content"] == THOUGHT and message["content"] is None
    assert message["tool_calls"][0]["function"]["name"] == "get_time"
    result = gathered(chat(handler, stream=True))
    assert result["reasoning"] == THOUGHT and result["content"] == ""
    assert result["calls"][0]["names"] == ["get_time"] and result["finish"] == "tool_calls"


@pytest.mark.parametrize(
    ("parser", "allowed", "refused"),
    [
        ("deepseek_r1", ['<think>Hmm.</think>\n{"a": 1}', 'Hmm.</think>{"a": 1}'], ['{"a": 1}']),
        ("qwen3", ['<think>Hmm.</think>\n\n{"a": 1}', '{"a": 1}'], ['Hmm.</think>{"a": 1}']),
    ],
)
def test_a_grammar_applies_after_the_thinking(
    smollm2_dir, tokenizer, vocabulary, parser, allowed, refused
):
    reply = '<think>Hmm.</think>\n{"a": 1}'
    handler, engine = handler_saying(smollm2_dir, tokenizer, reply, reasoning_parser=parser)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    body = {
        "messages": ASK,
        "max_tokens": 60,
        "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}},
    }
    message = call(handler, body, Route.CHAT_COMPLETIONS).json["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"]) == ("Hmm.", '{"a": 1}')
    grammar = engine.messages[-1].params.grammar
    for text in allowed:
        assert accepts(vocabulary, grammar, text), text
    for text in refused + ['<think>Hmm.</think>{"a": "x"}', "<think>Hmm.</think>"]:
        assert not accepts(vocabulary, grammar, text), text
