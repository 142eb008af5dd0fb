"""The engine=Python loop over a real ZeroMQ socket, with a scripted model or a real model.py
handler: a malformed request from a front end (not msgpack, a generate with wrong types, an
unknown op) is answered with an error where its id is readable and never stops the engine; a
user's handler answers raw requests whole or streamed, a raising handler fails its request with
424, and a request for the other kind of work is answered, not left hanging."""

from __future__ import annotations

import sys
import textwrap
import time
import uuid
from contextlib import contextmanager

import msgspec
import pytest
import torch
import zmq

from lmserve.handlers.custom.user_code import find_entry_point, load
from lmserve.handlers.python_engine.custom_service import UserHandlerService
from lmserve.handlers.python_engine.hf_engine import Generation
from lmserve.handlers.python_engine.hf_work import HFGenerateWork
from lmserve.handlers.python_engine.process import python_engine_shell
from lmserve.handlers.python_engine.user_handler_work import UserHandlerWork
from lmserve.properties.config import load_config
from lmserve.rolling_batch.ipc import protocol
from lmserve.rolling_batch.ipc.router import drain_router
from lmserve.rolling_batch.ipc.runtime import Runtime


class ScriptedModel:
    """Answers every prompt with its last token + 1, as many times as max_new_tokens."""

    adapters = None  # LoRA off

    def generate(self, prompts, params) -> list[Generation]:
        return [
            Generation([p[-1] + 1] * q.max_new_tokens, [-0.5] * q.max_new_tokens, "length")
            for p, q in zip(prompts, params)
        ]


@contextmanager
def engine(tmp_path, work, **env):
    """(the loop, a front end's DEALER socket connected to it)."""
    config = load_config(None, environ=env).config
    runtime = Runtime(config, "m", str(tmp_path), "test", str(tmp_path))
    context = zmq.Context.instance()
    address = f"inproc://python-engine-{uuid.uuid4().hex}"
    router, dealer = context.socket(zmq.ROUTER), context.socket(zmq.DEALER)
    router.bind(address)
    dealer.connect(address)
    try:
        yield python_engine_shell(runtime, work, router), dealer
    finally:
        router.close(linger=0)
        dealer.close(linger=0)


class CountingSocket:
    """The engine's socket, counting the messages read from it."""

    def __init__(self, socket: zmq.Socket):
        self.socket = socket
        self.received = 0

    def recv_multipart(self, *args, **kwargs):
        message = self.socket.recv_multipart(*args, **kwargs)
        self.received += 1
        return message

    def send_multipart(self, *args, **kwargs):
        return self.socket.send_multipart(*args, **kwargs)


def exchange(loop, dealer, frames: list[bytes], expected_events: int) -> list:
    """Sends `frames`, runs every batch they make, returns the events the front end got."""
    for frame in frames:
        dealer.send(frame)
    counting = CountingSocket(loop.socket)
    while counting.received < len(frames):  # every frame sent has reached the engine
        assert loop.socket.poll(60_000), f"{counting.received} of {len(frames)} frames arrived"
        drain_router(counting, loop.handle)
    for batch in iter(lambda: loop.core.batcher.next_batch(time.monotonic() + 60), []):
        loop.core.run_batch(batch, loop.outbox)
        loop.outbox.flush()
    events = []
    while len(events) < expected_events and dealer.poll(60_000):
        events += protocol.decode_events(dealer.recv())
    return events


def test_malformed_requests_are_answered_with_errors_and_the_engine_goes_on(tmp_path):
    with engine(tmp_path, HFGenerateWork(ScriptedModel())) as (loop, dealer):
        bad = {"op": "generate", "id": "x", "prompt_ids": [1], "params": {"max_new_tokens": "2"}}
        good = protocol.GenerateRequest("ok", [7], protocol.GenerationParams(max_new_tokens=2))
        frames = [
            b"\xc1 not msgpack",
            msgspec.msgpack.encode(bad),
            msgspec.msgpack.encode({"op": "teleport", "id": "z"}),
            protocol.encode(good),
        ]
        events = exchange(loop, dealer, frames, expected_events=3)
    errors = [(e.id, e.status) for e in events if isinstance(e, protocol.ErrorEvent)]
    assert errors == [("x", 500), ("z", 500)]
    assert "max_new_tokens" in events[0].message  # says what was wrong
    (final,) = [e for e in events if e.id == "ok"]
    assert final.token_ids == [8, 8] and final.finish_reason == protocol.FinishReason.LENGTH


class MemoryBoundModel(ScriptedModel):
    """Runs out of memory, for real, on a batch needing more than `budget` new tokens in all
    (HF generate keeps batch x max_new_tokens x vocab scores)."""

    def __init__(self, budget: int):
        self.budget = budget
        self.batch_sizes: list[int] = []

    def generate(self, prompts, params) -> list[Generation]:
        self.batch_sizes.append(len(prompts))
        if sum(p.max_new_tokens for p in params) > self.budget:
            torch.empty(2**50, dtype=torch.uint8)  # 1 PiB: the CPU allocator's own error
        return super().generate(prompts, params)


