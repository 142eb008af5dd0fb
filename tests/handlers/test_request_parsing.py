"""Request bodies: the accepted shapes and their defaults, and a 400 naming the field for each
kind of bad input."""

from __future__ import annotations

import json

import pytest

from lmserve.handlers.djl.request_parsing import BadRequest, parse_body, parse_payload
from lmserve.rolling_batch.ipc.protocol import GenerationParams


def parse(payload, content_type="application/json"):
    body = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    return parse_body(body, content_type)


def test_defaults_follow_the_contract():
    request = parse({"inputs": "hi"})
    assert request.prompts == ["hi"] and not request.batched
    assert request.params == GenerationParams(max_new_tokens=30, do_sample=False)
    assert request.stop_sequences == () and not request.details and not request.return_full_text


def test_all_parameters_are_read():
    request = parse(
        {
            "inputs": ["a", "b"],
            "parameters": {
                "max_new_tokens": 5,
                "do_sample": True,
                "temperature": 0.5,
                "top_k": 7,
                "top_p": 0.9,
                "repetition_penalty": 1.2,
                "seed": 3,
                "stop_sequences": ["\n"],
                "details": True,
                "return_full_text": True,
                "ignore_eos_token": True,
            },
        }
    )
    assert request.batched and request.prompts == ["a", "b"]
    assert request.params == GenerationParams(5, True, 0.5, 7, 0.9, 1.2, 3, True)
    assert request.stop_sequences == ("\n",)
    assert request.details and request.return_full_text


def test_text_plain_body_is_one_input():
    request = parse_body(b"Tell me a story", "text/plain; charset=utf-8")
    assert request.prompts == ["Tell me a story"]


def test_form_encoded_json_from_curl_is_read_as_json():
    assert parse({"inputs": "x"}, "application/x-www-form-urlencoded").prompts == ["x"]


def test_temperature_zero_means_greedy():
    request = parse({"inputs": "x", "parameters": {"do_sample": True, "temperature": 0}})
    assert request.params.do_sample is False


def test_integral_floats_are_integers_but_fractions_are_not():
    assert parse({"inputs": "x", "parameters": {"max_new_tokens": 8.0}}).params.max_new_tokens == 8
    with pytest.raises(BadRequest) as error:
        parse({"inputs": "x", "parameters": {"max_new_tokens": 8.5}})
    assert error.value.field == "parameters.max_new_tokens"


def test_unknown_parameters_are_ignored_with_a_warning(caplog):
    request = parse({"inputs": "x", "parameters": {"beam_width": 2}})
    assert request.params == GenerationParams()
    assert "beam_width" in caplog.text


@pytest.mark.parametrize(
    ("payload", "field"),
    [
        (b"\xff\xfe", "body"),
        ({"inputs": "x", "parameters": {"temperature": float("inf")}}, "parameters.temperature"),
        ({"inputs": "x", "parameters": {"top_p": True}}, "parameters.top_p"),
        (
            {"inputs": "x", "parameters": {"decoder_input_details": 1}},
            "parameters.decoder_input_details",
        ),
        ({"inputs": "x", "parameters": {"top_n_tokens": 21}}, "parameters.top_n_tokens"),
        ({"inputs": "x", "parameters": {"n": 2}}, "parameters.n"),  # greedy: one sequence
        ({"inputs": "x", "parameters": {"n": 17, "do_sample": True}}, "parameters.n"),
        (
            {"inputs": "x", "parameters": {"n": 3, "best_of": 2, "do_sample": True}},
            "parameters.best_of",
        ),
        ({"inputs": "x", "parameters": {"stop_sequences": [""]}}, "parameters.stop_sequences"),
        ({"inputs": "x", "stream": 1}, "stream"),
        ({"inputs": None}, "inputs"),
    ],
)
def test_bad_values_name_their_field(payload, field):
    with pytest.raises(BadRequest) as error:
        parse(payload)
    assert error.value.field == field
    assert error.value.status == 400


def test_empty_text_plain_body_is_refused():
    with pytest.raises(BadRequest) as error:
        parse_body(b"  ", "text/plain")
    assert error.value.field == "inputs"


