"""The front end's side of a user's handler: the handler's `handle(inputs)` runs in the engine
process (engine=Python with a model.py), so each request goes there as it came (body and
headers) and its answer comes back as it is: status, headers, and the body whole or in pieces.

option.predict_timeout bounds how long the engine may stay silent (a batch that does not end);
a streamed answer has no deadline while pieces flow."""

from __future__ import annotations

import json
import queue
import time
from collections.abc import Iterator

from lmserve.rolling_batch.ipc import protocol
from lmserve.rolling_batch.ipc.runtime import Runtime

from ..interface import (
    TOKENIZER_ROUTES,
    EngineConnection,
    HandlerRequest,
    HandlerResponse,
    PredictionError,
    next_event,
)

_DEFAULT_CONTENT_TYPE = "application/octet-stream"


class ForwardingHandler:
    def __init__(self, runtime: Runtime, engine: EngineConnection):
        self.engine = engine
        self.timeout_s = runtime.config.predict_timeout

    def handle(self, request: HandlerRequest) -> HandlerResponse:
        if request.route in TOKENIZER_ROUTES:
            return HandlerResponse.error(
                404, f"/{request.route} is served by lmserve's LLM handler, not a model.py"
            )
        headers = {key.lower(): value for key, value in request.headers.items()}
        if request.content_type:
            headers["content-type"] = request.content_type
        request_id = request.request_id
        events = self.engine.submit(protocol.HandleRequest(request_id, request.body, headers))
        submitted = time.monotonic()
        try:
            reply = self._next(events, submitted)
        except PredictionError as error:
            self.engine.finish(request_id, abort=True)
            return error.response()
        if not isinstance(reply, protocol.ReplyEvent):
            self.engine.finish(request_id, abort=True)
            return HandlerResponse.error(500, f"the engine answered with a {type(reply).__name__}")
        answer_headers = dict(reply.headers)
        content_type = answer_headers.pop("content-type", _DEFAULT_CONTENT_TYPE)
        if not reply.streaming:
            self.engine.finish(request_id, abort=False)
            return HandlerResponse(
                reply.status, body=reply.body, content_type=content_type, headers=answer_headers
            )
        return HandlerResponse(
            reply.status,
            stream=self._pieces(request_id, events, submitted),
            content_type=content_type,
            headers=answer_headers,
        )

    def _pieces(self, request_id: str, events: queue.SimpleQueue, since: float) -> Iterator[bytes]:
        done = False
        try:
            while not done:
                chunk = self._next(events, since)
                if not isinstance(chunk, protocol.ChunkEvent):
                    raise PredictionError(500, f"a {type(chunk).__name__} inside a stream")
                done = chunk.last
                if chunk.data:
                    yield chunk.data
        except PredictionError as error:
            done = True  # the engine is done with it
            yield (json.dumps({"code": error.status, "error": error.message}) + "\n").encode()
        finally:
            # A client that went away ends the request in the engine too.
            self.engine.finish(request_id, abort=not done)

    def _next(self, events: queue.SimpleQueue, since: float) -> protocol.Event:
        return next_event(events, self.engine, since, self.timeout_s)
