"""A dead MPI rank during generation: every in-flight client gets an error answer within
seconds; by default the server then exits non-zero, with option.restart_engine_on_failure it
brings the engine back and serves again.

No step of it rests on the machine's speed: rank 1 dies once the engine runs every request
(seen in its stats), each far too long to end first, and the supervisor is held (stopped) from
when it has marked the engine failed until every client has its answer, so the grace period in
which the front end answers them cannot run out on a slow or busy machine."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from contextlib import contextmanager

import requests

from ..servers import Server, wait_until, write_properties

# As long as option.max_model_len allows: the rank dies long before any of them could end.
LONG = {"inputs": "Hello", "parameters": {"max_new_tokens": 4000, "ignore_eos_token": True}}
NUM_CLIENTS = 3


def rank_pid(server: Server, rank: int) -> int:
    return server.rank_pid(rank)


def start(tmp_path, tiny_model_dir, **extra) -> Server:
    properties = {
        "engine": "MPI",
        "option.tensor_parallel_degree": 2,
        "option.model_id": tiny_model_dir,
        "option.max_model_len": 4096,
        **extra,
    }
    server = Server(write_properties(tmp_path / "model", properties))
    server.wait_healthy()
    return server


def running(server: Server) -> int:
    return server.engine_stats()["num_running"]


@contextmanager
def rank_one_killed_under_load(server: Server, also_running: int = 0, hold: bool = False):
    """Starts NUM_CLIENTS long requests; once the engine runs them all (and `also_running`
    others), kills rank 1. Yields (the answers, filled in as they come; the time of the kill;
    the client threads) while the clients wait. With `hold`, the supervisor is stopped from
    when the engine is marked failed until the block ends: what it does next (end the server,
    restart the engine) waits for the test, which sees the clients answered and /ping
    unhealthy meanwhile."""
    answers: list[requests.Response] = []

    def ask():
        answers.append(requests.post(f"{server.url}/invocations", json=LONG, timeout=120))

    clients = [threading.Thread(target=ask) for _ in range(NUM_CLIENTS)]
    for client in clients:
        client.start()
    expected = NUM_CLIENTS + also_running
    wait_until(lambda: running(server) == expected, f"{expected} requests running")
    server.ipc_dir()  # found while the engine runs
    os.kill(server.rank_pid(1), signal.SIGKILL)
    killed_at = time.monotonic()
    if hold:
        # Looked at the moment it is written: the supervisor keeps it only a grace period.
        wait_until(
            lambda: server.engine_state() == "failed", "the engine marked failed", interval=0.001
        )
        with server.supervisor_stopped():
            yield answers, killed_at, clients
    else:
        yield answers, killed_at, clients


def kill_rank_one_under_load(server: Server) -> tuple[list[requests.Response], float]:
    """(the answers of NUM_CLIENTS clients whose requests ran when rank 1 died, seconds from the
    kill to the last of them)."""
    with rank_one_killed_under_load(server) as (answers, killed_at, clients):
        for client in clients:
            client.join(timeout=120)
        return answers, time.monotonic() - killed_at


def collect(answers, killed_at, clients) -> float:
    for client in clients:
        client.join(timeout=120)
    assert len(answers) == NUM_CLIENTS, "a client got no answer"
    return time.monotonic() - killed_at


def test_dead_rank_answers_everyone_and_the_server_exits(tmp_path, tiny_model_dir):
    server = start(tmp_path, tiny_model_dir)
    streamed: list[dict] = []
    stream_began = threading.Event()

    def stream():
        body = {**LONG, "stream": True}
        with requests.post(f"{server.url}/invocations", json=body, stream=True, timeout=120) as r:
            for line in r.iter_lines():
                if line:
                    streamed.append(json.loads(line))
                    stream_began.set()

    streaming_client = threading.Thread(target=stream)
    streaming_client.start()
    assert stream_began.wait(60), "the stream never began"
    with rank_one_killed_under_load(server, also_running=1, hold=True) as under_load:
        waited = collect(*under_load)
        streaming_client.join(timeout=120)
        assert requests.get(f"{server.url}/ping", timeout=10).status_code == 500
    answers = under_load[0]
    # The stream had begun: its answer is a last line carrying the error.
    assert "token" in streamed[0]
    assert streamed[-1]["code"] == 503 and "engine" in streamed[-1]["error"]
    # Answered by the failure, in seconds (option.predict_timeout, 120 s, would be a 424).
    assert all(a.status_code == 503 and "engine" in a.json()["message"] for a in answers)
    assert waited < 60
    assert server.process.wait(timeout=60) == 1
    assert server.stop() == 1


def test_restart_policy_brings_the_engine_back(tmp_path, tiny_model_dir):
    server = start(tmp_path, tiny_model_dir, **{"option.restart_engine_on_failure": "true"})
    try:
        with rank_one_killed_under_load(server, hold=True) as under_load:
            waited = collect(*under_load)
        assert all(a.status_code == 503 for a in under_load[0]) and waited < 60
        server.wait_healthy()
        again = requests.post(
            f"{server.url}/invocations",
            json={"inputs": "Hello", "parameters": {"max_new_tokens": 5}},
            timeout=60,
        )
        assert again.status_code == 200, again.text
    finally:
        assert server.stop() == 0
