"""A dead MPI rank during generation: every in-flight client gets an error answer within
seconds; by default the server then exits non-zero, with option.restart_engine_on_failure it
brings the engine back and serves again."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import requests

from ..servers import Server, descendants, write_properties

LONG = {"inputs": "Hello", "parameters": {"max_new_tokens": 3000, "ignore_eos_token": True}}


def rank_pid(server: Server, rank: int) -> int:
    for pid in descendants(server.process.pid):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"lmserve.rolling_batch.worker" in cmdline and f"PMI_RANK={rank}".encode() in environ:
            return pid
    raise AssertionError(f"rank {rank} not found")


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


def kill_rank_one_under_load(server: Server) -> tuple[list[requests.Response], float]:
    answers: list[requests.Response] = []

    def ask():
        answers.append(requests.post(f"{server.url}/invocations", json=LONG, timeout=60))

    clients = [threading.Thread(target=ask) for _ in range(3)]
    for client in clients:
        client.start()
    time.sleep(1.5)  # the requests are running in the engine now
    os.kill(rank_pid(server, 1), signal.SIGKILL)
    killed_at = time.monotonic()
    for client in clients:
        client.join(timeout=20)
    return answers, time.monotonic() - killed_at


def test_dead_rank_answers_everyone_and_the_server_exits(tmp_path, tiny_model_dir):
    server = start(tmp_path, tiny_model_dir)
    streamed: list[dict] = []

    def stream():
        body = {**LONG, "stream": True}
        with requests.post(f"{server.url}/invocations", json=body, stream=True, timeout=60) as r:
            streamed.extend(json.loads(line) for line in r.iter_lines() if line)

    streaming_client = threading.Thread(target=stream)
    streaming_client.start()
    answers, waited = kill_rank_one_under_load(server)
    streaming_client.join(timeout=20)
    # The stream had begun: its answer is a last line carrying the error.
    assert streamed and "token" in streamed[0]
    assert streamed[-1]["code"] == 503 and "engine" in streamed[-1]["error"]
    assert len(answers) == 3, "a client got no answer"
    assert waited < 10
    assert all(a.status_code == 503 and "engine" in a.json()["message"] for a in answers)
    assert requests.get(f"{server.url}/ping", timeout=5).status_code == 500
    assert server.process.wait(timeout=30) == 1
    assert server.stop() == 1


def test_restart_policy_brings_the_engine_back(tmp_path, tiny_model_dir):
    server = start(tmp_path, tiny_model_dir, **{"option.restart_engine_on_failure": "true"})
    try:
        answers, waited = kill_rank_one_under_load(server)
        assert len(answers) == 3 and waited < 10
        assert all(a.status_code == 503 for a in answers)
        server.wait_healthy(timeout=60)
        again = requests.post(
            f"{server.url}/invocations",
            json={"inputs": "Hello", "parameters": {"max_new_tokens": 5}},
            timeout=60,
        )
        assert again.status_code == 200, again.text
    finally:
        assert server.stop() == 0
