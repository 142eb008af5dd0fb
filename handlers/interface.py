"""The handler interface: what the HTTP front end hands a handler, and what it gets back.

And the one thing every handler does with the engine: wait for its next event (`next_event`),
ended by an error event, an engine silent past option.predict_timeout, or a client that hung
up.

The front end (container/app.py) owns HTTP: routes, the model name, readiness, request ids,
metrics. Everything between the request body and the response body is a handler's: the
built-in LLM handler (handlers/llm_handler.py) parses, tokenizes, talks to the engine and
shapes DJL/TGI/OpenAI outputs; a user's handler replaces it. A handler never raises for a bad
request: it answers with an error response (status + a message naming the field).
"""

from __future__ import annotations

import queue
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Protocol

from lmserve.rolling_batch.ipc import protocol

from .djl.custom_attributes import custom_attributes_of


class Route(StrEnum):
    """Which inference route a request came in on."""

    INVOCATIONS = "invocations"  # /invocations and /predictions/<model>: any payload
    CHAT_COMPLETIONS = "chat_completions"  # /v1/chat/completions: OpenAI chat only
    COMPLETIONS = "completions"  # /v1/completions: OpenAI's legacy completions
    TOKENIZE = "tokenize"  # vLLM's /tokenize and /detokenize: the tokenizer, no generation
    DETOKENIZE = "detokenize"


TOKENIZER_ROUTES = (Route.TOKENIZE, Route.DETOKENIZE)
# Errors in OpenAI's shape (vLLM's tokenizer routes answer like its OpenAI ones).
OPENAI_ROUTES = (Route.CHAT_COMPLETIONS, Route.COMPLETIONS, *TOKENIZER_ROUTES)


@dataclass(frozen=True)
class HandlerRequest:
    body: bytes
    content_type: str | None
    request_id: str
    route: Route = Route.INVOCATIONS
    # The request's headers (DJL hands them to handlers as the input's properties).
    headers: Mapping[str, str] = field(default_factory=dict)
    # Whether the HTTP client has hung up (checked while a request waits for its answer).
    client_gone: Callable[[], bool] = field(default=lambda: False)

    @property
    def accept(self) -> str:
        return next((v for k, v in self.headers.items() if k.lower() == "accept"), "")

    @property
    def custom_attributes(self) -> dict[str, str]:
        """SageMaker's X-Amzn-SageMaker-Custom-Attributes as `{key: value}` (see
        custom_attributes.py); the header itself stays in `headers` as it came."""
        return custom_attributes_of(self.headers)


@dataclass(frozen=True)
class HandlerResponse:
    """One of `json` (a JSON value), `body` (bytes as they are) or `stream` (pieces sent as
    they are produced; an error after the first piece has to be a piece itself)."""

    status: int = 200
    json: Any = None
    body: bytes | None = None
    stream: Iterator[str | bytes] | None = None
    content_type: str = "application/json"
    headers: Mapping[str, str] = field(default_factory=dict)

    @classmethod
    def error(cls, status: int, message: str, **extra: Any) -> HandlerResponse:
        """The project's error body: `{"code", "message", ...}` (`field` names bad input)."""
        return cls(status=status, json={"code": status, "message": message, **extra})


class Handler(Protocol):
    def handle(self, request: HandlerRequest) -> HandlerResponse: ...


class EngineConnection(Protocol):
    """What a handler that generates needs from the engine client (container/engine_client.py):
    submit a message and read its events; stop following a request, or abort it."""

    def submit(
        self, message: protocol.ToEngine, events: queue.SimpleQueue | None = None
    ) -> queue.SimpleQueue[protocol.Event]: ...

    def finish(self, request_id: str, abort: bool) -> None: ...

    def last_heard(self) -> float:
        """When (time.monotonic()) the engine last answered this front end anything."""
        ...


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
