"""DJL's and TGI's answers to `{"inputs", "parameters"}` requests.

One JSON answer (`json`): an object per input (a list for a list of inputs, and always under
tgi_compat, TGI's shape) with `generated_text` and, on request, `details`; of several
sequences per input (`n`, `best_of`) the most likely by cumulative log-prob answers, the next
`n - 1` are its `details.best_of_sequences`.

Streams: one event per token, the last one carrying the whole generated text (and details),
an error after the first byte as a final `{"code", "error"}` event.

- `jsonlines` (DJL): `application/jsonlines`, one JSON object per line.
- `sse`: `text/event-stream`, the same objects as `data: {...}` events.
- `tgi_compat`: TGI's token keys (`logprob`, `special`); the handler picks SSE for it unless
  the request or option.output_formatter names jsonlines.

The last event's `details` has `finish_reason`, `generated_tokens` and `inputs` but no
`tokens`, as DJL's jsonlines/sse formatter writes it: every token was already its own event.
With `top_n_tokens` each event carries its token's `top_tokens`, as TGI streams them.
"""

from __future__ import annotations

import json

from ..outputs import Completion, TokenOutput, TokenShape, shape_response, to_json
from ..tokenizer import Tokenizer


class DjlResponder:
    """`kind`: json, jsonlines or sse. `batched`: the inputs came as a list; `n`: the
    sequences answered per input."""

    def __init__(
        self,
        kind: str,
        tgi_compat: bool,
        tokenizer: Tokenizer,
        details: bool,
        return_full_text: bool,
        batched: bool = False,
        n: int = 1,
    ):
        self.sse = kind == "sse"
        self.tgi_compat = tgi_compat
        self.content_type = "text/event-stream" if self.sse else "application/jsonlines"
        self._tokenizer = tokenizer
        self._details = details
        self._return_full_text = return_full_text
        self._batched = batched
        self._n = n

    def answer(self, prompts: list[list[Completion]]) -> dict | list:
        """The JSON answer: each input's most likely sequence, the next n - 1 beside it."""
        outputs = []
        for completions in prompts:
            ranked = sorted(completions, key=lambda c: c.cumulative_log_prob, reverse=True)
            best, others = ranked[0], ranked[1 : self._n]
            outputs.append(
                to_json(
                    best,
                    self._tokenizer,
                    self._details,
                    self._return_full_text,
                    self.tgi_compat,
                    others,
                )
            )
        return shape_response(outputs, self._batched, self.tgi_compat)

    def token(self, token: TokenOutput, completion: Completion | None) -> str:
        """One token's event; the last one (with `completion`) adds generated_text/details."""
        if self.tgi_compat:
            shaped = {"id": token.id, "text": token.text, "logprob": token.log_prob}
            event = {"token": {**shaped, "special": token.special}}
            event.update(generated_text=None, details=None)
        else:
            event = {"token": {"id": token.id, "text": token.text, "log_prob": token.log_prob}}
        if token.top_logprobs is not None:
            shape = TokenShape(self._tokenizer, self.tgi_compat)
            event["top_tokens"] = shape.alternatives(token.top_logprobs)
        if completion is not None:
            event.update(self._last(completion))
        return self.line(event)

    def done(self, completions: list[Completion]) -> str:
        return ""  # the last token's event ended the stream

    def _last(self, completion: Completion) -> dict:
        last = to_json(
            completion, self._tokenizer, self._details, self._return_full_text, self.tgi_compat
        )
        for key in ("tokens", "top_tokens"):  # each was in its token's event
            last.get("details", {}).pop(key, None)
        return last

    def error(self, status: int, message: str) -> str:
        return self.line({"code": status, "error": message})

    def line(self, event: dict) -> str:
        body = json.dumps(event, ensure_ascii=False)
        return f"data: {body}\n\n" if self.sse else body + "\n"
