"""The engine=Python loop over a real ZeroMQ socket, with a scripted model: a malformed request
from a front end (not msgpack, a generate with wrong types, an unknown op) is answered with an
error where its id is readable and never stops the engine, which goes on answering well-formed
requests with one final event each."""

from __future__ import annotations

import time
import uuid

import zmq

from lmserve.handlers.hf_engine import Generation
from lmserve.handlers.worker import PythonEngineLoop
from lmserve.properties.config import load_config
from lmserve.rolling_batch import protocol
from lmserve.rolling_batch.ipc import drain_router
from lmserve.rolling_batch.runtime import Runtime


class ScriptedModel:
    """Answers every prompt with its last token + 1, as many times as max_new_tokens."""

    def generate(self, prompts, params) -> list[Generation]:
        return [
            Generation([p[-1] + 1] * q.max_new_tokens, [-0.5] * q.max_new_tokens, "length")
            for p, q in zip(prompts, params)
        ]


def test_malformed_requests_are_answered_with_errors_and_the_engine_goes_on(tmp_path):
    config = load_config(None, environ={}).config
    runtime = Runtime(config, "m", str(tmp_path), "test", str(tmp_path))
    context = zmq.Context.instance()
    address = f"inproc://python-engine-{uuid.uuid4().hex}"
    router, dealer = context.socket(zmq.ROUTER), context.socket(zmq.DEALER)
    router.bind(address)
    dealer.connect(address)
    try:
        loop = PythonEngineLoop(runtime, ScriptedModel(), router)
        dealer.send(b"\xc1 not msgpack")
        bad = {"op": "generate", "id": "x", "prompt_ids": [1], "params": {"max_new_tokens": "2"}}
        dealer.send(protocol.pack(bad))
        dealer.send(protocol.pack({"op": "teleport", "id": "z"}))
        good = protocol.GenerateRequest("ok", [7], protocol.GenerationParams(max_new_tokens=2))
        dealer.send(protocol.encode(good))
        assert router.poll(2000)
        time.sleep(0.05)  # every frame sent is waiting on the socket
        drain_router(router, loop._handle)
        for batch in iter(lambda: loop.batcher.next_batch(time.monotonic() + 60), []):
            loop._run_batch(batch)
        events = []
        while dealer.poll(1000):
            events += protocol.decode_events(dealer.recv())
            if isinstance(events[-1], protocol.FinalEvent):
                break
    finally:
        router.close(linger=0)
        dealer.close(linger=0)
    errors = [(e.id, e.status) for e in events if isinstance(e, protocol.ErrorEvent)]
    assert errors == [("x", 500), ("z", 500)]
    assert "max_new_tokens" in events[0].message  # says what was wrong
    (final,) = [e for e in events if e.id == "ok"]
    assert final.token_ids == [8, 8] and final.finish_reason == protocol.FinishReason.LENGTH
