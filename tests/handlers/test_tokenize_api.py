"""vLLM's /tokenize and /detokenize through the LLM handler: a prompt's tokens are the ones
generation would use (with or without special tokens), chat messages are counted as the
template renders them, ids decode back to the text, and bad bodies are 400s naming the field in
OpenAI's error shape. A model.py's handler refuses the routes with a 404 instead of passing
them to the user's code."""

from __future__ import annotations

import pytest

from lmserve.handlers.custom.forwarding_handler import ForwardingHandler
from lmserve.handlers.interface import Route
from lmserve.handlers.tokenizer import ChatTemplate
from lmserve.properties.config import load_config
from lmserve.rolling_batch.ipc.runtime import Runtime

from .test_llm_handler import call, make_handler
from .test_llm_handler import tokenizer as tokenizer  # noqa: PLC0414 - the fixture

MESSAGES = [{"role": "user", "content": "How many tokens is this?"}]


def test_tokenize_a_prompt_and_back(smollm2_dir, tokenizer):
    handler, engine = make_handler(smollm2_dir, tokenizer)
    answer = call(handler, {"prompt": "Hello world", "return_token_strs": True}, Route.TOKENIZE)
    assert answer.status == 200, answer.json
    tokens = answer.json["tokens"]
    assert tokens == tokenizer.encode("Hello world")
    assert answer.json["count"] == len(tokens) and answer.json["max_model_len"] == 128
    assert answer.json["token_strs"] == [tokenizer.token_text(t) for t in tokens]
    back = call(handler, {"tokens": tokens}, Route.DETOKENIZE)
    assert back.json == {"prompt": "Hello world"}
    assert not engine.messages  # the engine is not asked


def test_tokenize_chat_messages_as_the_template_renders_them(smollm2_dir, tokenizer):
    handler, _ = make_handler(smollm2_dir, tokenizer)
    answer = call(handler, {"messages": MESSAGES}, Route.TOKENIZE)
    rendered = ChatTemplate(smollm2_dir).render(MESSAGES)
    assert answer.json["tokens"] == tokenizer.encode(rendered, add_special_tokens=False)
    assert answer.json["token_strs"] is None


@pytest.mark.parametrize(
    ("route", "body", "field"),
    [
        (Route.TOKENIZE, {"prompt": 5}, "prompt"),
        (Route.TOKENIZE, {"messages": [{"role": "robot"}]}, "messages[0].role"),
        (
            Route.TOKENIZE,
            {"messages": MESSAGES, "add_generation_prompt": False},
            "add_generation_prompt",
        ),
        (Route.TOKENIZE, {"prompt": "x", "add_special_tokens": "yes"}, "add_special_tokens"),
        (Route.DETOKENIZE, {"tokens": ["a"]}, "tokens"),
        (Route.DETOKENIZE, {"tokens": [2**40]}, "tokens"),
        (Route.DETOKENIZE, {"tokens": [1], "model": {}}, "model"),
        (Route.TOKENIZE, {"prompt": "x", "model": 5}, "model"),
    ],
)
def test_bad_bodies_are_400_naming_the_field(smollm2_dir, tokenizer, route, body, field):
    handler, _ = make_handler(smollm2_dir, tokenizer)
    answer = call(handler, body, route)
    assert answer.status == 400 and answer.json["error"]["param"] == field


def test_a_model_py_handler_refuses_the_tokenizer_routes(smollm2_dir, tokenizer):
    _, engine = make_handler(smollm2_dir, tokenizer)
    config = load_config(None, {}).config
    handler = ForwardingHandler(Runtime(config, "m", "/m", "test", "/ipc", "model.py"), engine)
    answer = call(handler, {"prompt": "x"}, Route.TOKENIZE)
    assert answer.status == 404 and not engine.messages
