"""Streaming response bodies: one event per token, the last one carrying the whole generated
text (and details), an error after the first byte as a final `{"code", "error"}` event.

- `jsonlines` (DJL): `application/jsonlines`, one JSON object per line.
- `sse`: `text/event-stream`, the same objects as `data: {...}` events.
- `tgi_compat`: SSE with TGI's token keys (`logprob`, `special`).
"""

from __future__ import annotations

import json


class StreamFormat:
    def __init__(self, kind: str, tgi_compat: bool):
        self.sse = kind == "sse" or tgi_compat
        self.tgi_compat = tgi_compat
        self.content_type = "text/event-stream" if self.sse else "application/jsonlines"

    def token(self, token_id: int, text: str, log_prob: float, special: bool, final: dict | None):
        """One token's event; `final` (generated_text, details) on the last one."""
        if self.tgi_compat:
            token = {"id": token_id, "text": text, "logprob": log_prob, "special": special}
            event = {"token": token, "generated_text": None, "details": None}
        else:
            event = {"token": {"id": token_id, "text": text, "log_prob": log_prob}}
        if final is not None:
            event.update(final)
        return self.line(event)

    def error(self, status: int, message: str) -> str:
        return self.line({"code": status, "error": message})

    def line(self, event: dict) -> str:
        body = json.dumps(event, ensure_ascii=False)
        return f"data: {body}\n\n" if self.sse else body + "\n"
