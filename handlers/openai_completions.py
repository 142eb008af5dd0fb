"""OpenAI's legacy completions (`POST /v1/completions`): a `prompt` (string or list of strings)
in, `text_completion` objects out, whole or as SSE chunks ending in `data: [DONE]`, with
`usage`.

Parameters: `max_tokens` (OpenAI's default 16), `temperature`, `top_p`, `seed`, `stop`,
`stream`, `echo` (the prompt before the text), `logprobs` (0: each token's log-prob; 1 with
greedy decoding, where the most likely token is the chosen one; alternatives beyond the chosen
token are not computed, so anything else is refused), `n` (choices per prompt, not streamed).
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from typing import Any

from .chat import FINISH_REASONS, OpenAISampling, read_openai_sampling
from .outputs import Completion
from .request_parsing import BadRequest, _ParameterReader
from .tokenizer import Tokenizer

_DEFAULT_MAX_TOKENS = 16  # OpenAI's


@dataclass(frozen=True)
class CompletionRequest:
    prompts: list[str]
    batched: bool
    sampling: OpenAISampling
    echo: bool
    logprobs: int | None


def parse_completion(payload: dict[str, Any]) -> CompletionRequest:
    prompt = payload.get("prompt")
    batched = isinstance(prompt, list)
    prompts = prompt if batched else [prompt]
    if not prompts or not all(isinstance(p, str) and p for p in prompts):
        raise BadRequest("prompt", "expected a non-empty string or list of non-empty strings")
    reader = _ParameterReader(payload, prefix="")
    sampling = read_openai_sampling(reader, _DEFAULT_MAX_TOKENS)
    logprobs = reader.integer("logprobs", None, minimum=0)
    if logprobs is not None and (logprobs > 1 or (logprobs == 1 and sampling.params.do_sample)):
        raise BadRequest(
            "logprobs",
            "0, or 1 with temperature 0: the chosen token's log-prob is what is computed",
        )
    if sampling.stream and batched:
        raise BadRequest("prompt", "streaming takes one prompt, not a list")
    return CompletionRequest(prompts, batched, sampling, reader.boolean("echo", False), logprobs)


class CompletionResponder:
    """Shapes one completions request's answer: a `text_completion`, or its stream chunks."""

    content_type = "text/event-stream"

    def __init__(self, tokenizer: Tokenizer, model: str, request: CompletionRequest):
        self.tokenizer = tokenizer
        self.id = f"cmpl-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = model
        self.request = request
        self._offset = 0  # characters of text sent so far (a stream's text_offset)

    def completion(self, answers: list[tuple[Completion, int]]) -> dict:
        """`answers`: the `n` Completions of each prompt, prompt by prompt, each with its
        prompt's number of tokens (counted once per prompt, as OpenAI does)."""
        choices = [self._choice(index, c) for index, (c, _) in enumerate(answers)]
        prompt_tokens = sum(tokens for _, tokens in answers[:: self.request.sampling.n])
        generated = sum(len(c.token_ids) for c, _ in answers)
        return {**self._envelope(), "choices": choices, "usage": _usage(prompt_tokens, generated)}

    def token(self, token_id, text, log_prob, special, completion: Completion | None) -> str:
        """One streamed token's chunk; the last one adds finish_reason, then (with
        stream_options.include_usage) a usage chunk, then [DONE]."""
        if not self._offset and self.request.echo:
            text = self.request.prompts[0] + text
        choice: dict[str, Any] = {"text": text, "index": 0, "logprobs": None}
        if self.request.logprobs is not None:
            choice["logprobs"] = self._logprobs([token_id], [log_prob], self._offset)
        self._offset += len(text)
        choice["finish_reason"] = _finish(completion) if completion else None
        chunk = {**self._envelope(), "choices": [choice]}
        if completion is None:
            return _event(chunk)
        events = _event(chunk)
        if self.request.sampling.include_usage:  # OpenAI's usage chunk: no choices
            prompt_tokens = len(self.tokenizer.encode(completion.prompt))
            usage = _usage(prompt_tokens, len(completion.token_ids))
            events += _event({**self._envelope(), "choices": [], "usage": usage})
        return events + "data: [DONE]\n\n"

    def error(self, status: int, message: str) -> str:
        return _event({"error": {"message": message, "type": "server_error", "code": status}})

    def _choice(self, index: int, completion: Completion) -> dict:
        prefix = completion.prompt if self.request.echo else ""
        logprobs = None
        if self.request.logprobs is not None:
            logprobs = self._logprobs(completion.token_ids, completion.log_probs, len(prefix))
        return {
            "text": prefix + completion.text,
            "index": index,
            "logprobs": logprobs,
            "finish_reason": _finish(completion),
        }

    def _logprobs(self, token_ids: list[int], log_probs: list[float], offset: int) -> dict:
        tokens = [self.tokenizer.token_text(t) for t in token_ids]
        offsets = []
        for token in tokens:
            offsets.append(offset)
            offset += len(token)
        return {
            "tokens": tokens,
            "token_logprobs": log_probs,
            # Greedy: the chosen token is the most likely one (logprobs=1 is refused otherwise).
            "top_logprobs": [{t: lp} for t, lp in zip(tokens, log_probs)]
            if self.request.logprobs
            else None,
            "text_offset": offsets,
        }

    def _envelope(self) -> dict:
        return {
            "id": self.id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
        }


def _finish(completion: Completion) -> str:
    return FINISH_REASONS.get(completion.finish_reason, "stop")


def _usage(prompt_tokens: int, generated: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": generated,
        "total_tokens": prompt_tokens + generated,
    }


def _event(body: dict) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"
