"""The load generator's arrival modes against a fake streaming server (no model, under a
second): a burst has every request in flight at once, `concurrency=N` never more than N, and
`concurrency=1` sends each request only after the previous one ended."""

from __future__ import annotations

import json
import threading
import time
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from lmserve.benchmarks import loadgen
from lmserve.benchmarks.bench_cli import describe_arrival
from lmserve.benchmarks.workload import PlannedRequest


class _FakeServer(ThreadingHTTPServer):
    """Streams `max_new_tokens` lmserve-style token lines and records the most requests it
    had in flight. A request is held until `hold_for` requests are in flight, or all
    `expected` have come (no more can join it), so overlap that the client allows is certain
    to happen, not left to thread timing. The hold's timeout only guards against a hang (a
    client that allows less overlap than `hold_for`: the test then fails on max_in_flight)."""

    daemon_threads = True

    def __init__(self, hold_for: int, expected: int | None):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.hold_for = hold_for
        self.expected = expected
        self.in_flight = 0
        self.max_in_flight = 0
        self.changed = threading.Condition()
        self.bodies: list[dict] = []


class _Handler(BaseHTTPRequestHandler):
    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        server: _FakeServer = self.server
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with server.changed:
            server.bodies.append(body)
            server.in_flight += 1
            server.max_in_flight = max(server.max_in_flight, server.in_flight)
            server.changed.notify_all()
            server.changed.wait_for(
                lambda: (
                    server.in_flight >= server.hold_for or len(server.bodies) == server.expected
                ),
                timeout=60,
            )
        try:
            self.send_response(200)
            self.send_header("Content-Type", "application/jsonlines")
            self.end_headers()
            for index in range(body["parameters"]["max_new_tokens"]):
                time.sleep(0.005)
                self.wfile.write(json.dumps({"token": {"id": index, "text": "a"}}).encode())
                self.wfile.write(b"\n")
                self.wfile.flush()
        finally:
            with server.changed:
                server.in_flight -= 1
                server.changed.notify_all()

    def log_message(self, *args) -> None:
        pass


@contextmanager
def fake_server(hold_for: int, expected: int | None = None):
    server = _FakeServer(hold_for, expected)
    thread = threading.Thread(target=server.serve_forever, args=(0.01,), daemon=True)
    thread.start()
    try:
        yield server, f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def planned(count: int) -> list[PlannedRequest]:
    return [PlannedRequest(f"prompt {i}", 2, 3 + i % 2, 0.0) for i in range(count)]


@pytest.mark.parametrize(("concurrency", "expected"), [(None, 4), (2, 2), (1, 1)])
def test_requests_in_flight_are_bounded_by_concurrency(concurrency, expected):
    with fake_server(hold_for=expected, expected=4) as (server, url):
        wall, results = loadgen.run(url, "lmserve", planned(4), None, concurrency)
    assert server.max_in_flight == expected
    assert all(r.error is None for r in results)
    assert [r.output_tokens for r in results] == [r.output_tokens_requested for r in results]
    assert wall >= max(r.sent_at + r.latency for r in results) > 0


def test_one_at_a_time_sends_each_request_after_the_previous_one_ended():
    with fake_server(hold_for=1) as (_, url):
        _, results = loadgen.run(url, "lmserve", planned(4), None, concurrency=1)
    for before, after in zip(results, results[1:]):
        assert after.sent_at >= before.sent_at + before.latency


def test_arrival_is_described_in_the_title():
    assert describe_arrival(None, None) == "burst"
    assert describe_arrival(4.0, None) == "Poisson 4.0/s"
    assert describe_arrival(None, 1) == "one at a time"
    assert describe_arrival(4.0, 8) == "Poisson 4.0/s, 8 at a time"


class _OpenAIHandler(BaseHTTPRequestHandler):
    """One SSE token and the usage chunk; records each request's body."""

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.bodies.append((self.path, body))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for chunk in (
            {"choices": [{"text": "a"}]},
            {"choices": [], "usage": {"completion_tokens": 1}},
        ):
            self.wfile.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        self.wfile.write(b"data: [DONE]\n\n")

    def log_message(self, *args) -> None:
        pass


@contextmanager
def fake_openai_server():
    """A server answering every completion with one token; `.bodies` records the requests."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _OpenAIHandler)
    server.bodies = []
    thread = threading.Thread(target=server.serve_forever, args=(0.01,), daemon=True)
    thread.start()
    try:
        yield server, f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_openai_requests_carry_the_extra_fields_a_peer_server_needs():
    """llama.cpp's server ignores ignore_eos: its runs send a logit_bias against EOS."""
    with fake_openai_server() as (server, url):
        extra = {"logit_bias": {"2": -100.0}}
        _, results = loadgen.run(url, "openai", planned(2), "m", 1, openai_extra=extra)
    assert [r.output_tokens for r in results] == [1, 1] and not any(r.error for r in results)
    for path, body in server.bodies:
        assert path == "/v1/completions"
        assert body["logit_bias"] == {"2": -100.0} and body["ignore_eos"] is True


def test_requests_spread_over_adapters_name_them_in_either_api():
    """`--adapters a,b`: requests take the adapters in turn, as LMI's `adapters` field or as
    OpenAI's `model`."""
    from lmserve.benchmarks.workload import spread_over_adapters

    spread = spread_over_adapters(planned(3), ["a", "b"])
    assert [p.adapter for p in spread] == ["a", "b", "a"]
    assert spread_over_adapters(planned(2), []) == planned(2)
    with fake_openai_server() as (server, url):
        loadgen.run(url, "openai", spread, "base", 1)
    assert [body["model"] for _, body in server.bodies] == ["a", "b", "a"]
    with fake_server(hold_for=1) as (lmi_server, url):
        loadgen.run(url, "lmserve", spread[:2], None, 1)
    assert [body.get("adapters") for body in lmi_server.bodies] == ["a", "b"]
