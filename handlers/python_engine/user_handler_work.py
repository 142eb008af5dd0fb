"""engine=Python's work with a user's handler: batches of raw HTTP requests through the
model.py's `handle(inputs)`.

Any requests batch together (the handler sees `get_batches()`). A handler that raises fails
its batch's requests with 424, DJL's "prediction failure", and the engine goes on. A streamed
answer is relayed piece by piece as the handler produces it; a stream that raises midway ends
with an error event."""

from __future__ import annotations

import logging

from lmserve.rolling_batch.engine.shell import Outbox
from lmserve.rolling_batch.ipc import protocol

from .custom_service import Answer, HandlerError, RawRequest, UserHandlerService
from .dynamic_batcher import PendingRequest

log = logging.getLogger("lmserve.engine")


class UserHandlerWork:
    request_type = protocol.HandleRequest

    def __init__(self, service: UserHandlerService):
        self.service = service
        self.num_failed = 0

    def batch_key(self, message: protocol.HandleRequest) -> tuple:
        return ()

    def refusal(self, message: protocol.HandleRequest) -> None:
        return None  # the handler itself answers whatever it cannot serve

    def run(self, batch: list[PendingRequest], outbox: Outbox) -> int:
        raw = [RawRequest(r.message.body, r.message.headers) for r in batch]
        try:
            answers = self.service.answer(raw)
        except HandlerError as error:
            self.num_failed += len(batch)
            for request in batch:
                refused = protocol.ErrorEvent(request.request_id, 424, str(error))
                outbox.send(request.reply_to, refused)
            return 0
        for request, answer in zip(batch, answers):
            self._relay(request, answer, outbox)
        return len(batch)

    def _relay(self, request: PendingRequest, answer: Answer, outbox: Outbox) -> None:
        request_id = request.request_id
        if answer.stream is None:
            reply = protocol.ReplyEvent(request_id, answer.status, answer.headers, answer.body)
            outbox.send(request.reply_to, reply)
            return
        outbox.send(
            request.reply_to,
            protocol.ReplyEvent(request_id, answer.status, answer.headers, b"", True),
        )
        outbox.flush()  # each piece goes out as the handler produces it
        try:
            for piece in answer.stream:
                outbox.send(request.reply_to, protocol.ChunkEvent(request_id, piece))
                outbox.flush()
        except Exception as error:  # noqa: BLE001 - the handler's bug ends its stream only
            log.exception("%s: the stream of request %s raised", self.service.name, request_id)
            self.num_failed += 1
            message = f"{type(error).__name__}: {error}"
            outbox.send(request.reply_to, protocol.ErrorEvent(request_id, 424, message))
            return
        outbox.send(request.reply_to, protocol.ChunkEvent(request_id, b"", last=True))
