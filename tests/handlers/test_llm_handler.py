"""The built-in LLM handler against a fake engine: payloads in, DJL/TGI/OpenAI answers out, bad
input refused with the field named, engine failures answered, and every request the engine saw
finished exactly once. No server, no model weights: SmolLM2's tokenizer and a scripted engine
that speaks the real protocol (token events while streaming, one final event)."""

from __future__ import annotations

import json
import queue
import sys
import threading
import time

import msgspec
import pytest

from lmserve.handlers.interface import HandlerRequest, HandlerResponse, Route
from lmserve.handlers.llm_handler import LLMHandler
from lmserve.handlers.tokenizer import Tokenizer
from lmserve.properties.config import load_config
from lmserve.rolling_batch.ipc import protocol
from lmserve.rolling_batch.ipc.runtime import Runtime

REPLY = " Paris is the capital of France."
SLOW_S = 2.5  # a generation longer than the tests' option.predict_timeout of 1 s


class FakeEngine:
    """Answers each generate message with the tokens of REPLY (cut to max_new_tokens), the way
    the rolling engine does: a token event per token when streamed, then a final event.
    `behaviour` "silent" never answers (and is never heard from), "refuse" sends a 503 error
    event, "fail_midway" sends one token and then an error, "slow" takes `SLOW_S` to answer a
    request that is not streamed while the engine keeps answering between its steps (it is
    heard from whenever the handler looks, however seldom the machine lets that be)."""

    def __init__(self, tokenizer: Tokenizer, eos_id: int, behaviour: str = "answer"):
        self.reply_ids = tokenizer.encode(REPLY, add_special_tokens=False)
        self.eos_id = eos_id
        self.behaviour = behaviour
        self.messages: list[protocol.GenerateRequest] = []
        self.finished: dict[str, list[bool]] = {}  # request id -> abort flags, in order
        self._heard = time.monotonic()
        self._stepping = False  # a slow answer is under way

    def last_heard(self) -> float:
        return time.monotonic() if self._stepping else self._heard

    def submit(
        self, message: protocol.GenerateRequest, events: queue.SimpleQueue | None = None
    ) -> queue.SimpleQueue[protocol.Event]:
        self.messages.append(message)
        events = queue.SimpleQueue() if events is None else events
        request_id = message.id
        if self.behaviour == "silent":
            return events
        if self.behaviour == "slow":
            self._stepping = True
            threading.Thread(target=self._answer_slowly, args=(message, events)).start()
            return events
        if self.behaviour == "refuse":
            events.put(protocol.queue_full_event(request_id, 4))
            return events
        limit = message.params.max_new_tokens
        tokens = (self.reply_ids + [self.eos_id])[:limit]
        reason = "eos_token" if tokens[-1] == self.eos_id else "length"
        params = message.params
        # A seeded sequence's log-probs depend on its seed: best_of has something to rank.
        log_prob = -0.5 if params.seed is None else -0.1 * (1 + params.seed % 7)
        log_probs = [log_prob] * len(tokens)
        # Asked-for alternatives: the chosen token first, then the two ids after it.
        tops = [
            [(t, log_prob), (t + 1, -2.0), (t + 2, -3.0)][: params.top_logprobs] for t in tokens
        ]
        prompt = {}
        if params.prompt_logprobs:
            prompt["prompt_log_probs"] = [-1.0 - i for i in range(len(message.prompt_ids) - 1)]
        if self.behaviour == "fail_midway":
            events.put(self._token(request_id, tokens[0]))
            events.put(protocol.ErrorEvent(request_id, 500, "rank 1 died"))
            return events
        if message.stream:
            for index, token in enumerate(tokens[:-1]):
                top = [tops[index]] if params.top_logprobs else None
                first = prompt if index == 0 else {}
                events.put(protocol.TokenEvent(request_id, [token], [log_prob], top, **first))
            top = tops[-1:] if params.top_logprobs else None
            first = prompt if len(tokens) == 1 else {}
            final = protocol.FinalEvent(request_id, tokens[-1:], log_probs[-1:], reason, 1, top)
            events.put(msgspec.structs.replace(final, **first))
        else:
            top = tops if params.top_logprobs else None
            final = protocol.FinalEvent(request_id, tokens, log_probs, reason, 1, top, **prompt)
            events.put(final)
        return events

    def _answer_slowly(self, message, events) -> None:
        """Steps for SLOW_S (at least); stats answers between steps keep it heard from."""
        time.sleep(SLOW_S)
        self._heard = time.monotonic()
        self._stepping = False
        tokens = self.reply_ids[: message.params.max_new_tokens]
        final = protocol.FinalEvent(message.id, tokens, [-0.5] * len(tokens), "length", 1)
        events.put(final)

    def finish(self, request_id: str, abort: bool) -> None:
        self.finished.setdefault(request_id, []).append(abort)

    @staticmethod
    def _token(request_id: str, token: int) -> protocol.TokenEvent:
        return protocol.TokenEvent(request_id, [token], [-0.5])

    def assert_each_finished_once(self) -> None:
        submitted = [m.id for m in self.messages]
        assert sorted(submitted) == sorted(self.finished)
        assert all(len(flags) == 1 for flags in self.finished.values()), self.finished


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    return Tokenizer(smollm2_dir)


