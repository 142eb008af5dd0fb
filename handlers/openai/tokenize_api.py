"""vLLM's /tokenize and /detokenize, which clients probe to count a prompt's tokens before they
send it: `{"prompt"}` (with `add_special_tokens`, default true) or `{"messages"}` (rendered by
the chat template, `add_special_tokens` default false) -> `{"count", "max_model_len", "tokens",
"token_strs"}` (`token_strs` with `return_token_strs: true`); `{"tokens"}` -> `{"prompt"}`.
Torch-free."""

from __future__ import annotations

from typing import Any

from ..job import BadRequest, FieldReader
from ..tokenizer import ChatTemplate, Tokenizer
from .chat import parse_chat


def tokenize(
    payload: dict[str, Any], tokenizer: Tokenizer, template: ChatTemplate, max_model_len: int
) -> dict:
    _check_model(payload)
    reader = FieldReader(payload, prefix="")
    if "messages" in payload:
        if not reader.boolean("add_generation_prompt", True):
            raise BadRequest("add_generation_prompt", "only true: the template's own prompt")
        job = parse_chat({"messages": payload["messages"], "tools": payload.get("tools")})
        text = template.render(job.messages, job.tools)
        special = reader.boolean("add_special_tokens", False)
    else:
        text = payload.get("prompt")
        if not isinstance(text, str):
            raise BadRequest("prompt", "expected a string (or send `messages`)")
        special = reader.boolean("add_special_tokens", True)
    tokens = tokenizer.encode(text, special)
    strings = None
    if reader.boolean("return_token_strs", False):
        strings = [tokenizer.token_text(token) for token in tokens]
    return {
        "count": len(tokens),
        "max_model_len": max_model_len,
        "tokens": tokens,
        "token_strs": strings,
    }


def detokenize(payload: dict[str, Any], tokenizer: Tokenizer) -> dict:
    _check_model(payload)
    tokens = payload.get("tokens")
    if not isinstance(tokens, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in tokens
    ):
        raise BadRequest("tokens", "expected a list of token ids")
    try:
        return {"prompt": tokenizer.decode(tokens)}
    except (OverflowError, ValueError, IndexError, TypeError) as error:
        raise BadRequest("tokens", f"not this model's token ids: {error}") from None


def _check_model(payload: dict[str, Any]) -> None:
    """`model` may name the model (any name: the server serves one tokenizer)."""
    model = payload.get("model")
    if model is not None and not isinstance(model, str):
        raise BadRequest("model", f"expected a string, got {model!r}")
