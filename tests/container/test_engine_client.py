"""The front end's engine client over a real socket: a frame carrying a step's events for
several requests reaches each request's queue; a malformed frame (not msgpack, wrong types, an
unknown kind) is dropped, not fatal; stats
come fresh when the engine answers in time, else the newest the client has (its own periodic
refresh keeps some), with their age."""

from __future__ import annotations

import threading
import time

import pytest
import zmq
from msgspec.msgpack import encode as pack

from lmserve.container.engine_client import _REFRESH_ID, EngineClient
from lmserve.properties.config import load_config
from lmserve.rolling_batch.ipc import protocol
from lmserve.rolling_batch.ipc.runtime import Runtime, write_state


@pytest.fixture
def runtime(tmp_path):
    config = load_config(None, environ={}).config
    return Runtime(config, "m", str(tmp_path), "test", str(tmp_path))


@pytest.fixture
def engine(runtime):
    socket = zmq.Context.instance().socket(zmq.ROUTER)
    socket.bind(runtime.engine_address)
    yield socket
    socket.close(linger=0)


def receive(engine) -> tuple[bytes, protocol.ToEngine]:
    assert engine.poll(60_000), "nothing reached the engine"
    identity, frame = engine.recv_multipart()
    return identity, protocol.decode_request(frame)


def test_batched_events_reach_each_request_and_bad_frames_are_dropped(runtime, engine):
    if True:
        client = EngineClient(runtime)
        first = client.submit(protocol.StatsRequest("a"))
        second = client.submit(protocol.StatsRequest("b"))
        identity, _ = receive(engine)
        engine.send_multipart([identity, b"\xc1 not msgpack"])
        engine.send_multipart([identity, pack({"kind": "batch", "events": 3})])
        bad_token = {"kind": "token", "id": "a", "token_ids": ["x"], "log_probs": []}
        engine.send_multipart([identity, pack(bad_token)])
        engine.send_multipart([identity, pack({"kind": "teleport", "id": "a"})])
        batch = protocol.BatchEvent(
            [protocol.TokenEvent(request_id, [1], [-0.5]) for request_id in ("a", "gone", "b")]
        )
        engine.send_multipart([identity, protocol.encode(batch)])
        final = protocol.FinalEvent("a", [2], [-0.1], protocol.FinishReason.LENGTH, 2)
        engine.send_multipart([identity, protocol.encode(final)])
        assert first.get(timeout=60).token_ids == [1]
        assert isinstance(first.get(timeout=60), protocol.FinalEvent)
        assert second.get(timeout=60).id == "b"
        assert first.empty() and second.empty()


def test_stats_are_fresh_when_the_engine_answers_else_the_newest_known(runtime, engine):
    write_state(runtime, protocol.EngineState.READY)
    client = EngineClient(runtime)
    identity, refresh = receive(engine)  # the client's own refresh, sent at once when ready
    assert isinstance(refresh, protocol.StatsRequest)
    answered = time.monotonic()
    engine.send_multipart([identity, protocol.encode(protocol.StatsEvent(refresh.id, {"n": 1}))])
    deadline = time.monotonic() + 60
    while client._latest_stats is None:  # the I/O thread routes the answer
        assert time.monotonic() < deadline
        time.sleep(0.01)
    # The engine is "busy" (answers nothing): the refreshed copy, with its age: at least the
    # wait for a fresh answer, at most the time since the engine sent it.
    stats, age = client.stats(timeout=0.2)
    assert stats == {"n": 1} and 0.2 <= age <= time.monotonic() - answered
    receive(engine)  # that request, never answered
    answering = threading.Thread(target=answer_next, args=(engine, {"n": 2}))
    answering.start()
    assert client.stats(timeout=60) == ({"n": 2}, 0.0)
    answering.join()


def answer_next(engine, stats: dict) -> None:
    """Answers the next stats request (and, with the same stats, any refresh the client's own
    I/O thread sends first, when the machine is slow enough for one to be due)."""
    while True:
        identity, message = receive(engine)
        engine.send_multipart([identity, protocol.encode(protocol.StatsEvent(message.id, stats))])
        if message.id != _REFRESH_ID:
            return


def test_no_stats_before_the_engine_ever_answered(runtime, engine):
    assert EngineClient(runtime).stats(timeout=0.1) is None


def test_a_worker_without_stats_of_its_own_answers_with_another_workers(runtime, engine):
    """A gunicorn worker started (or restarted) while the engine is deep in a batch has heard
    nothing yet: it serves the newest stats another worker heard, with their age, instead of
    reporting the engine down; stats heard from an engine before the one now ready are not."""
    write_state(runtime, protocol.EngineState.READY)
    first = EngineClient(runtime)
    identity, refresh = receive(engine)
    engine.send_multipart([identity, protocol.encode(protocol.StatsEvent(refresh.id, {"n": 7}))])
    deadline = time.monotonic() + 60
    while first._latest_stats is None:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    late = EngineClient(runtime)  # its refresh goes unanswered: the engine is busy
    stats, age = late.stats(timeout=0.1)
    assert stats == {"n": 7} and age >= 0.1
    write_state(runtime, protocol.EngineState.READY)  # a restarted engine, ready afresh
    assert late.stats(timeout=0.1) is None
