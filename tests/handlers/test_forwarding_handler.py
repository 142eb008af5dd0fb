"""The front end's side of a user's handler, against a scripted engine: the request goes to the
engine as it came, the answer comes back with the handler's status and headers, streamed
pieces are relayed as they come, and a silent or failing engine gets the usual errors."""

from __future__ import annotations

import json
import queue
import time

from lmserve.handlers.custom.forwarding_handler import ForwardingHandler
from lmserve.handlers.interface import HandlerRequest
from lmserve.properties.config import load_config
from lmserve.rolling_batch.ipc import protocol
from lmserve.rolling_batch.ipc.runtime import Runtime


class ScriptedEngine:
    def __init__(self, *events):
        self.events = events
        self.messages: list = []
        self.finished: list[tuple[str, bool]] = []
        self.created = time.monotonic()

    def submit(self, message):
        self.messages.append(message)
        events = queue.SimpleQueue()
        for event in self.events:
            events.put(event)
        return events

    def finish(self, request_id, abort):
        self.finished.append((request_id, abort))

    def last_heard(self):
        return self.created  # heard from once: a silent engine from then on


def forward(engine, body=b'{"a": 1}', **headers):
    config = load_config(None, {"OPTION_PREDICT_TIMEOUT": "1"}).config
    handler = ForwardingHandler(Runtime(config, "m", "/m", "test", "/ipc", "model.py"), engine)
    request = HandlerRequest(body, "application/json", "r1", headers={"X-Custom": "1", **headers})
    return handler.handle(request)


def test_request_goes_as_it_came_and_the_answer_comes_back_as_it_is():
    reply = protocol.ReplyEvent("r1", 201, {"content-type": "text/csv", "x-rows": "2"}, b"a,b\n")
    engine = ScriptedEngine(reply)
    answer = forward(engine)
    (sent,) = engine.messages
    assert (sent.body, sent.headers) == (
        b'{"a": 1}',
        {"x-custom": "1", "content-type": "application/json"},
    )
    assert (answer.status, answer.body, answer.content_type) == (201, b"a,b\n", "text/csv")
    assert answer.headers == {"x-rows": "2"}
    assert engine.finished == [("r1", False)]


def test_streamed_pieces_are_relayed_in_order():
    engine = ScriptedEngine(
        protocol.ReplyEvent("r1", 200, {"content-type": "text/plain"}, b"", streaming=True),
        protocol.ChunkEvent("r1", b"one "),
        protocol.ChunkEvent("r1", b"two"),
        protocol.ChunkEvent("r1", b"", last=True),
    )
    answer = forward(engine)
    assert list(answer.stream) == [b"one ", b"two"]
    assert engine.finished == [("r1", False)]


def test_handler_failure_is_djls_424_body():
    engine = ScriptedEngine(protocol.ErrorEvent("r1", 424, "ValueError: bad"))
    answer = forward(engine)
    assert answer.status == 424
    assert answer.json == {"code": 424, "message": "prediction failure", "error": "ValueError: bad"}


def test_silent_engine_times_out_and_the_request_is_aborted():
    engine = ScriptedEngine()
    answer = forward(engine)
    assert answer.status == 424 and "option.predict_timeout" in answer.json["error"]
    assert engine.finished == [("r1", True)]


def test_stream_that_fails_midway_ends_with_an_error_piece():
    engine = ScriptedEngine(
        protocol.ReplyEvent("r1", 200, {}, b"", streaming=True),
        protocol.ChunkEvent("r1", b"one"),
        protocol.ErrorEvent("r1", 424, "RuntimeError: stream broke"),
    )
    pieces = list(forward(engine).stream)
    assert pieces[0] == b"one"
    assert json.loads(pieces[1]) == {"code": 424, "error": "RuntimeError: stream broke"}
    assert engine.finished == [("r1", False)]


def test_client_leaving_mid_stream_aborts_in_the_engine():
    engine = ScriptedEngine(
        protocol.ReplyEvent("r1", 200, {}, b"", streaming=True),
        protocol.ChunkEvent("r1", b"one"),
        protocol.ChunkEvent("r1", b"two"),
    )
    stream = forward(engine).stream
    next(stream)
    stream.close()
    assert engine.finished == [("r1", True)]
