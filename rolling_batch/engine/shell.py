"""The engine process's shell, the same for both engines: it owns the socket and everything a
request meets before and after the model. Torch-free.

    loop:
      read the socket: requests (refused, or queued in the core), aborts, stats, adapter
        commands, the front ends' response counts
      answer the requests that waited past option.predict_timeout for a place
      core.step(outbox)      # the rolling batch's step, or one dynamic batch
      send the step's events: one frame per web worker
      drop the unregistered LoRA adapters no request uses anymore

The work itself is an `EngineCore`: the rolling batch (rolling_core.py) or dynamic batching
(handlers/python_engine/dynamic_core.py). The offline `LLM` drives the same shell and core in
process, or talks to the rank-0 shell over the same socket (llm.py).
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Callable
from typing import Protocol

import zmq

from ..ipc import protocol
from ..ipc.router import drain_router
from ..lora.registry import ServedAdapters, lora_off_answer

_IDLE_POLL_MS = 100


class EngineCore(Protocol):
    """What the shell drives. `request_type`: the request message the core runs
    (GenerateRequest for generation, HandleRequest for a model.py's handle()). `adapters`:
    the LoRA adapters it serves (None: LoRA is off); a core that never serves them (a user's
    handler) has `takes_adapter_commands` False."""

    request_type: type
    adapters: ServedAdapters | None
    takes_adapter_commands: bool

    def refusal(self, message) -> protocol.ErrorEvent | None:
        """The answer to a request the core will never run (None: it may), before the queue
        is checked: a request that can never run is not told to retry."""
        ...

    def num_queued(self) -> int:
        """Requests admitted that have not started yet (bounded by job_queue_size)."""
        ...

    def add(self, identity: bytes, message, now: float) -> None: ...

    def abort(self, request_id: str) -> bool:
        """Drops the request (its client went away); False when the core does not hold it."""
        ...

    def expire(self, arrived_before: float) -> list[tuple[bytes, str]]:
        """Removes the requests that arrived before `arrived_before` and never started;
        (reply_to, request id) each, for the shell to answer."""
        ...

    def seconds_until_work(self, now: float) -> float | None:
        """How long the loop may wait on the socket before the next step is due (0: now);
        None when the core holds nothing."""
        ...

    def step(self, outbox: Outbox) -> None:
        """One rolling step, or one dynamic batch; every event goes through `outbox`."""
        ...

    def stats(self) -> dict: ...


class Outbox:
    """Events on their way to the front ends: held until `flush`, then one frame per web
    worker (a BatchEvent where it holds several). `sent(event)` sees every event as it is
    put in, for the shell's accounting."""

    def __init__(self, socket: zmq.Socket, sent: Callable[[protocol.Event], None]):
        self.socket = socket
        self._sent = sent
        self._held: dict[bytes, list[protocol.Event]] = {}

    def send(self, identity: bytes, event: protocol.Event) -> None:
        self._sent(event)
        self._held.setdefault(identity, []).append(event)

    def flush(self) -> None:
        held, self._held = self._held, {}
        for identity, events in held.items():
            event = events[0] if len(events) == 1 else protocol.BatchEvent(events)
            self.socket.send_multipart([identity, protocol.encode(event)])


class EngineShell:
    def __init__(
        self,
        core: EngineCore,
        socket: zmq.Socket,
        max_queued: int,
        slot_timeout_s: float | None = None,
    ):
        self.core = core
        self.socket = socket
        self.outbox = Outbox(socket, self._account)
        self.max_queued = max_queued  # job_queue_size
        # option.predict_timeout: how long a request may wait for its place (None: no bound).
        self.slot_timeout_s = slot_timeout_s
        self.http_responses: Counter[int] = Counter()  # counted here so all web workers agree
        # LoRA: requests admitted and tokens generated per adapter (the base model's are not
        # here), and the adapter of each request in the engine that names one.
        self.adapter_requests: Counter[str] = Counter()
        self.adapter_tokens: Counter[str] = Counter()
        self.adapter_of: dict[str, str] = {}

    def run_forever(self) -> None:
        poller = zmq.Poller()
        poller.register(self.socket, zmq.POLLIN)
        while True:
            wait = self.core.seconds_until_work(time.monotonic())
            timeout_ms = _IDLE_POLL_MS if wait is None else math.ceil(wait * 1000)
            if poller.poll(timeout_ms):
                self.read_socket()
            self.turn()

    def read_socket(self) -> None:
        drain_router(self.socket, self.handle)

    def turn(self) -> None:
        """Everything between two reads of the socket: expiry, one step, the adapters."""
        self.expire_waiting(time.monotonic())
        self.core.step(self.outbox)
        self.outbox.flush()
        self.retire_unused_adapters()

    def expire_waiting(self, now: float) -> None:
        """option.predict_timeout bounds the wait for a place in a batch, never a request under
        way (DJL's meaning): requests that waited longer are answered instead of waiting on."""
        if self.slot_timeout_s is None:
            return
        message = (
            f"no place in a batch within {self.slot_timeout_s:g} s (option.predict_timeout);"
            " the server is busy, retry later"
        )
        for reply_to, request_id in self.core.expire(now - self.slot_timeout_s):
            self.outbox.send(reply_to, protocol.ErrorEvent(request_id, 503, message))
        self.outbox.flush()

    def retire_unused_adapters(self) -> None:
        """Drops the unregistered adapters no request in the engine names anymore."""
        adapters = self.core.adapters
        if adapters is not None and adapters.retiring:
            adapters.retire_unused(set(self.adapter_of.values()))

    def handle(self, identity: bytes, message: protocol.ToEngine) -> None:
        """Acts on one message from a front end; an answer goes out at once."""
        self._dispatch(identity, message)
        self.outbox.flush()

    def _dispatch(self, identity: bytes, message: protocol.ToEngine) -> None:
        core = self.core
        if isinstance(message, core.request_type):
            self._admit(identity, message)
        elif isinstance(message, (protocol.GenerateRequest, protocol.HandleRequest)):
            # A front end that disagrees with this engine about the handler: answer, never hang.
            reason = f"this engine takes {core.request_type.__name__}s only"
            self.outbox.send(identity, protocol.ErrorEvent(message.id, 500, reason))
        elif isinstance(message, protocol.AbortRequest):
            if core.abort(message.id):
                self.adapter_of.pop(message.id, None)
        elif isinstance(message, protocol.CountResponse):
            self.http_responses[message.status] += 1
        elif isinstance(message, protocol.StatsRequest):
            self.outbox.send(identity, protocol.StatsEvent(message.id, self.stats()))
        elif isinstance(message, protocol.AdapterCommand) and core.takes_adapter_commands:
            self.outbox.send(identity, self._answer_adapters(message))
        elif isinstance(getattr(message, "id", None), str):
            # A message of a kind this engine does not take (the other engine's, a newer
            # front end's): answered, never left to hang.
            reason = f"this engine does not take {type(message).__name__} messages"
            self.outbox.send(identity, protocol.ErrorEvent(message.id, 501, reason))

    def _admit(self, identity: bytes, message) -> None:
        refusal = self.core.refusal(message)
        if refusal is not None:
            self.outbox.send(identity, refusal)
            return
        if self.core.num_queued() >= self.max_queued:
            self.outbox.send(identity, protocol.queue_full_event(message.id, self.max_queued))
            return
        self.core.add(identity, message, time.monotonic())
        adapter = message.params.adapter if isinstance(message, protocol.GenerateRequest) else None
        if adapter is not None:
            self.adapter_requests[adapter] += 1
            self.adapter_of[message.id] = adapter

    def _answer_adapters(self, command: protocol.AdapterCommand) -> protocol.Event:
        if self.core.adapters is None:
            return lora_off_answer(command)
        return self.core.adapters.answer(command, set(self.adapter_of.values()))

    def _account(self, event: protocol.Event) -> None:
        """Tokens per adapter; a request's last event takes it out of the engine."""
        adapter = self.adapter_of.get(getattr(event, "id", None))
        if adapter is None:
            return
        if isinstance(event, (protocol.TokenEvent, protocol.FinalEvent)):
            self.adapter_tokens[adapter] += len(event.token_ids)
        if isinstance(event, (protocol.FinalEvent, protocol.ErrorEvent)):
            del self.adapter_of[event.id]

    def stats(self) -> dict:
        return {
            **self.core.stats(),
            "http_responses": {str(k): v for k, v in self.http_responses.items()},
            "adapter_requests": dict(self.adapter_requests),
            "adapter_tokens": dict(self.adapter_tokens),
        }