def make_handler(
    smollm2_dir, tokenizer, behaviour="answer", formatters=None, **env
) -> tuple[LLMHandler, FakeEngine]:
    """`formatters`: a model.py (path) whose formatters wrap the handler."""
    environ = {"OPTION_MAX_MODEL_LEN": "128", **env}
    config = load_config(None, environ).config
    user_dir = str(formatters.parent) if formatters else None
    runtime = Runtime(
        config,
        "smollm2",
        str(smollm2_dir),
        "test",
        "/nonexistent",
        formatters=str(formatters) if formatters else None,
        user_dir=user_dir,
    )
    eos_id = tokenizer.encode("<|im_end|>", add_special_tokens=False)[0]
    engine = FakeEngine(tokenizer, eos_id, behaviour)
    return LLMHandler(runtime, engine), engine


def call(handler, payload, route=Route.INVOCATIONS, content_type="application/json", **headers):
    body = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    request = HandlerRequest(body, content_type, "req-1", route, headers)
    return handler.handle(request)


def stream_lines(answer: HandlerResponse) -> list[str]:
    assert answer.stream is not None
    return "".join(answer.stream).splitlines()


def test_text_request_gets_djl_shape_and_prompt_reaches_engine(smollm2_dir, tokenizer):
    handler, engine = make_handler(smollm2_dir, tokenizer)
    answer = call(
        handler, {"inputs": "The capital of France is", "parameters": {"max_new_tokens": 40}}
    )
    assert answer.status == 200
    assert answer.json == {"generated_text": REPLY}
    (message,) = engine.messages
    assert message.prompt_ids == tokenizer.encode("The capital of France is")
    assert message.params.max_new_tokens == 40
    assert message.stream is False
    engine.assert_each_finished_once()
    assert engine.finished[message.id] == [False]  # ended by the engine: nothing to abort


def test_list_of_inputs_gets_list_of_outputs(smollm2_dir, tokenizer):
    handler, engine = make_handler(smollm2_dir, tokenizer)
    answer = call(handler, {"inputs": ["a", "b", "c"], "parameters": {"max_new_tokens": 3}})
    cut = tokenizer.decode(engine.reply_ids[:3])
    assert answer.json == [{"generated_text": cut}] * 3
    assert len(engine.messages) == 3
    engine.assert_each_finished_once()


def test_details_and_tgi_compat(smollm2_dir, tokenizer):
    handler, _ = make_handler(smollm2_dir, tokenizer, OPTION_TGI_COMPAT="true")
    payload = {"inputs": "Hi", "parameters": {"max_new_tokens": 2, "details": True}}
    (output,) = call(handler, payload).json  # TGI answers a list even for one input
    assert output["details"]["finish_reason"] == "length"
    assert output["details"]["generated_tokens"] == 2
    assert set(output["details"]["tokens"][0]) == {"id", "text", "logprob", "special"}


def test_stop_sequence_cuts_the_text(smollm2_dir, tokenizer):
    handler, engine = make_handler(smollm2_dir, tokenizer)
    payload = {
        "inputs": "Hi",
        "parameters": {"max_new_tokens": 40, "stop_sequences": [" capital"], "details": True},
    }
    output = call(handler, payload).json
    assert output["generated_text"] == " Paris is the"
    assert output["details"]["finish_reason"] == "stop_sequence"
    # The engine streamed the tokens to the front end, which stopped it at the stop sequence.
    (message,) = engine.messages
    assert message.stream is True and engine.finished[message.id] == [True]


def test_a_request_without_stop_sequences_is_not_streamed_from_the_engine(smollm2_dir, tokenizer):
    handler, engine = make_handler(smollm2_dir, tokenizer)
    call(handler, {"inputs": "Hi", "parameters": {"max_new_tokens": 40}})
    (message,) = engine.messages
    assert message.stream is False and engine.finished[message.id] == [False]


def test_log_probs_are_computed_only_for_answers_that_show_them(smollm2_dir, tokenizer):
    """A JSON answer without details shows none (the engine may pick greedy tokens without
    them); details, best_of's ranking and streamed tokens need them."""
    handler, engine = make_handler(smollm2_dir, tokenizer)
    payloads = [
        {"inputs": "Hi"},
        {"inputs": "Hi", "parameters": {"details": True}},
        {"inputs": "Hi", "parameters": {"best_of": 2, "do_sample": True}},
        {"inputs": "Hi", "stream": True},
    ]
    for payload in payloads:
        call(handler, payload)
    assert [m.params.log_probs for m in engine.messages] == [False, True, True, True, True]


