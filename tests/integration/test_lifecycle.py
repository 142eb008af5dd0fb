"""The server's life: 503 while loading, clean stop on SIGTERM/SIGINT with nothing left behind,
an engine that dies or never loads turns /ping unhealthy, answers waiting clients and ends the
server non-zero, and a bad configuration stops start-up with a message, not a traceback."""

from __future__ import annotations

import os
import shutil
import signal
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import requests

from ..servers import Server, command_line, write_properties


def tiny_folder(tmp_path, tiny_model_dir, **extra):
    properties = {
        "engine": "Python",
        "option.rolling_batch": "disable",
        "option.model_id": tiny_model_dir,
        **extra,
    }
    return write_properties(tmp_path / "model", properties)


def first_answer(server: Server, path: str = "/ping", timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            return requests.get(f"{server.url}{path}", timeout=2)
        except requests.ConnectionError:
            time.sleep(0.05)
    raise AssertionError("server never answered")


def test_ping_is_503_while_loading_then_200(tmp_path, tiny_model_dir):
    server = Server(tiny_folder(tmp_path, tiny_model_dir))
    try:
        loading = first_answer(server)
        assert loading.status_code == 503
        (status,) = loading.json().values()
        assert status["status"] == "PENDING"  # DJL's word for a model still loading
        (listed,) = requests.get(f"{server.url}/models", timeout=5).json()["models"]
        assert listed["status"] in ("PENDING", "READY")  # READY if loading finished meanwhile
        early = requests.post(f"{server.url}/invocations", json={"inputs": "hi"}, timeout=10)
        assert early.status_code in (200, 503)  # 503 unless loading finished meanwhile
        server.wait_healthy()
        healthy = requests.get(f"{server.url}/ping", timeout=5)
        assert healthy.status_code == 200
        assert healthy.json() == {tiny_model_dir.name: {"status": "Healthy"}}
    finally:
        assert server.stop() == 0


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_signal_stops_everything(tmp_path, tiny_model_dir, signum):
    server = Server(tiny_folder(tmp_path, tiny_model_dir))
    server.wait_healthy()
    # The engine's last argument is runtime.json inside the private IPC directory.
    ipc_dir = Path(command_line(server.engine_pid()).split()[-1]).parent
    assert stat.S_IMODE(ipc_dir.stat().st_mode) == 0o700
    assert (ipc_dir / "engine.sock").exists()
    assert server.stop(signum) == 0, server.log()
    assert not ipc_dir.exists()


def test_start_up_log_names_engine_dtype_device_batching_and_source(tmp_path, tiny_model_dir):
    server = Server(
        tiny_folder(
            tmp_path, tiny_model_dir, batch_size=3, max_batch_delay=7, **{"option.dtype": "bf16"}
        )
    )
    server.wait_healthy()
    assert server.stop() == 0
    log = server.log()
    for fragment in (
        "engine=Python",
        "dtype=bfloat16",
        "device=cpu",
        "batch_size=3",
        "max_batch_delay=7 ms",
        f"from {tiny_model_dir}",
    ):
        assert fragment in log, fragment


def test_engine_death_answers_waiting_clients_and_exits_nonzero(tmp_path, tiny_model_dir):
    server = Server(tiny_folder(tmp_path, tiny_model_dir))
    server.wait_healthy()
    answers: list[requests.Response] = []
    long_request = {
        "inputs": "Hello",
        "parameters": {"max_new_tokens": 4000, "ignore_eos_token": True},
    }

    def ask():
        answers.append(requests.post(f"{server.url}/invocations", json=long_request, timeout=60))

    client = threading.Thread(target=ask)
    client.start()
    time.sleep(1.0)  # the request is inside the engine now
    os.kill(server.engine_pid(), signal.SIGKILL)
    killed_at = time.monotonic()
    client.join(timeout=15)
    assert answers, "the waiting client got no answer"
    assert time.monotonic() - killed_at < 10
    assert answers[0].status_code == 503
    assert "engine" in answers[0].json()["message"]
    ping = requests.get(f"{server.url}/ping", timeout=5)
    assert ping.status_code == 500
    assert server.process.wait(timeout=30) == 1
    assert server.stop() == 1


def test_model_loading_timeout_fails_the_server(tmp_path, tiny_model_dir):
    # Importing torch alone takes longer than a second.
    server = Server(tiny_folder(tmp_path, tiny_model_dir, **{"option.model_loading_timeout": 1}))
    deadline = time.monotonic() + 20
    statuses = set()
    while time.monotonic() < deadline and server.process.poll() is None:
        try:
            statuses.add(requests.get(f"{server.url}/ping", timeout=2).status_code)
        except requests.ConnectionError:
            pass
        time.sleep(0.1)
    assert 500 in statuses
    assert server.stop() == 1
    assert "model_loading_timeout" in server.log()


def test_bad_configuration_stops_start_up_with_every_problem_named(tmp_path):
    folder = write_properties(
        tmp_path / "model",
        {"engine": "Rust", "batch_size": "four", "option.dtype": "int3"},
    )
    result = subprocess.run(
        [sys.executable, "-m", "lmserve.container.cli", "serve", "--model-dir", str(folder)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    for fragment in ("engine='Rust'", "batch_size='four'", "option.dtype='int3'", "fp32"):
        assert fragment in result.stderr
    assert "Traceback" not in result.stderr


def test_a_model_that_fails_to_load_says_why(tmp_path, tiny_model_dir):
    broken = tmp_path / "broken"
    shutil.copytree(tiny_model_dir, broken)
    (broken / "model.safetensors").write_bytes(b"not a safetensors file")
    server = Server(tiny_folder(tmp_path, broken))
    reasons, statuses, descriptions = [], set(), 0
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and server.process.poll() is None:
        try:
            ping = requests.get(f"{server.url}/ping", timeout=2)
            if ping.status_code == 500:
                reasons.append(ping.json()[broken.name]["reason"])
                statuses.add(ping.json()[broken.name]["status"])
                described = requests.get(f"{server.url}/models/{broken.name}", timeout=2)
                statuses.add(described.json()["status"])
                descriptions += 1
        except (requests.ConnectionError, requests.Timeout):
            pass  # not up yet, or going away: a request caught in its shutdown gets no answer
        time.sleep(0.1)
    assert server.stop() == 1
    assert reasons and "model failed to load" in reasons[0]
    assert descriptions > 0
    assert statuses == {"FAILED"}  # DJL's word, on /ping and /models/<name> alike