# --- TGI's and DJL's other spellings ----------------------------------------------------------


def test_stream_in_parameters_is_honoured_and_the_top_level_wins():
    assert parse({"inputs": "x", "parameters": {"stream": True}}).stream
    both = {"inputs": "x", "stream": False, "parameters": {"stream": True}}
    assert not parse(both).stream  # DJL copies the top-level value over the parameter


def test_tgi_stop_is_read_beside_stop_sequences():
    request = parse({"inputs": "x", "parameters": {"stop": ["\n", "END"]}})
    assert request.stop_sequences == ("\n", "END")
    both = {"inputs": "x", "parameters": {"stop_sequences": ["a", "b"], "stop": "b"}}
    assert parse(both).stop_sequences == ("a", "b")


def test_truncate_and_output_formatter_are_carried():
    request = parse({"inputs": "x", "parameters": {"truncate": 8, "output_formatter": "sse"}})
    assert (request.truncate, request.output_formatter) == (8, "sse")
    assert parse({"inputs": "x"}).truncate is None


def test_tgi_compat_turns_details_on_unless_the_request_turns_them_off():
    assert parse_payload({"inputs": "x"}, tgi_compat=True).details
    off = {"inputs": "x", "parameters": {"details": False}}
    assert not parse_payload(off, tgi_compat=True).details
    assert not parse_payload({"inputs": "x"}).details


@pytest.mark.parametrize(
    ("parameters", "field"),
    [
        ({"truncate": 0}, "parameters.truncate"),  # TGI: strictly positive
        ({"truncate": "all"}, "parameters.truncate"),
        ({"stop": [""]}, "parameters.stop"),
        ({"stream": "yes"}, "parameters.stream"),
        ({"output_formatter": "xml"}, "parameters.output_formatter"),
        ({"output_formatter": "my_function"}, "parameters.output_formatter"),
        ({"cache_salt": ""}, "parameters.cache_salt"),
        ({"cache_salt": 7}, "parameters.cache_salt"),
    ],
)
def test_bad_tgi_and_djl_parameters_name_their_field(parameters, field):
    with pytest.raises(BadRequest) as error:
        parse({"inputs": "x", "parameters": parameters})
    assert error.value.field == field


def test_adapters_name_one_adapter_for_all_inputs_or_one_each():
    one = parse_payload({"inputs": ["a", "b"], "adapters": "sql"})
    assert [one.params_of_prompt(i).adapter for i in range(2)] == ["sql", "sql"]
    each = parse_payload({"inputs": ["a", "b", "c"], "adapters": ["sql", None, ""]})
    assert [each.params_of_prompt(i).adapter for i in range(3)] == ["sql", None, None]
    assert parse_payload({"inputs": "a"}).params.adapter is None
    assert parse_payload({"inputs": "a", "adapters": ""}).params.adapter is None


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        ({"inputs": ["a", "b"], "adapters": ["sql"]}, "1 adapters for 2 inputs"),
        ({"inputs": "a", "adapters": ["sql"]}, "expected a string, got"),
        ({"inputs": ["a"], "adapters": 3}, "a list of strings as long as `inputs`"),
        ({"inputs": ["a"], "adapters": [3]}, "a list of strings as long as `inputs`"),
    ],
)
def test_bad_adapters_are_refused_naming_the_field(payload, message):
    with pytest.raises(BadRequest, match=message) as refused:
        parse_payload(payload)
    assert refused.value.field == "adapters"


def test_openai_model_names_an_adapter_only_with_lora_on():
    from lmserve.handlers.openai.chat import parse_chat
    from lmserve.handlers.openai.completions import parse_completion

    chat = {"model": "sql", "messages": [{"role": "user", "content": "Hi"}]}
    assert parse_chat(chat).params.adapter is None  # LoRA off: `model` is a label
    assert parse_chat(chat, served_model="base").params.adapter == "sql"
    assert parse_chat({**chat, "model": "base"}, served_model="base").params.adapter is None
    completion = {"model": "sql", "prompt": "Hi"}
    assert parse_completion(completion, served_model="base").params.adapter == "sql"


