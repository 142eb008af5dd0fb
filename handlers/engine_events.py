"""Waiting for an engine's events on the front end: an error event, an engine silent for
longer than option.predict_timeout, and a client that hung up meanwhile each end the wait
with an exception the handler answers."""

from __future__ import annotations

import queue
import time
from collections.abc import Callable
from dataclasses import dataclass

from lmserve.rolling_batch import protocol

from .interface import EngineConnection, HandlerResponse

# How often a waiting request looks at the engine's liveness.
_POLL_S = 0.25


class ClientGone(Exception):
    """The HTTP client hung up before its answer was ready."""


@dataclass
class PredictionError(Exception):
    status: int
    message: str
    request_id: str | None = None  # the engine request it failed, when one did

    def response(self) -> HandlerResponse:
        if self.status == 424:  # DJL's status and body for a failed prediction
            return HandlerResponse.error(424, "prediction failure", error=self.message)
        return HandlerResponse.error(self.status, self.message)


def next_event(
    events: queue.SimpleQueue,
    engine: EngineConnection,
    since: float,
    timeout_s: float,
    client_gone: Callable[[], bool] | None = None,
) -> protocol.Event:
    """The engine's next event for a request submitted at `since`. option.predict_timeout
    (`timeout_s`), as in DJL, bounds a wait for the engine, never a generation's length: only
    an engine silent that long (no answer to this worker since `since`: a step or batch that
    does not end) fails the request. PredictionError for that and for an error event;
    ClientGone when `client_gone()` says the HTTP client hung up."""
    while True:
        try:
            event = events.get(timeout=_POLL_S)
        except queue.Empty:
            if client_gone is not None and client_gone():
                raise ClientGone() from None
            silent = time.monotonic() - max(engine.last_heard(), since)
            if silent > timeout_s:
                raise PredictionError(
                    424,
                    f"the engine was silent for {silent:.0f} s, over option.predict_timeout"
                    f" ({timeout_s} s): a step or batch did not finish",
                ) from None
            continue
        if isinstance(event, protocol.ErrorEvent):
            raise PredictionError(event.status, event.message, event.id)
        return event