def test_jsonlines_stream_token_by_token(smollm2_dir, tokenizer):
    handler, engine = make_handler(smollm2_dir, tokenizer)
    answer = call(handler, {"inputs": "Hi", "stream": True, "parameters": {"max_new_tokens": 40}})
    assert answer.content_type == "application/jsonlines"
    events = [json.loads(line) for line in stream_lines(answer)]
    assert "".join(e["token"]["text"] for e in events) == REPLY
    assert events[-1]["generated_text"] == REPLY
    assert engine.messages[0].stream is True
    engine.assert_each_finished_once()


def test_sse_when_the_client_accepts_it_and_stop_sequence_aborts(smollm2_dir, tokenizer):
    handler, engine = make_handler(smollm2_dir, tokenizer)
    payload = {"inputs": "Hi", "stream": True, "parameters": {"stop_sequences": [" is"]}}
    answer = call(handler, payload, Accept="text/event-stream")
    assert answer.content_type == "text/event-stream"
    events = [json.loads(line.removeprefix("data: ")) for line in stream_lines(answer) if line]
    assert events[-1]["generated_text"] == " Paris"
    # The engine would go on generating: the stop sequence ends the request there too.
    assert engine.finished[engine.messages[0].id] == [True]


def test_chat_completion_with_usage(smollm2_dir, tokenizer):
    handler, engine = make_handler(smollm2_dir, tokenizer)
    payload = {"messages": [{"role": "user", "content": "Capital of France?"}], "max_tokens": 40}
    answer = call(handler, payload, Route.CHAT_COMPLETIONS)
    assert answer.json["object"] == "chat.completion", answer.json
    assert answer.json["choices"][0]["message"]["content"] == REPLY
    assert answer.json["choices"][0]["finish_reason"] == "stop"
    prompt_ids = engine.messages[0].prompt_ids
    assert tokenizer.decode(prompt_ids).endswith("Capital of France?\nassistant\n")
    assert answer.json["usage"]["prompt_tokens"] == len(prompt_ids)


def test_chat_too_long_names_max_tokens(smollm2_dir, tokenizer):
    handler, engine = make_handler(smollm2_dir, tokenizer)
    payload = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 120}
    answer = call(handler, payload, Route.CHAT_COMPLETIONS)
    assert (answer.status, answer.json["error"]["param"]) == (400, "max_tokens")
    assert engine.messages == []


def test_invocations_reads_the_dialect_from_the_body(smollm2_dir, tokenizer):
    """As LMI's vLLM-based handler: `messages` is chat, `prompt` OpenAI completions,
    `inputs` DJL's schema, all on /invocations."""
    handler, engine = make_handler(smollm2_dir, tokenizer)
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 40}
    assert call(handler, chat).json["object"] == "chat.completion"
    completion = call(handler, {"prompt": "Capital?", "max_tokens": 40})
    assert completion.json["object"] == "text_completion"
    assert completion.json["choices"][0]["text"] == REPLY
    assert engine.messages[-1].prompt_ids == tokenizer.encode("Capital?")
    both = call(handler, {"inputs": "Capital?", "prompt": "ignored"})
    assert both.json == {"generated_text": REPLY}
    bad = call(handler, {"prompt": 3})
    assert (bad.status, bad.json["field"]) == (400, "prompt")


def test_chat_route_refuses_a_text_payload(smollm2_dir, tokenizer):
    handler, engine = make_handler(smollm2_dir, tokenizer)
    answer = call(handler, {"inputs": "Hi"}, Route.CHAT_COMPLETIONS)
    assert answer.status == 400
    assert answer.json["error"]["param"] == "messages"  # OpenAI's error shape
    assert engine.messages == []


@pytest.mark.parametrize(
    ("payload", "field"),
    [
        (b"{not json", "body"),
        ({"inputs": 3}, "inputs"),
        ({"inputs": "Hi", "parameters": {"max_new_tokens": "ten"}}, "parameters.max_new_tokens"),
        ({"inputs": "word " * 200}, "inputs"),  # over option.max_model_len (128 tokens)
        ({"inputs": "Hi", "parameters": {"max_new_tokens": 128}}, "parameters.max_new_tokens"),
    ],
)
def test_bad_input_is_400_naming_the_field_and_never_reaches_the_engine(
    smollm2_dir, tokenizer, payload, field
):
    handler, engine = make_handler(smollm2_dir, tokenizer)
    answer = call(handler, payload)
    assert answer.status == 400
    assert answer.json["field"] == field
    assert field in answer.json["message"]
    assert engine.messages == []


def test_engine_refusal_is_its_status(smollm2_dir, tokenizer):
    handler, engine = make_handler(smollm2_dir, tokenizer, behaviour="refuse")
    answer = call(handler, {"inputs": "Hi"})
    assert answer.status == 503
    assert "job queue full" in answer.json["message"]
    engine.assert_each_finished_once()