def test_cache_salt_is_read_on_every_route():
    from lmserve.handlers.openai.chat import parse_chat
    from lmserve.handlers.openai.completions import parse_completion

    djl = {"inputs": "Hi", "parameters": {"cache_salt": "tenant-a"}}
    assert parse_payload(djl).params.cache_salt == "tenant-a"
    assert parse_payload({"inputs": "Hi"}).params.cache_salt is None
    chat = {"messages": [{"role": "user", "content": "Hi"}], "cache_salt": "tenant-b"}
    assert parse_chat(chat).params.cache_salt == "tenant-b"
    completion = {"prompt": "Hi", "cache_salt": "tenant-c"}
    assert parse_completion(completion).params.cache_salt == "tenant-c"
    with pytest.raises(BadRequest) as refused:
        parse_chat({**chat, "cache_salt": ""})
    assert refused.value.field == "cache_salt"


def test_only_openai_requests_that_ask_for_logprobs_get_them_computed():
    """The engine may pick a greedy token without its log-prob where the answer shows none:
    OpenAI's without `logprobs`; DJL's and TGI's token details always show them."""
    from lmserve.handlers.openai.chat import parse_chat
    from lmserve.handlers.openai.completions import parse_completion

    chat = {"messages": [{"role": "user", "content": "Hi"}], "temperature": 0}
    assert parse_chat(chat).params.log_probs is False
    assert parse_chat({**chat, "logprobs": True}).params.log_probs is True
    completion = {"prompt": "Hi", "temperature": 0}
    assert parse_completion(completion).params.log_probs is False
    assert parse_completion({**completion, "logprobs": 0}).params.log_probs is True
    assert parse({"inputs": "Hi"}).params.log_probs is True


def test_openai_routes_read_vllms_sampling_extensions():
    """vLLM's `ignore_eos` (benchmarks ask for exactly `max_tokens` tokens with it), `top_k`
    (-1 and 0 are off) and `repetition_penalty`, on both routes."""
    from lmserve.handlers.openai.chat import parse_chat
    from lmserve.handlers.openai.completions import parse_completion

    chat = {"messages": [{"role": "user", "content": "Hi"}]}
    assert parse_chat(chat).params.ignore_eos is False
    extended = {"ignore_eos": True, "top_k": 5, "repetition_penalty": 1.3}
    for params in (
        parse_chat({**chat, **extended}).params,
        parse_completion({"prompt": "Hi", **extended}).params,
    ):
        assert (params.ignore_eos, params.top_k, params.repetition_penalty) == (True, 5, 1.3)
    assert parse_completion({"prompt": "Hi", "top_k": -1}).params.top_k == 0
    with pytest.raises(BadRequest, match="ignore_eos"):
        parse_completion({"prompt": "Hi", "ignore_eos": "yes"})


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("logit_bias", {"2": -100}),
        ("best_of", 2),
        ("suffix", "end"),
        ("min_p", 0.1),
        ("min_tokens", 4),
        ("stop_token_ids", [2]),
        ("use_beam_search", True),
    ],
)
def test_openai_parameters_that_would_change_the_answer_are_refused_not_ignored(field, value):
    from lmserve.handlers.openai.chat import parse_chat
    from lmserve.handlers.openai.completions import parse_completion

    with pytest.raises(BadRequest, match=field):
        parse_completion({"prompt": "Hi", field: value})
    with pytest.raises(BadRequest, match=field):
        parse_chat({"messages": [{"role": "user", "content": "Hi"}], field: value})


def test_openai_parameters_at_their_neutral_values_are_accepted():
    """Clients that send every field with its default (as SDKs may) are served."""
    from lmserve.handlers.openai.completions import parse_completion

    neutral = {"logit_bias": {}, "best_of": 1, "suffix": "", "min_p": 0.0, "min_tokens": 0}
    neutral |= {"stop_token_ids": [], "use_beam_search": False}
    assert parse_completion({"prompt": "Hi", **neutral}).prompts == ["Hi"]
