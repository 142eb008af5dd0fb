"""The engine side of the socket: both engines read their ROUTER socket the same way."""

from __future__ import annotations

import logging
from collections.abc import Callable

import zmq

from . import protocol

log = logging.getLogger(__name__)


def drain_router(socket: zmq.Socket, handle: Callable[[bytes, dict], None]) -> None:
    """Hands every message waiting on `socket` to `handle(identity, message)` without blocking.
    The front end validates, so a malformed message means version skew or a bug: it is logged
    and dropped, never allowed to stop the engine."""
    while True:
        try:
            identity, frame = socket.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            return
        try:
            handle(identity, protocol.unpack(frame))
        except (ValueError, KeyError, TypeError) as error:
            log.error("dropping malformed IPC message: %s", error)
