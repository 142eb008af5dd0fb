"""Streaming response bodies: one event per token, the last one carrying the whole generated
text (and details), an error after the first byte as a final `{"code", "error"}` event.

- `jsonlines` (DJL): `application/jsonlines`, one JSON object per line.
- `sse`: `text/event-stream`, the same objects as `data: {...}` events.
- `tgi_compat`: SSE with TGI's token keys (`logprob`, `special`).
"""

from __future__ import annotations

import json

from .outputs import Completion, to_json
from .tokenizer import Tokenizer


class StreamFormat:
    def __init__(
        self,
        kind: str,
        tgi_compat: bool,
        tokenizer: Tokenizer,
        details: bool,
        return_full_text: bool,
    ):
        self.sse = kind == "sse" or tgi_compat
        self.tgi_compat = tgi_compat
        self.content_type = "text/event-stream" if self.sse else "application/jsonlines"
        self._tokenizer = tokenizer
        self._details = details
        self._return_full_text = return_full_text

    def token(self, token_id, text, log_prob, special, completion: Completion | None) -> str:
        """One token's event; the last one (with `completion`) adds generated_text/details."""
        if self.tgi_compat:
            token = {"id": token_id, "text": text, "logprob": log_prob, "special": special}
            event = {"token": token, "generated_text": None, "details": None}
        else:
            event = {"token": {"id": token_id, "text": text, "log_prob": log_prob}}
        if completion is not None:
            event.update(
                to_json(
                    completion,
                    self._tokenizer,
                    self._details,
                    self._return_full_text,
                    self.tgi_compat,
                )
            )
        return self.line(event)

    def error(self, status: int, message: str) -> str:
        return self.line({"code": status, "error": message})

    def line(self, event: dict) -> str:
        body = json.dumps(event, ensure_ascii=False)
        return f"data: {body}\n\n" if self.sse else body + "\n"
