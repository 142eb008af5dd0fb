"""OpenAI's legacy completions (`POST /v1/completions`): a `prompt` (string or list of strings)
in, `text_completion` objects out, whole or as SSE chunks ending in `data: [DONE]`, with
`usage`.

Parameters: `max_tokens` (OpenAI's default 16), `temperature`, `top_p`, `seed`, `stop`,
`stream`, `n` (choices per prompt), `echo` (the prompt before the text), `logprobs` (each
token's log-prob, and that many most likely alternatives, up to 20 as vLLM allows; with `echo`,
the prompt's tokens too, not streamed), vLLM's `top_k`, `repetition_penalty` and `ignore_eos`;
what chat refuses (chat.py) is refused here too."""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

import msgspec

from lmserve.rolling_batch.ipc.protocol import MAX_TOP_LOGPROBS

from ..job import BadRequest, Dialect, FieldReader, GenerationJob
from ..outputs import Completion, TokenOutput
from ..tokenizer import Tokenizer
from .chat import FINISH_REASONS, read_openai_sampling

_DEFAULT_MAX_TOKENS = 16  # OpenAI's


def parse_completion(payload: dict[str, Any], served_model: str | None = None) -> GenerationJob:
    """A completions body's job; `served_model`: read_openai_sampling's."""
    prompt = payload.get("prompt")
    batched = isinstance(prompt, list)
    prompts = prompt if batched else [prompt]
    if not prompts or not all(isinstance(p, str) and p for p in prompts):
        raise BadRequest("prompt", "expected a non-empty string or list of non-empty strings")
    reader = FieldReader(payload, prefix="")
    sampling = read_openai_sampling(reader, _DEFAULT_MAX_TOKENS, served_model)
    logprobs = reader.integer("logprobs", None, minimum=0, maximum=MAX_TOP_LOGPROBS)
    echo = reader.boolean("echo", False)
    if sampling.stream and batched:
        raise BadRequest("prompt", "streaming takes one prompt, not a list")
    if sampling.stream and echo and logprobs is not None:
        raise BadRequest("logprobs", "the prompt's log-probs (echo) are not streamed")
    params = msgspec.structs.replace(
        sampling.params,
        top_logprobs=logprobs or 0,
        prompt_logprobs=echo and logprobs is not None,
        log_probs=logprobs is not None,
    )
    return GenerationJob(
        Dialect.COMPLETION,
        prompts,
        batched,
        params,
        stop_sequences=sampling.stop,
        stream=sampling.stream,
        n=sampling.n,
        best_of=sampling.n,
        model=sampling.model,
        logprobs=logprobs is not None,
        echo=echo,
        include_usage=sampling.include_usage,
    )


class CompletionResponder:
    """Shapes one completions request's answer: a `text_completion`, or its stream chunks."""

    content_type = "text/event-stream"

    def __init__(self, tokenizer: Tokenizer, model: str, job: GenerationJob):
        self.tokenizer = tokenizer
        self.id = f"cmpl-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = model
        self.request = job
        self._offsets: dict[int, int] = {}  # characters sent so far, by choice (text_offset)

    def answer(self, prompts: list[list[Completion]]) -> dict:
        """`prompts`: the `n` completions of each prompt, one choice each (prompt tokens counted
        once per prompt, as OpenAI does)."""
        completions = [completion for each in prompts for completion in each]
        choices = [self._choice(index, c) for index, c in enumerate(completions)]
        prompt_tokens = sum(len(each[0].prompt_ids) for each in prompts)
        generated = sum(len(c.token_ids) for c in completions)
        return {**self._envelope(), "choices": choices, "usage": _usage(prompt_tokens, generated)}

    def token(self, token: TokenOutput, completion: Completion | None) -> str:
        """One streamed token's chunk, with finish_reason on its choice's last token."""
        text = token.text
        if token.index not in self._offsets and self.request.echo:
            text = self.request.prompts[0] + text
        offset = self._offsets.get(token.index, 0)
        choice: dict[str, Any] = {"text": text, "index": token.index, "logprobs": None}
        if self.request.logprobs:
            top = None if token.top_logprobs is None else [token.top_logprobs]
            choice["logprobs"] = self._logprobs([token.id], [token.log_prob], top, offset)
        self._offsets[token.index] = offset + len(text)
        choice["finish_reason"] = _finish(completion) if completion else None
        return _event({**self._envelope(), "choices": [choice]})

    def done(self, completions: list[Completion]) -> str:
        """After every choice's last token: the usage chunk (stream_options.include_usage; no
        choices, as OpenAI's), then [DONE]."""
        events = ""
        if self.request.include_usage:
            generated = sum(len(c.token_ids) for c in completions)
            usage = _usage(len(completions[0].prompt_ids), generated)
            events = _event({**self._envelope(), "choices": [], "usage": usage})
        return events + "data: [DONE]\n\n"

    def error(self, status: int, message: str) -> str:
        return _event({"error": {"message": message, "type": "server_error", "code": status}})

    def _choice(self, index: int, completion: Completion) -> dict:
        prefix = completion.prompt if self.request.echo else ""
        logprobs = None
        if self.request.logprobs:
            token_ids, log_probs = completion.token_ids, completion.log_probs
            tops = completion.top_logprobs
            offset = len(prefix)
            if completion.prompt_log_probs is not None:  # echo: the prompt's tokens first
                token_ids = completion.prompt_ids + token_ids
                log_probs = [None, *completion.prompt_log_probs, *log_probs]
                if tops is not None:
                    tops = [None, *(completion.prompt_top_logprobs or []), *tops]
                offset = 0
            logprobs = self._logprobs(token_ids, log_probs, tops, offset)
        return {
            "text": prefix + completion.text,
            "index": index,
            "logprobs": logprobs,
            "finish_reason": _finish(completion),
        }

    def _logprobs(self, token_ids, log_probs, tops, offset: int) -> dict:
        """OpenAI's legacy logprobs: tokens, their log-probs, the most likely alternatives at
        each (with the chosen token, so up to logprobs + 1 of them, as OpenAI says), and the
        character offset of each token in the choice's text."""
        tokens = [self.tokenizer.token_text(t) for t in token_ids]
        offsets = []
        for token in tokens:
            offsets.append(offset)
            offset += len(token)
        top_logprobs = None
        if self.request.params.top_logprobs:
            top_logprobs = [
                None if top is None else self._alternatives(top, token, log_prob)
                for token, log_prob, top in zip(token_ids, log_probs, tops or [])
            ]
        return {
            "tokens": tokens,
            "token_logprobs": log_probs,
            "top_logprobs": top_logprobs,
            "text_offset": offsets,
        }

    def _alternatives(self, top, chosen: int, chosen_log_prob: float | None) -> dict:
        alternatives = {self.tokenizer.token_text(t): lp for t, lp in top}
        if chosen_log_prob is not None:
            alternatives.setdefault(self.tokenizer.token_text(chosen), chosen_log_prob)
        return alternatives

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