def test_silent_engine_times_out_with_424(smollm2_dir, tokenizer):
    handler, engine = make_handler(smollm2_dir, tokenizer, "silent", OPTION_PREDICT_TIMEOUT="1")
    answer = call(handler, {"inputs": "Hi"})
    assert answer.status == 424
    assert "option.predict_timeout" in answer.json["error"]
    assert engine.finished[engine.messages[0].id] == [True]  # the engine is told to drop it


def test_a_generation_longer_than_predict_timeout_is_never_cut(smollm2_dir, tokenizer):
    """option.predict_timeout bounds a wait for the engine, not a generation (DJL's meaning):
    an engine that keeps stepping answers however long the request takes."""
    handler, engine = make_handler(smollm2_dir, tokenizer, "slow", OPTION_PREDICT_TIMEOUT="1")
    started = time.monotonic()
    answer = call(handler, {"inputs": "Hi", "parameters": {"max_new_tokens": 3}})
    assert time.monotonic() - started > SLOW_S
    assert answer.status == 200 and answer.json == {"generated_text": " Paris is the"}
    engine.assert_each_finished_once()


def test_failure_after_the_first_token_ends_the_stream_with_an_error_event(smollm2_dir, tokenizer):
    handler, engine = make_handler(smollm2_dir, tokenizer, behaviour="fail_midway")
    answer = call(handler, {"inputs": "Hi", "stream": True})
    assert answer.status == 200  # the first token was on its way before the failure
    events = [json.loads(line) for line in stream_lines(answer)]
    assert events[-1] == {"code": 500, "error": "rank 1 died"}
    assert "token" in events[0]
    engine.assert_each_finished_once()


def test_a_client_that_leaves_mid_stream_aborts_the_request(smollm2_dir, tokenizer):
    handler, engine = make_handler(smollm2_dir, tokenizer)
    answer = call(handler, {"inputs": "Hi", "stream": True, "parameters": {"max_new_tokens": 40}})
    next(answer.stream)
    answer.stream.close()  # what the WSGI server does when the connection drops
    assert engine.finished[engine.messages[0].id] == [True]


FORMATTERS = """
import json

from djl_python.input_parser import input_formatter
from djl_python.output_formatter import output_formatter


@input_formatter
def from_question(input_item):
    request = input_item.get_as_json()
    return {
        "inputs": f"Q: {request['question']} A:",
        "parameters": {"max_new_tokens": 40},
        "stream": request.get("stream", False),
    }


@output_formatter
def one_line_per_token(output):
    sequence = output.sequences[output.best_sequence_index]
    pieces = []
    while sequence.has_next_token():
        token, first, last = sequence.get_next_token()
        line = {"t": token.text, "first": first}
        if last:
            line["finish"] = sequence.finish_reason
            line["prompt"] = output.input.input_text
        pieces.append(json.dumps(line) + "\\n")
    return "".join(pieces)
"""


@pytest.fixture
def model_py(tmp_path):
    """Writes a model.py (the text given) and forgets the module it was imported as after."""

    def write(text: str):
        path = tmp_path / "model.py"
        path.write_text(text)
        return path

    yield write
    sys.modules.pop("model", None)


@pytest.fixture
def formatters_file(model_py):
    return model_py(FORMATTERS)


def test_model_py_formatters_reshape_request_and_answer(smollm2_dir, tokenizer, formatters_file):
    handler, engine = make_handler(smollm2_dir, tokenizer, formatters=formatters_file)
    answer = call(handler, {"question": "Capital of France?"})
    assert answer.status == 200 and answer.content_type.startswith("text/plain")
    lines = [json.loads(line) for line in answer.body.decode().splitlines()]
    assert "".join(line["t"] for line in lines) == REPLY
    assert [line["first"] for line in lines] == [True] + [False] * (len(lines) - 1)
    assert lines[-1]["finish"] == "eos_token" and lines[-1]["prompt"] == "Q: Capital of France? A:"
    assert engine.messages[0].prompt_ids == tokenizer.encode("Q: Capital of France? A:")


def test_an_output_formatter_refuses_several_sequences_naming_the_field(
    smollm2_dir, tokenizer, model_py
):
    """A model.py's formatter answers one sequence: `n` is refused, not ignored."""
    handler, engine = make_handler(
        smollm2_dir, tokenizer, formatters=model_py(OUTPUT_FORMATTER_ONLY)
    )
    answer = call(handler, {"inputs": "Hi", "parameters": {"n": 2, "do_sample": True}})
    assert (answer.status, answer.json["field"]) == (400, "parameters.n")
    assert engine.messages == []


def test_output_formatter_streams_its_strings(smollm2_dir, tokenizer, formatters_file):
    handler, engine = make_handler(smollm2_dir, tokenizer, formatters=formatters_file)
    answer = call(handler, {"question": "x", "stream": True})
    assert answer.content_type == "application/jsonlines"
    pieces = [json.loads(piece) for piece in answer.stream]
    assert len(pieces) == len(engine.reply_ids) + 1  # one string per token, EOS included
    assert "".join(piece["t"] for piece in pieces) == REPLY
    assert pieces[0]["first"] and pieces[-1]["finish"] == "eos_token"


