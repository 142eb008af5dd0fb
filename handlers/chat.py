"""OpenAI-style chat: `messages` bodies (on /v1/chat/completions, or any body with `messages` on
/invocations, as DJL does), the model's chat template, and the `chat.completion` /
`chat.completion.chunk` shapes with `usage`.

Parameters follow OpenAI: `max_tokens` (or `max_completion_tokens`; default 30 as for text
requests), `temperature` (default 1.0, which samples; 0 is greedy), `top_p`, `seed`, `stop`,
`stream`. `n` other than 1 and non-zero penalties are refused rather than ignored.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from typing import Any

from lmserve.rolling_batch.protocol import GenerationParams

from .outputs import Completion
from .request_parsing import BadRequest, _ParameterReader

_ROLES = ("system", "user", "assistant", "tool", "developer")
_MAX_N = 16  # choices per request: each is a sequence in the batch
FINISH_REASONS = {"length": "length", "eos_token": "stop", "stop_sequence": "stop"}


@dataclass(frozen=True)
class ChatRequest:
    messages: list[dict[str, str]]
    params: GenerationParams
    stop_sequences: tuple[str, ...]
    stream: bool
    model: str | None
    # OpenAI's function tools, passed through to the chat template as apply_chat_template does.
    tools: list[dict[str, Any]] | None = None
    include_usage: bool = False  # stream_options.include_usage: a last chunk with usage
    n: int = 1  # choices to generate


def is_chat(payload: Any) -> bool:
    return isinstance(payload, dict) and "messages" in payload


def parse_chat(payload: dict[str, Any]) -> ChatRequest:
    messages = payload.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages", "expected a non-empty list of {role, content} objects")
    parsed = [_parse_message(index, message) for index, message in enumerate(messages)]
    reader = _ParameterReader(payload, prefix="")
    max_tokens = reader.integer("max_completion_tokens", None, minimum=1)
    sampling = read_openai_sampling(reader, default_max_tokens=max_tokens or 30)
    return ChatRequest(
        parsed,
        sampling.params,
        sampling.stop,
        sampling.stream,
        sampling.model,
        _parse_tools(payload.get("tools")),
        sampling.include_usage,
        sampling.n,
    )


def _parse_tools(tools: Any) -> list[dict[str, Any]] | None:
    # Passed through as given: each template has its own idea of a tool's shape.
    if tools is None:
        return None
    if not isinstance(tools, list) or not all(isinstance(tool, dict) for tool in tools):
        raise BadRequest("tools", "expected a list of tool objects")
    return tools


@dataclass(frozen=True)
class OpenAISampling:
    params: GenerationParams
    stop: tuple[str, ...]
    stream: bool
    model: str | None
    include_usage: bool = False
    n: int = 1


def read_openai_sampling(reader: _ParameterReader, default_max_tokens: int) -> OpenAISampling:
    """The parameters chat and completions share, with OpenAI's names and defaults
    (`temperature` 1.0 samples, 0 is greedy; `n` choices, not streamed yet). What lmserve
    cannot do is refused, not ignored."""
    temperature = reader.number("temperature", 1.0, minimum=0.0, maximum=2.0)
    params = GenerationParams(
        max_new_tokens=reader.integer("max_tokens", default_max_tokens, minimum=1),
        do_sample=temperature > 0,
        temperature=temperature if temperature > 0 else 1.0,
        top_p=reader.number("top_p", 1.0, minimum=0.0, exclusive_minimum=True, maximum=1.0),
        seed=reader.integer("seed", None, minimum=0),
    )
    n = reader.integer("n", 1, minimum=1)
    if n > _MAX_N:
        raise BadRequest("n", f"at most {_MAX_N}")
    for penalty in ("frequency_penalty", "presence_penalty"):
        if reader.number(penalty, 0.0, minimum=-2.0, maximum=2.0) != 0.0:
            raise BadRequest(penalty, "not supported (use 0)")
    model = reader.raw.get("model")
    if model is not None and not isinstance(model, str):
        raise BadRequest("model", f"expected a string, got {model!r}")
    stream = reader.boolean("stream", False)
    if stream and n > 1:
        raise BadRequest("n", "n > 1 is not streamed yet: use stream=false")
    stop = reader.stop_sequences("stop")
    return OpenAISampling(params, stop, stream, model, _include_usage(reader.raw, stream), n)


def _include_usage(payload: dict[str, Any], stream: bool) -> bool:
    """OpenAI's `stream_options.include_usage`: only with `stream: true`."""
    options = payload.get("stream_options")
    if options is None:
        return False
    if not stream:
        raise BadRequest("stream_options", "only with stream: true")
    if not isinstance(options, dict):
        raise BadRequest("stream_options", f"expected an object, got {options!r}")
    include = options.get("include_usage", False)
    if not isinstance(include, bool):
        raise BadRequest("stream_options.include_usage", f"expected true or false, got {include!r}")
    return include


