"""The front end's side of the engine socket, one per gunicorn worker.

One I/O thread owns the ZeroMQ DEALER socket (zmq sockets are not thread-safe): request threads
hand it outgoing frames through a queue and wake it through a pipe; it routes engine events
(a frame may carry a step's events for several requests) to per-request queues keyed by
request id. While requests wait it also watches the engine's state
file, so a dead engine answers every waiting request instead of leaving it hanging.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time

import zmq

from lmserve.rolling_batch import protocol
from lmserve.rolling_batch.runtime import Runtime, read_state

log = logging.getLogger(__name__)

_STATE_CHECK_S = 0.5


class EngineClient:
    def __init__(self, runtime: Runtime):
        self.runtime = runtime
        self._outbox: queue.SimpleQueue[bytes] = queue.SimpleQueue()
        self._waiters: dict[str, queue.SimpleQueue[dict]] = {}
        self._lock = threading.Lock()
        self._wake_read, self._wake_write = os.pipe()
        os.set_blocking(self._wake_read, False)
        self._thread = threading.Thread(target=self._run, name="engine-io", daemon=True)
        self._thread.start()

    def state(self) -> dict:
        return read_state(self.runtime)

    def submit(self, message: dict) -> queue.SimpleQueue[dict]:
        """Sends `message` (carrying an "id"); its events arrive on the returned queue."""
        events: queue.SimpleQueue[dict] = queue.SimpleQueue()
        with self._lock:
            self._waiters[message["id"]] = events
        self._send(message)
        return events

    def finish(self, request_id: str, abort: bool) -> None:
        """Stops routing events for `request_id`; `abort` also tells the engine to drop it."""
        with self._lock:
            self._waiters.pop(request_id, None)
        if abort:
            self._send({"op": protocol.OP_ABORT, "id": request_id})

    def notify(self, message: dict) -> None:
        """Sends a message that gets no reply."""
        self._send(message)

    def _send(self, message: dict) -> None:
        self._outbox.put(protocol.pack(message))
        os.write(self._wake_write, b"x")

    def _run(self) -> None:
        socket = zmq.Context.instance().socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 0)
        socket.connect(self.runtime.engine_address)
        poller = zmq.Poller()
        poller.register(socket, zmq.POLLIN)
        poller.register(self._wake_read, zmq.POLLIN)
        next_state_check = 0.0
        while True:
            ready = dict(poller.poll(int(_STATE_CHECK_S * 1000)))
            if self._wake_read in ready:
                self._flush_outbox(socket)
            if socket in ready:
                self._route_events(socket)
            now = time.monotonic()
            if now >= next_state_check:
                next_state_check = now + _STATE_CHECK_S
                self._fail_all_if_engine_failed()

    def _flush_outbox(self, socket: zmq.Socket) -> None:
        try:
            os.read(self._wake_read, 65536)
        except BlockingIOError:
            pass
        while True:
            try:
                frame = self._outbox.get_nowait()
            except queue.Empty:
                return
            socket.send(frame)

    def _route_events(self, socket: zmq.Socket) -> None:
        while True:
            try:
                frame = socket.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                events = protocol.events_of(protocol.unpack(frame))
                with self._lock:
                    routes = [(self._waiters.get(event.get("id")), event) for event in events]
            except (ValueError, TypeError) as error:  # msgpack's errors are ValueErrors
                log.error("dropping malformed engine frame: %s", error)
                continue
            for waiter, event in routes:
                if waiter is not None:
                    waiter.put(event)

    def _fail_all_if_engine_failed(self) -> None:
        with self._lock:
            if not self._waiters:
                return
        state = self.state()
        if state["state"] != protocol.STATE_FAILED:
            return
        with self._lock:
            waiters, self._waiters = self._waiters, {}
        reason = f"engine failed: {state.get('reason', 'unknown')}"
        for request_id, waiter in waiters.items():
            waiter.put(protocol.error_event(request_id, 503, reason))