def test_input_formatter_failure_is_a_400_naming_the_body(smollm2_dir, tokenizer, formatters_file):
    handler, engine = make_handler(smollm2_dir, tokenizer, formatters=formatters_file)
    answer = call(handler, {"no_question": 1})
    assert (answer.status, answer.json["field"]) == (400, "body")
    assert "the input formatter failed: KeyError('question')" in answer.json["message"]
    assert engine.messages == []


def test_output_formatter_by_option_name(smollm2_dir, tokenizer, formatters_file):
    handler, _ = make_handler(
        smollm2_dir,
        tokenizer,
        formatters=formatters_file,
        OPTION_OUTPUT_FORMATTER="model:one_line_per_token",
    )
    assert handler.formatters.output.__name__ == "one_line_per_token"


# --- OpenAI completions ------------------------------------------------------------------------


def test_completion_with_echo_logprobs_and_usage(smollm2_dir, tokenizer):
    handler, engine = make_handler(smollm2_dir, tokenizer)
    payload = {"prompt": "Capital?", "max_tokens": 40, "temperature": 0, "echo": True,
               "logprobs": 0}  # fmt: skip
    answer = call(handler, payload, Route.COMPLETIONS)
    assert answer.status == 200, answer.json
    (choice,) = answer.json["choices"]
    assert choice["text"] == "Capital?" + REPLY and choice["finish_reason"] == "stop"
    # echo with logprobs: the prompt's tokens come first, the first without a log-prob.
    logprobs = choice["logprobs"]
    prompt_ids = engine.messages[0].prompt_ids
    assert engine.messages[0].params.prompt_logprobs
    assert "".join(logprobs["tokens"]).startswith("Capital?" + REPLY)
    assert logprobs["token_logprobs"][: len(prompt_ids)] == [None, -1.0, -2.0][: len(prompt_ids)]
    offsets = logprobs["text_offset"]
    assert offsets[0] == 0 and offsets[len(prompt_ids)] == len("Capital?")
    assert logprobs["top_logprobs"] is None
    usage = answer.json["usage"]
    assert usage["prompt_tokens"] == len(engine.messages[0].prompt_ids)
    assert usage["completion_tokens"] == len(engine.reply_ids) + 1  # the EOS counts
    assert engine.messages[0].params.do_sample is False


