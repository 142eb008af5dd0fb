"""The front end's engine client over a real socket: a frame carrying a step's events for
several requests reaches each request's queue; a malformed frame is dropped, not fatal."""

from __future__ import annotations

import zmq

from lmserve.container.engine_client import EngineClient
from lmserve.properties.config import load_config
from lmserve.rolling_batch import protocol
from lmserve.rolling_batch.runtime import Runtime


def test_batched_events_reach_each_request_and_bad_frames_are_dropped(tmp_path):
    config = load_config(None, environ={}).config
    runtime = Runtime(config, "m", str(tmp_path), "test", str(tmp_path))
    engine = zmq.Context.instance().socket(zmq.ROUTER)
    engine.bind(runtime.engine_address)
    try:
        client = EngineClient(runtime)
        first = client.submit({"op": protocol.OP_STATS, "id": "a"})
        second = client.submit({"op": protocol.OP_STATS, "id": "b"})
        assert engine.poll(5000)
        identity, _ = engine.recv_multipart()
        token = {"kind": protocol.KIND_TOKEN, "token_ids": [1], "log_probs": [-0.5]}
        engine.send_multipart([identity, b"\xc1 not msgpack"])
        engine.send_multipart([identity, protocol.pack({"kind": "batch", "events": 3})])
        batch = protocol.batch_event(
            [{**token, "id": "a"}, {**token, "id": "gone"}, {**token, "id": "b"}]
        )
        engine.send_multipart([identity, protocol.pack(batch)])
        final = protocol.final_event("a", [2], [-0.1], "length", 2)
        engine.send_multipart([identity, protocol.pack(final)])
        assert first.get(timeout=5)["token_ids"] == [1]
        assert first.get(timeout=5)["kind"] == protocol.KIND_FINAL
        assert second.get(timeout=5)["id"] == "b"
        assert first.empty() and second.empty()
    finally:
        engine.close(linger=0)