def _parse_message(index: int, message: Any) -> dict[str, str]:
    field = f"messages[{index}]"
    if not isinstance(message, dict) or message.get("role") not in _ROLES:
        raise BadRequest(f"{field}.role", f"expected one of {', '.join(_ROLES)}")
    content = message.get("content")
    if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
        if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
            raise BadRequest(f"{field}.content", "only text content parts are supported")
        content = "".join(str(p.get("text", "")) for p in content)
    if not isinstance(content, str):
        raise BadRequest(f"{field}.content", "expected a string or a list of text parts")
    return {"role": message["role"], "content": content}


class ChatResponder:
    """Shapes one chat request's answer: a `chat.completion`, or `chat.completion.chunk` SSE
    events ending in `data: [DONE]`."""

    content_type = "text/event-stream"

    def __init__(self, model_name: str, num_prompt_tokens: int, include_usage: bool = False):
        self.id = f"chatcmpl-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = model_name
        self.num_prompt_tokens = num_prompt_tokens
        self.include_usage = include_usage
        self._sent_role = False

    def completion(self, completions: list[Completion]) -> dict:
        """A `chat.completion` with one choice per completion (OpenAI's `n`)."""
        choices = [
            {
                "index": index,
                "message": {"role": "assistant", "content": completion.text},
                "finish_reason": FINISH_REASONS.get(completion.finish_reason, "stop"),
            }
            for index, completion in enumerate(completions)
        ]
        return {
            **self._envelope("chat.completion"),
            "choices": choices,
            "usage": self._usage(*completions),
        }

    def token(self, token_id, text, log_prob, special, completion: Completion | None) -> str:
        delta: dict[str, str] = {"content": text}
        if not self._sent_role:
            delta["role"] = "assistant"
            self._sent_role = True
        lines = [self._chunk(delta, None)]
        if completion is not None:
            finish = FINISH_REASONS.get(completion.finish_reason, "stop")
            lines.append(self._chunk({}, finish))
            if self.include_usage:  # OpenAI's usage chunk: no choices
                lines.append({**self._envelope("chat.completion.chunk"), "choices": [],
                              "usage": self._usage(completion)})  # fmt: skip
        body = "".join(f"data: {json.dumps(line, ensure_ascii=False)}\n\n" for line in lines)
        return body + ("data: [DONE]\n\n" if completion is not None else "")

    def error(self, status: int, message: str) -> str:
        return f"data: {json.dumps({'code': status, 'error': message})}\n\n"

    def _chunk(self, delta: dict, finish_reason: str | None) -> dict:
        return {
            **self._envelope("chat.completion.chunk"),
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason}],
        }

    def _envelope(self, kind: str) -> dict:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def _usage(self, *completions: Completion) -> dict:
        generated = sum(len(completion.token_ids) for completion in completions)
        return {
            "prompt_tokens": self.num_prompt_tokens,
            "completion_tokens": generated,
            "total_tokens": self.num_prompt_tokens + generated,
        }