def test_completion_defaults_to_openais_16_tokens_and_streams(smollm2_dir, tokenizer):
    handler, engine = make_handler(smollm2_dir, tokenizer)
    payload = {"prompt": "Hi", "stream": True, "stream_options": {"include_usage": True}}
    answer = call(handler, payload, Route.COMPLETIONS)
    assert engine.messages[0].params.max_new_tokens == 16
    events = [line.removeprefix("data: ") for line in stream_lines(answer) if line]
    assert events[-1] == "[DONE]"
    *chunks, usage = [json.loads(event) for event in events[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == REPLY
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert "usage" not in chunks[-1]
    # stream_options.include_usage: one more chunk, OpenAI's, with no choices and the usage
    assert (
        usage["choices"] == [] and usage["usage"]["completion_tokens"] == len(engine.reply_ids) + 1
    )


def test_a_stream_without_include_usage_has_no_usage(smollm2_dir, tokenizer):
    handler, _ = make_handler(smollm2_dir, tokenizer)
    answer = call(handler, {"prompt": "Hi", "stream": True}, Route.COMPLETIONS)
    chunks = [
        json.loads(line[6:]) for line in stream_lines(answer) if line and "[DONE]" not in line
    ]
    assert all("usage" not in chunk for chunk in chunks)


@pytest.mark.parametrize(
    ("payload", "param"),
    [
        ({"prompt": ""}, "prompt"),
        ({"prompt": ["a", 3]}, "prompt"),
        ({"prompt": "a", "n": 17}, "n"),
        ({"prompt": "a", "logprobs": 21}, "logprobs"),
        ({"prompt": "a", "logprobs": 1, "echo": True, "stream": True}, "logprobs"),
        ({"prompt": ["a", "b"], "stream": True}, "prompt"),
        ({"prompt": "a", "max_tokens": 500}, "max_tokens"),
        ({"prompt": "a", "stream_options": {"include_usage": True}}, "stream_options"),
        (
            {"prompt": "a", "stream": True, "stream_options": {"include_usage": 1}},
            "stream_options.include_usage",
        ),  # fmt: skip
    ],
)
def test_bad_completions_are_openai_errors_naming_the_param(smollm2_dir, tokenizer, payload, param):
    handler, engine = make_handler(smollm2_dir, tokenizer)
    answer = call(handler, payload, Route.COMPLETIONS)
    assert answer.status == 400
    assert answer.json["error"]["param"] == param
    assert answer.json["error"]["type"] == "invalid_request_error"
    assert engine.messages == []


# --- TGI's and DJL's request schema: parameters.stream, stop, truncate, output_formatter -------


def sse_events(answer: HandlerResponse) -> list[dict]:
    assert answer.content_type == "text/event-stream"
    return [json.loads(line.removeprefix("data: ")) for line in stream_lines(answer) if line]


def test_stream_asked_inside_parameters_streams(smollm2_dir, tokenizer):
    handler, engine = make_handler(smollm2_dir, tokenizer)
    answer = call(handler, {"inputs": "Hi", "parameters": {"max_new_tokens": 40, "stream": True}})
    assert answer.content_type == "application/jsonlines"
    events = [json.loads(line) for line in stream_lines(answer)]
    assert "".join(e["token"]["text"] for e in events) == REPLY
    assert engine.messages[0].stream is True


def test_tgi_stop_ends_the_text_like_stop_sequences(smollm2_dir, tokenizer):
    handler, _ = make_handler(smollm2_dir, tokenizer)
    payload = {"inputs": "Hi", "parameters": {"max_new_tokens": 40, "stop": [" capital"]}}
    assert call(handler, payload).json == {"generated_text": " Paris is the"}


def test_truncate_keeps_the_last_prompt_tokens(smollm2_dir, tokenizer):
    handler, engine = make_handler(smollm2_dir, tokenizer)
    prompt = "word " * 200  # over the context of 128 tokens without truncate
    payload = {"inputs": prompt, "parameters": {"max_new_tokens": 5, "truncate": 16}}
    assert call(handler, payload).status == 200
    assert engine.messages[0].prompt_ids == tokenizer.encode(prompt)[-16:]


def test_truncate_longer_than_the_prompt_keeps_it_whole(smollm2_dir, tokenizer):
    handler, engine = make_handler(smollm2_dir, tokenizer)
    call(handler, {"inputs": "The capital of France is", "parameters": {"truncate": 100}})
    assert engine.messages[0].prompt_ids == tokenizer.encode("The capital of France is")


def test_truncate_beyond_the_context_is_refused(smollm2_dir, tokenizer):
    """TGI refuses a `truncate` over its max input length; here the context (128) less the
    one new token that must fit."""
    handler, engine = make_handler(smollm2_dir, tokenizer)
    answer = call(handler, {"inputs": "Hi", "parameters": {"truncate": 128}})
    assert (answer.status, answer.json["field"]) == (400, "parameters.truncate")
    assert "<= 127" in answer.json["message"]
    assert engine.messages == []


def test_tgi_compat_answers_with_details_unless_turned_off(smollm2_dir, tokenizer):
    handler, _ = make_handler(smollm2_dir, tokenizer, OPTION_TGI_COMPAT="true")
    (output,) = call(handler, {"inputs": "Hi", "parameters": {"max_new_tokens": 2}}).json
    assert output["details"]["generated_tokens"] == 2
    assert len(output["details"]["tokens"]) == 2
    quiet = {"inputs": "Hi", "parameters": {"max_new_tokens": 2, "details": False}}
    assert call(handler, quiet).json == [{"generated_text": output["generated_text"]}]


def test_tgi_compat_stream_is_sse_ending_with_details_without_tokens(smollm2_dir, tokenizer):
    handler, _ = make_handler(smollm2_dir, tokenizer, OPTION_TGI_COMPAT="true")
    answer = call(handler, {"inputs": "Hi", "stream": True, "parameters": {"max_new_tokens": 3}})
    events = sse_events(answer)
    assert [e["details"] for e in events[:-1]] == [None, None]
    assert events[-1]["details"] == {"finish_reason": "length", "generated_tokens": 3,
                                     "inputs": "Hi"}  # fmt: skip


def test_stream_last_details_leave_out_tokens(smollm2_dir, tokenizer):
    """DJL's jsonlines/sse formatter: every token was its own event, so the last one's
    details say only why and how many."""
    handler, engine = make_handler(smollm2_dir, tokenizer)
    payload = {"inputs": "Hi", "stream": True, "parameters": {"details": True}}
    last = json.loads(stream_lines(call(handler, payload))[-1])
    assert last["generated_text"] == REPLY
    assert last["details"] == {
        "finish_reason": "eos_token",
        "generated_tokens": len(engine.reply_ids) + 1,  # the EOS counts
        "inputs": "Hi",
    }


def test_request_output_formatter_sse_streams_without_stream(smollm2_dir, tokenizer):
    handler, _ = make_handler(smollm2_dir, tokenizer)
    answer = call(handler, {"inputs": "Hi", "parameters": {"output_formatter": "sse"}})
    assert sse_events(answer)[-1]["generated_text"] == REPLY


def test_request_output_formatter_json_answers_once_even_when_streaming(smollm2_dir, tokenizer):
    handler, _ = make_handler(smollm2_dir, tokenizer, OPTION_OUTPUT_FORMATTER="jsonlines")
    payload = {"inputs": "Hi", "stream": True, "parameters": {"output_formatter": "json"}}
    answer = call(handler, payload)
    assert answer.stream is None and answer.json == {"generated_text": REPLY}


def test_request_output_formatter_jsonlines_under_tgi_compat(smollm2_dir, tokenizer):
    """Named jsonlines stays jsonlines (DJL), with TGI's token keys."""
    handler, _ = make_handler(smollm2_dir, tokenizer, OPTION_TGI_COMPAT="true")
    payload = {"inputs": "Hi", "parameters": {"output_formatter": "jsonlines"}}
    answer = call(handler, payload)
    assert answer.content_type == "application/jsonlines"
    first = json.loads(stream_lines(answer)[0])
    assert set(first["token"]) == {"id", "text", "logprob", "special"}


OUTPUT_FORMATTER_ONLY = """
from djl_python.output_formatter import output_formatter


@output_formatter
def shout(output):  # called once per new token
    token, _, _ = output.sequences[output.best_sequence_index].get_next_token()
    return token.text.upper()
"""


def test_request_output_formatter_wins_over_a_model_py_formatter(smollm2_dir, tokenizer, model_py):
    handler, _ = make_handler(smollm2_dir, tokenizer, formatters=model_py(OUTPUT_FORMATTER_ONLY))
    assert call(handler, {"inputs": "Hi"}).body.decode() == REPLY.upper()
    named = {"inputs": "Hi", "parameters": {"output_formatter": "json"}}
    assert call(handler, named).json == {"generated_text": REPLY}


def test_n_choices_per_prompt_with_their_own_seeds(smollm2_dir, tokenizer):
    handler, engine = make_handler(smollm2_dir, tokenizer)
    payload = {"prompt": ["a", "b"], "n": 3, "seed": 7, "max_tokens": 4}
    answer = call(handler, payload, Route.COMPLETIONS)
    assert [c["index"] for c in answer.json["choices"]] == list(range(6))
    # Three sequences of each prompt, in prompt order, seeded 7, 8, 9 (reproducible, distinct).
    assert [m.params.seed for m in engine.messages] == [7, 8, 9, 7, 8, 9]
    prompts = [tuple(m.prompt_ids) for m in engine.messages]
    assert prompts[:3] == [tuple(tokenizer.encode("a"))] * 3
    usage = answer.json["usage"]
    assert usage["prompt_tokens"] == len(tokenizer.encode("a")) + len(tokenizer.encode("b"))
    assert usage["completion_tokens"] == 6 * 4
    engine.assert_each_finished_once()


def test_chat_n_choices(smollm2_dir, tokenizer):
    handler, engine = make_handler(smollm2_dir, tokenizer)
    payload = {"messages": [{"role": "user", "content": "Hi"}], "n": 2, "max_tokens": 5}
    answer = call(handler, payload, Route.CHAT_COMPLETIONS)
    assert [c["index"] for c in answer.json["choices"]] == [0, 1]
    assert answer.json["usage"]["completion_tokens"] == 10
    assert answer.json["usage"]["prompt_tokens"] == len(engine.messages[0].prompt_ids)
    assert len(engine.messages) == 2


# --- several sequences and log-probs -----------------------------------------------------------


def test_best_of_answers_the_most_likely_and_lists_the_next_n_minus_one(smollm2_dir, tokenizer):
    handler, engine = make_handler(smollm2_dir, tokenizer)
    parameters = {"do_sample": True, "seed": 3, "n": 2, "best_of": 3, "max_new_tokens": 4}
    answer = call(handler, {"inputs": "Hi", "parameters": parameters})
    assert answer.status == 200, answer.json
    # Three sequences seeded 3, 4, 5; the fake scores them -0.4, -0.5, -0.6 a token.
    assert [m.params.seed for m in engine.messages] == [3, 4, 5]
    details = answer.json["details"]  # on without asking: the other sequences live there
    assert [t["log_prob"] for t in details["tokens"]] == pytest.approx([-0.4] * 4)
    (other,) = details["best_of_sequences"]
    assert [t["log_prob"] for t in other["tokens"]] == pytest.approx([-0.5] * 4)
    text = tokenizer.decode(engine.reply_ids[:4])
    assert other["generated_text"] == answer.json["generated_text"] == text
    engine.assert_each_finished_once()


def test_top_n_tokens_and_decoder_input_details_in_details(smollm2_dir, tokenizer):
    handler, engine = make_handler(smollm2_dir, tokenizer, OPTION_TGI_COMPAT="true")
    parameters = {"top_n_tokens": 2, "decoder_input_details": True, "max_new_tokens": 3}
    (answer,) = call(handler, {"inputs": "Capital of France?", "parameters": parameters}).json
    params = engine.messages[0].params
    assert params.top_logprobs == 2 and params.prompt_logprobs
    details = answer["details"]
    ids = [t["id"] for t in details["tokens"]]
    assert [[t["id"] for t in top] for top in details["top_tokens"]] == [[i, i + 1] for i in ids]
    prompt_ids = engine.messages[0].prompt_ids
    assert [t["id"] for t in details["prefill"]] == prompt_ids
    assert details["prefill"][0]["logprob"] is None and details["prefill"][1]["logprob"] == -1.0


@pytest.mark.parametrize(
    ("parameters", "field"),
    [
        ({"n": 2, "do_sample": True}, "parameters.n"),
        ({"best_of": 2, "do_sample": True}, "parameters.best_of"),
        ({"decoder_input_details": True}, "parameters.decoder_input_details"),
    ],
)
def test_what_lmi_does_not_stream_is_refused_when_streaming(
    smollm2_dir, tokenizer, parameters, field
):
    handler, engine = make_handler(smollm2_dir, tokenizer)
    answer = call(handler, {"inputs": "Hi", "parameters": parameters, "stream": True})
    assert answer.status == 400 and answer.json["field"] == field
    assert not engine.messages


def test_chat_logprobs_with_top_alternatives(smollm2_dir, tokenizer):
    handler, engine = make_handler(smollm2_dir, tokenizer)
    payload = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3,
               "logprobs": True, "top_logprobs": 2}  # fmt: skip
    answer = call(handler, payload, Route.CHAT_COMPLETIONS)
    assert engine.messages[0].params.top_logprobs == 2
    content = answer.json["choices"][0]["logprobs"]["content"]
    ids = engine.reply_ids[:3]
    assert [entry["token"] for entry in content] == [tokenizer.token_text(i) for i in ids]
    assert content[0]["bytes"] == list(content[0]["token"].encode())
    assert [[alt["token"] for alt in e["top_logprobs"]] for e in content] == [
        [tokenizer.token_text(i), tokenizer.token_text(i + 1)] for i in ids
    ]
    assert content[0]["top_logprobs"][1]["logprob"] == -2.0


def test_chat_streams_n_choices_each_with_its_logprobs(smollm2_dir, tokenizer):
    handler, engine = make_handler(smollm2_dir, tokenizer)
    payload = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "n": 2,
               "stream": True, "logprobs": True,
               "stream_options": {"include_usage": True}}  # fmt: skip
    answer = call(handler, payload, Route.CHAT_COMPLETIONS)
    events = [line.removeprefix("data: ") for line in stream_lines(answer) if line]
    assert events.count("[DONE]") == 1 and events[-1] == "[DONE]"
    *chunks, usage = [json.loads(event) for event in events[:-1]]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 8
    for index in (0, 1):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == index]
        assert [c["delta"].get("role") for c in mine].count("assistant") == 1
        assert "".join(c["delta"].get("content", "") for c in mine) == tokenizer.decode(
            engine.reply_ids[:4]
        )
        assert [c["finish_reason"] for c in mine][-1] == "length"
        assert sum(len(c["logprobs"]["content"]) for c in mine if c["logprobs"]) == 4
    engine.assert_each_finished_once()


