"""Output shaping with SmolLM2's real tokenizer: stop sequences cut text and tokens together,
details and the TGI shape, and the last event of a stream."""

from __future__ import annotations

import json

import pytest

from lmserve.handlers.djl.answers import DjlResponder
from lmserve.handlers.outputs import Generation, TokenOutput, complete, shape_response, to_json
from lmserve.handlers.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    return Tokenizer(smollm2_dir)


def generated(token_ids, log_probs, finish_reason, **logprobs) -> Generation:
    return Generation(list(token_ids), list(log_probs), finish_reason, **logprobs)


def test_stop_sequence_cuts_text_tokens_and_reason(tokenizer):
    token_ids = tokenizer.encode(" Paris. The city of light is big.")
    log_probs = [-0.5] * len(token_ids)
    completion = complete(
        tokenizer, "Capital:", generated(token_ids, log_probs, "length"), ("light", "big")
    )
    assert completion.text == " Paris. The city of "  # the stop sequence itself is removed
    assert completion.finish_reason == "stop_sequence"
    assert tokenizer.decode(completion.token_ids) == " Paris. The city of light"
    assert len(completion.log_probs) == len(completion.token_ids) < len(token_ids)


def test_no_stop_sequence_keeps_everything(tokenizer):
    token_ids = tokenizer.encode(" Paris.")
    completion = complete(
        tokenizer, "p", generated(token_ids, [0.0] * len(token_ids), "eos_token"), ("x",)
    )
    assert completion.text == " Paris." and completion.finish_reason == "eos_token"
    assert completion.token_ids == token_ids


def test_details_and_full_text(tokenizer):
    token_ids = tokenizer.encode(" Paris") + [2]  # 2 = <|im_end|>, the EOS
    completion = complete(
        tokenizer, "Capital:", generated(token_ids, [-0.1, -0.2], "eos_token"), ()
    )
    output = to_json(completion, tokenizer, details=True, return_full_text=True, tgi_compat=False)
    assert output["generated_text"] == "Capital: Paris"
    details = output["details"]
    assert details["finish_reason"] == "eos_token" and details["generated_tokens"] == 2
    assert details["tokens"][0] == {"id": token_ids[0], "text": " Paris", "log_prob": -0.1}
    assert details["tokens"][1]["text"] == "<|im_end|>"


def test_tgi_compat_token_keys_and_list_shape(tokenizer):
    token_ids = tokenizer.encode(" Paris") + [2]
    completion = complete(tokenizer, "c", generated(token_ids, [-0.1, -0.2], "eos_token"), ())
    output = to_json(completion, tokenizer, details=True, return_full_text=False, tgi_compat=True)
    assert output["details"]["tokens"][1] == {
        "id": 2,
        "text": "<|im_end|>",
        "logprob": -0.2,
        "special": True,
    }
    assert shape_response([output], batched=False, tgi_compat=True) == [output]
    assert shape_response([output], batched=False, tgi_compat=False) == output


@pytest.mark.parametrize("tgi_compat", [False, True])
def test_a_streams_last_event_has_details_without_tokens(tokenizer, tgi_compat):
    token_ids = tokenizer.encode(" Paris") + [2]
    completion = complete(
        tokenizer, "Capital:", generated(token_ids, [-0.1, -0.2], "eos_token"), ()
    )
    fmt = DjlResponder("jsonlines", tgi_compat, tokenizer, details=True, return_full_text=False)
    last = json.loads(fmt.token(TokenOutput(2, "", -0.2, True), completion))
    assert last["generated_text"] == " Paris"
    assert last["details"] == {"finish_reason": "eos_token", "generated_tokens": 2,
                               "inputs": "Capital:"}  # fmt: skip


def test_stream_kind_alone_picks_sse_or_jsonlines(tokenizer):
    """tgi_compat changes the token keys, not the framing: the handler picks the kind."""
    event = {"token": {"id": 1}}
    jsonlines = DjlResponder("jsonlines", True, tokenizer, details=False, return_full_text=False)
    sse = DjlResponder("sse", False, tokenizer, details=False, return_full_text=False)
    assert jsonlines.line(event) == '{"token": {"id": 1}}\n'
    assert jsonlines.content_type == "application/jsonlines"
    assert sse.line(event) == 'data: {"token": {"id": 1}}\n\n'
    assert sse.content_type == "text/event-stream"


@pytest.mark.parametrize("tgi_compat", [False, True])
def test_details_carry_top_tokens_prefill_and_the_other_sequences(tokenizer, tgi_compat):
    """DJL's details: `top_tokens` per generated token (top_n_tokens), `prefill` with the
    prompt's tokens (decoder_input_details; the first has no log-prob), and the other
    sequences of a best_of/n request, each with its own text and tokens."""
    prompt_ids = tokenizer.encode("Capital:")
    paris, rome = tokenizer.encode(" Paris"), tokenizer.encode(" Rome")
    stop_after_paris = generated(
        paris + tokenizer.encode(" is"),
        [-0.1] * (len(paris) + 1),
        "length",
        top_logprobs=[[(t, -0.1), (t + 1, -2.5)] for t in paris + tokenizer.encode(" is")],
        prompt_log_probs=[-3.0] * (len(prompt_ids) - 1),
    )
    best = complete(tokenizer, "Capital:", stop_after_paris, (" is",), prompt_ids)
    other = complete(tokenizer, "Capital:", generated(rome, [-0.9] * len(rome), "length"), ())
    output = to_json(best, tokenizer, True, False, tgi_compat, [other])
    details = output["details"]
    key = "logprob" if tgi_compat else "log_prob"
    # Cut with the stop sequence: the top tokens of the tokens kept, and no more.
    assert output["generated_text"] == " Paris"
    assert len(details["top_tokens"]) == len(details["tokens"]) == len(paris) + 1
    assert [t["id"] for t in details["top_tokens"][0]] == [paris[0], paris[0] + 1]
    assert details["top_tokens"][0][1][key] == -2.5
    assert [t["id"] for t in details["prefill"]] == prompt_ids
    assert [t[key] for t in details["prefill"]] == [None] + [-3.0] * (len(prompt_ids) - 1)
    (sequence,) = details["best_of_sequences"]
    assert sequence["generated_text"] == " Rome" and sequence["generated_tokens"] == len(rome)
    assert [t["id"] for t in sequence["tokens"]] == rome and "top_tokens" not in sequence
    assert best.cumulative_log_prob > other.cumulative_log_prob


def test_a_streamed_token_carries_its_top_tokens(tokenizer):
    fmt = DjlResponder("jsonlines", True, tokenizer, details=False, return_full_text=False)
    event = json.loads(fmt.token(TokenOutput(2, "", -0.2, True, [(2, -0.2), (7, -1.9)]), None))
    assert [t["id"] for t in event["top_tokens"]] == [2, 7]
    assert event["top_tokens"][1]["logprob"] == -1.9