def test_out_of_memory_fails_the_request_that_cannot_fit_and_the_engine_goes_on(tmp_path):
    """A batch that runs out of memory is retried request by request: the one too big alone
    gets 507, its neighbours their answers, and the engine serves the next batch."""
    model = MemoryBoundModel(budget=10)
    env = {"SERVING_BATCH_SIZE": "4", "SERVING_MAX_BATCH_DELAY": "10000"}
    with engine(tmp_path, HFGenerateWork(model), **env) as (loop, dealer):
        sizes = {"a": 2, "big": 50, "b": 3}
        frames = [
            protocol.encode(
                protocol.GenerateRequest(name, [5], protocol.GenerationParams(max_new_tokens=n))
            )
            for name, n in sizes.items()
        ]
        events = exchange(loop, dealer, frames, expected_events=3)
        later = protocol.GenerateRequest("later", [7], protocol.GenerationParams(max_new_tokens=4))
        events += exchange(loop, dealer, [protocol.encode(later)], expected_events=1)
    answers = {e.id: (type(e).__name__, getattr(e, "status", None)) for e in events}
    assert answers == {
        "a": ("FinalEvent", None),
        "big": ("ErrorEvent", 507),
        "b": ("FinalEvent", None),
        "later": ("FinalEvent", None),
    }
    (failed,) = [e for e in events if e.id == "big"]
    assert "can't allocate memory" in failed.message
    assert [len(e.token_ids) for e in events if e.id in ("a", "b", "later")] == [2, 3, 4]
    assert model.batch_sizes == [3, 1, 1, 1, 1]
    assert loop.core.work.num_failed == 1


class ForeignRequest(msgspec.Struct, frozen=True):
    """A request of a kind this engine does not take (a newer front end's, the other engine's)."""

    id: str


def test_a_request_of_a_kind_the_engine_does_not_take_is_answered(tmp_path):
    sent = []
    with engine(tmp_path, HFGenerateWork(ScriptedModel())) as (loop, _):
        loop.outbox.send = lambda identity, event: sent.append((identity, event))
        loop.handle(b"front", ForeignRequest("f"))
    ((identity, refused),) = sent
    assert identity == b"front" and (refused.id, refused.status) == ("f", 501)
    assert "ForeignRequest" in refused.message


HANDLER = """
from djl_python import Input, Output

def handle(inputs: Input):
    if inputs.is_empty():
        return None
    outputs = Output()
    for index, item in enumerate(inputs.get_batches()):
        text = item.get_as_string()
        if text == "boom":
            raise RuntimeError("the handler blew up")
        if text == "stream":
            outputs.add_stream_content(iter(["a", "b", "c"]))
            return outputs
        outputs.add(text.upper(), batch_index=index)
    return outputs
"""


@pytest.fixture
def handler_work(tmp_path):
    (tmp_path / "model.py").write_text(textwrap.dedent(HANDLER))
    entry = find_entry_point(None, tmp_path)
    yield UserHandlerWork(UserHandlerService(load(entry, tmp_path), entry.name))
    sys.modules.pop("model", None)


def handle_request(request_id: str, text: str) -> bytes:
    return protocol.encode(protocol.HandleRequest(request_id, text.encode(), {}))


def test_user_handler_batches_raw_requests_and_answers_each(tmp_path, handler_work):
    env = {"SERVING_BATCH_SIZE": "2", "SERVING_MAX_BATCH_DELAY": "10000"}
    with engine(tmp_path, handler_work, **env) as (loop, dealer):
        frames = [handle_request("a", "one"), handle_request("b", "two")]
        events = exchange(loop, dealer, frames, expected_events=2)
    assert [(e.id, e.status, e.body) for e in events] == [("a", 200, b"ONE"), ("b", 200, b"TWO")]
    assert loop.core.batch_sizes == {2: 1}


def test_user_handler_stream_and_errors(tmp_path, handler_work):
    generate = protocol.GenerateRequest("g", [1], protocol.GenerationParams())
    with engine(tmp_path, handler_work) as (loop, dealer):
        frames = [
            handle_request("s", "stream"),
            handle_request("x", "boom"),
            protocol.encode(generate),
        ]
        events = exchange(loop, dealer, frames, expected_events=7)
    by_id = {}
    for event in events:
        by_id.setdefault(event.id, []).append(event)
    reply, *chunks = by_id["s"]
    assert isinstance(reply, protocol.ReplyEvent) and reply.streaming
    assert [c.data for c in chunks] == [b"a", b"b", b"c", b""] and chunks[-1].last
    (failed,) = by_id["x"]
    assert (failed.status, failed.message) == (424, "RuntimeError: the handler blew up")
    (refused,) = by_id["g"]
    assert refused.status == 500 and "HandleRequest" in refused.message
    assert loop.core.work.num_failed == 1
