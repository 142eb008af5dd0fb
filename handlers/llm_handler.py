"""The built-in LLM handler: a request body in, the DJL/TGI/OpenAI-shaped answer out.

Text payloads (`{"inputs": ..., "parameters": ...}` or text/plain) get DJL's shape, TGI's with
option.tgi_compat; bodies with `messages` (and everything on /v1/chat/completions) are OpenAI
chat. Generation itself, and the promise that every accepted request ends in exactly one
answer, is the Predictor's (handlers/predictor.py).
"""

from __future__ import annotations

from lmserve.rolling_batch.runtime import Runtime

from .chat import is_chat, parse_chat
from .interface import EngineConnection, HandlerRequest, HandlerResponse, Route
from .predictor import PredictionError, Predictor
from .request_parsing import BadRequest, load_payload, parse_payload
from .stream_format import StreamFormat

_SSE = "text/event-stream"


class LLMHandler:
    def __init__(self, runtime: Runtime, engine: EngineConnection):
        self.config = runtime.config
        self.predictor = Predictor(runtime, engine)

    def handle(self, request: HandlerRequest) -> HandlerResponse:
        try:
            return self._answer(request)
        except BadRequest as error:
            return HandlerResponse.error(error.status, str(error), field=error.field)
        except PredictionError as error:
            return error.response()

    def _answer(self, request: HandlerRequest) -> HandlerResponse:
        payload = load_payload(request.body, request.content_type)
        if request.route is Route.CHAT_COMPLETIONS or is_chat(payload):
            chat = parse_chat(payload)
            answer = self.predictor.chat(chat, request.request_id)
            if chat.stream:
                return HandlerResponse(stream=answer, content_type=_SSE)
            return HandlerResponse(json=answer)
        parsed = parse_payload(payload)
        stream_kind = self._stream_kind(parsed.stream, request.accept)
        if stream_kind is None:
            return HandlerResponse(json=self.predictor.predict(parsed, request.request_id))
        fmt = StreamFormat(
            stream_kind,
            self.config.tgi_compat,
            self.predictor.tokenizer,
            parsed.details,
            parsed.return_full_text,
        )
        stream = self.predictor.stream(parsed, request.request_id, fmt)
        return HandlerResponse(stream=stream, content_type=fmt.content_type)

    def _stream_kind(self, asked: bool, accept: str) -> str | None:
        """jsonlines or sse when option.output_formatter or the request asks to stream; a
        streaming request that accepts text/event-stream gets SSE."""
        formatter = self.config.output_formatter
        if formatter in ("jsonlines", "sse"):
            return formatter
        if not asked:
            return None
        return "sse" if _SSE in accept else "jsonlines"
