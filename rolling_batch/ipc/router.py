"""The engine side of the socket: both engines read their ROUTER socket the same way."""

from __future__ import annotations

import logging
from collections.abc import Callable

import zmq

from . import protocol

log = logging.getLogger(__name__)


def drain_router(socket: zmq.Socket, handle: Callable[[bytes, protocol.ToEngine], None]) -> None:
    """Hands every message waiting on `socket` to `handle(identity, message)` without blocking.
    The front end validates, so a malformed message means version skew or a bug: it is logged
    and dropped, never allowed to stop the engine; if its request id is readable, the sender
    gets an error event for it, so the client hears why instead of waiting out its timeout."""
    while True:
        try:
            identity, frame = socket.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            return
        except ValueError as error:  # not [identity, frame]: a peer that is not a DEALER
            log.error("dropping malformed IPC message: %s", error)
            continue
        try:
            message = protocol.decode_request(frame)
        except protocol.MalformedFrame as error:
            log.error("dropping malformed IPC message: %s", error)
            _answer_malformed(socket, identity, frame, error)
            continue
        try:
            handle(identity, message)
        except (ValueError, KeyError, TypeError) as error:
            # Well-typed but unusable values; the handlers admit a request last, so a request
            # that raised here was not admitted and its error event is its only answer.
            log.error("dropping IPC message the engine could not act on: %r", error)
            if isinstance(message, protocol.GenerateRequest):
                reply = protocol.ErrorEvent(message.id, 400, f"engine refused the request: {error}")
                socket.send_multipart([identity, protocol.encode(reply)])


def _answer_malformed(socket: zmq.Socket, identity: bytes, frame: bytes, error: Exception) -> None:
    request_id = protocol.request_id_of(frame)
    if request_id is not None:
        reply = protocol.ErrorEvent(request_id, 500, f"engine could not read the request: {error}")
        socket.send_multipart([identity, protocol.encode(reply)])
