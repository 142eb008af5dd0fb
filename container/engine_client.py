"""The front end's side of the engine socket, one per gunicorn worker.

One I/O thread owns the ZeroMQ DEALER socket (zmq sockets are not thread-safe): request threads
hand it outgoing frames through a queue and wake it through a pipe; it routes engine events
(a frame may carry a step's events for several requests) to per-request queues keyed by
request id. It also watches the engine's state file, so a dead engine answers every waiting
request instead of leaving it hanging.

Stats (for /metrics and /models) come from the engine between its steps or, for engine=Python,
between its batches, which take seconds under load. So the thread keeps the newest stats any
answer brought and asks for fresh ones every few seconds: a scrape the engine cannot answer at
once gets those, with their age, instead of waiting out the batch. Each worker also leaves the
newest it heard in a file beside the engine's state, so a worker that has none of its own (one
gunicorn started or restarted while the engine was busy) answers with another's, not "down".
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
import uuid
from pathlib import Path

import msgspec
import zmq

from lmserve.rolling_batch.ipc import protocol
from lmserve.rolling_batch.ipc.runtime import Runtime, read_state, write_atomically

log = logging.getLogger(__name__)

_STATE_CHECK_S = 0.5
_STATS_REFRESH_S = 5.0
_REFRESH_ID = "stats-refresh"  # answers to the I/O thread's own requests, routed to no one
_REFRESH_RETRY_S = 60.0  # a refresh unanswered this long was lost (say the engine restarted)
SHARED_STATS_FILE = "stats.json"  # the newest stats any web worker heard: {"stats", "received"}


class EngineClient:
    def __init__(self, runtime: Runtime):
        self.runtime = runtime
        self._outbox: queue.SimpleQueue[bytes] = queue.SimpleQueue()
        self._waiters: dict[str, queue.SimpleQueue[protocol.Event]] = {}
        self._lock = threading.Lock()
        self._latest_stats: tuple[dict, float] | None = None  # (stats, monotonic time received)
        self._refresh_sent_at: float | None = None  # a refresh request awaits its answer
        self._was_ready = False
        self._last_heard = time.monotonic()  # when the engine last sent this worker a frame
        self._state: tuple[tuple | None, dict] | None = None  # (file version, its state)
        self._wake_read, self._wake_write = os.pipe()
        os.set_blocking(self._wake_read, False)
        self._thread = threading.Thread(target=self._run, name="engine-io", daemon=True)
        self._thread.start()

    def state(self) -> dict:
        """The engine's state (loading, ready, failed, with its reason). The file is parsed
        again only when it was replaced since the copy kept here (the engine and the
        supervisor write it by rename): a request costs one stat, never a stale answer, so no
        web worker says "ready" after another has said "failed", or "loading" after "ready"."""
        try:
            stat = os.stat(self.runtime.state_path)
            version = (stat.st_ino, stat.st_mtime_ns, stat.st_size)
        except FileNotFoundError:
            version = None
        kept = self._state
        if kept is not None and kept[0] == version:
            return kept[1]
        state = read_state(self.runtime)
        self._state = (version, state)
        return state

    def submit(
        self,
        message: protocol.GenerateRequest
        | protocol.HandleRequest
        | protocol.StatsRequest
        | protocol.AdapterCommand,
        events: queue.SimpleQueue[protocol.Event] | None = None,
    ) -> queue.SimpleQueue[protocol.Event]:
        """Sends `message`; the events for its id arrive on the returned queue: `events` when
        given (several requests read as one stream, told apart by their ids), else a new one."""
        if events is None:
            events = queue.SimpleQueue()
        with self._lock:
            self._waiters[message.id] = events
        self._send(message)
        return events

    def finish(self, request_id: str, abort: bool) -> None:
        """Stops routing events for `request_id`; `abort` also tells the engine to drop it."""
        with self._lock:
            self._waiters.pop(request_id, None)
        if abort:
            self._send(protocol.AbortRequest(request_id))

    def last_heard(self) -> float:
        """When (time.monotonic()) the engine last sent this worker anything. While requests
        wait, the I/O thread asks for stats often enough that an engine that goes on stepping
        is heard from within a step: a long silence is a step (or batch) that does not end."""
        return self._last_heard

    def stats(self, timeout: float) -> tuple[dict, float] | None:
        """(the engine's stats, their age in seconds): a fresh answer when the engine gives
        one within `timeout`, else the newest this worker has; None if it has none."""
        stats_id = f"stats-{uuid.uuid4().hex}"
        events = self.submit(protocol.StatsRequest(stats_id))
        try:
            answer = events.get(timeout=timeout)
            if isinstance(answer, protocol.StatsEvent):
                return answer.stats, 0.0
        except queue.Empty:
            pass
        finally:
            self.finish(stats_id, abort=False)
        # No answer, or an error event instead of stats: the newest this worker or another has.
        known = []
        if (latest := self._latest_stats) is not None:
            known.append((latest[0], time.monotonic() - latest[1]))
        if (shared := self._shared_stats()) is not None:
            known.append(shared)
        return min(known, key=lambda stats_and_age: stats_and_age[1], default=None)

    def _shared_stats(self) -> tuple[dict, float] | None:
        """The copy another worker left, with its age; None when there is none or it came from
        an engine before the one serving now (the state's `since` is when it became ready:
        read afresh, so that stats from before a restart this thread has not seen yet are
        never served)."""
        state = read_state(self.runtime)
        if state["state"] != protocol.EngineState.READY:
            return None
        try:
            shared = msgspec.json.decode(self._shared_stats_path.read_bytes())
            stats, received = shared["stats"], float(shared["received"])
        except (FileNotFoundError, msgspec.DecodeError, KeyError, TypeError, ValueError):
            return None
        if received < state.get("since", float("inf")):
            return None
        return stats, max(0.0, time.time() - received)

    @property
    def _shared_stats_path(self) -> Path:
        return Path(self.runtime.ipc_dir) / SHARED_STATS_FILE

    def notify(self, message: protocol.CountResponse) -> None:
        """Sends a message that gets no reply."""
        self._send(message)

    def _send(self, message: protocol.ToEngine) -> None:
        self._outbox.put(protocol.encode(message))
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
                state = self.state()
                self._fail_all_if_engine_failed(state)
                self._refresh_stats(socket, now, state["state"] == protocol.EngineState.READY)

    def _refresh_stats(self, socket: zmq.Socket, now: float, ready: bool) -> None:
        """Asks for stats when this worker's copy is old, unless a request is still unanswered
        (a long batch); the answer lands in _latest_stats. The first request goes out before
        the engine is ready: ZeroMQ holds it until the engine binds, and the engine answers it
        before any generation can keep it busy."""
        if not ready:
            self._latest_stats = None  # the engine that gave them is loading, failed or gone
            if self._was_ready:  # and so are requests sent to it
                self._refresh_sent_at = None
        self._was_ready = ready
        if self._refresh_sent_at is not None and now - self._refresh_sent_at < _REFRESH_RETRY_S:
            return
        latest = self._latest_stats
        interval = _STATS_REFRESH_S
        if self._waiters:  # requests wait: keep hearing from the engine well within a timeout
            interval = min(interval, self.runtime.config.predict_timeout / 3)
        if latest is not None and now - latest[1] < interval:
            return
        self._refresh_sent_at = now
        socket.send(protocol.encode(protocol.StatsRequest(_REFRESH_ID)))

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
            self._last_heard = time.monotonic()
            try:
                events = protocol.decode_events(frame)
            except protocol.MalformedFrame as error:
                log.error("dropping malformed engine frame: %s", error)
                continue
            with self._lock:
                routes = [(self._waiters.get(event.id), event) for event in events]
            self._keep_stats(events)
            for waiter, event in routes:
                if waiter is not None:
                    waiter.put(event)

    def _keep_stats(self, events: list[protocol.Event]) -> None:
        for event in events:
            if isinstance(event, protocol.StatsEvent):
                self._latest_stats = (event.stats, time.monotonic())
                shared = {"stats": event.stats, "received": time.time()}
                write_atomically(self._shared_stats_path, msgspec.json.encode(shared).decode())
                if event.id == _REFRESH_ID:
                    self._refresh_sent_at = None

    def _fail_all_if_engine_failed(self, state: dict) -> None:
        if state["state"] != protocol.EngineState.FAILED:
            return
        with self._lock:
            waiters, self._waiters = self._waiters, {}
        reason = f"engine failed: {state.get('reason', 'unknown')}"
        for request_id, waiter in waiters.items():
            waiter.put(protocol.ErrorEvent(request_id, 503, reason))