def test_completion_logprobs_list_the_alternatives_and_the_chosen_token(smollm2_dir, tokenizer):
    handler, engine = make_handler(smollm2_dir, tokenizer)
    payload = {"prompt": "Capital?", "max_tokens": 3, "logprobs": 1, "temperature": 0.7}
    answer = call(handler, payload, Route.COMPLETIONS)
    assert engine.messages[0].params.top_logprobs == 1
    logprobs = answer.json["choices"][0]["logprobs"]
    chosen = [tokenizer.token_text(i) for i in engine.reply_ids[:3]]
    assert logprobs["tokens"] == chosen and logprobs["token_logprobs"] == [-0.5] * 3
    assert logprobs["top_logprobs"] == [{token: -0.5} for token in chosen]


DETAILS_FORMATTER = """
import json

from djl_python.output_formatter import output_formatter


@output_formatter
def with_log_probs(output):
    if not output.finished:
        return ""
    parameters = output.input.parameters
    return json.dumps({
        "top": output.get_top_tokens_as_dict(output.best_sequence_index),
        "prefill": output.get_prompt_tokens_as_dict(),
        "asked": [parameters["top_n_tokens"], parameters["decoder_input_details"]],
    })
"""


def test_an_output_formatter_reads_top_tokens_and_the_prompts_log_probs(
    smollm2_dir, tokenizer, model_py
):
    handler, engine = make_handler(smollm2_dir, tokenizer, formatters=model_py(DETAILS_FORMATTER))
    parameters = {"max_new_tokens": 3, "top_n_tokens": 2, "decoder_input_details": True}
    answer = call(handler, {"inputs": "Capital of France?", "parameters": parameters})
    shaped = json.loads(answer.body)
    assert shaped["asked"] == [2, True]
    ids = engine.reply_ids[:3]
    assert [[t["id"] for t in top] for top in shaped["top"]] == [[i, i + 1] for i in ids]
    assert [t["id"] for t in shaped["prefill"]] == engine.messages[0].prompt_ids
    assert shaped["prefill"][0]["log_prob"] is None and shaped["prefill"][1]["log_prob"] == -1.0
