"""The server's life: 503 while loading, clean stop on SIGTERM/SIGINT with nothing left behind,
an engine that dies or never loads turns /ping unhealthy, answers waiting clients and ends the
server non-zero, and a bad configuration stops start-up with a message, not a traceback.

None of it rests on the machine's speed. A model that must still be loading, or a request that
must still be running, is a model.py that loads when the test says and a request that never
ends (GATED_HANDLER). A state the server keeps only for a grace period before it exits (failed)
is looked at with the supervisor stopped (Server.supervisor_stopped), however slowly the front
end started."""

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

from ..servers import Server, command_line, wait_until, write_properties

# A DJL model.py that loads only once the file named by option.load_gate exists, and whose
# request {"hold": true} never ends: it makes the file named by option.inside and waits.
GATED_HANDLER = """
import os
import time
from pathlib import Path

from djl_python import Input, Output

options = {}


def handle(inputs: Input) -> Output | None:
    if inputs.is_empty():  # DJL's load-time call, with the model's options
        options.update(inputs.get_properties())
        while not os.path.exists(options["load_gate"]):
            time.sleep(0.02)
        return None
    if inputs.get_batches()[0].get_as_json().get("hold"):
        Path(options["inside"]).touch()
        while True:
            time.sleep(1)
    return Output().add_as_json({"loaded": True})
"""


def tiny_folder(tmp_path, tiny_model_dir, **extra):
    properties = {
        "engine": "Python",
        "option.rolling_batch": "disable",
        "option.model_id": tiny_model_dir,
        **extra,
    }
    return write_properties(tmp_path / "model", properties)


def gated_folder(tmp_path, loaded: bool, **extra) -> tuple[Path, Path, Path]:
    """(a model dir of GATED_HANDLER, its load gate, the file its held request makes); the gate
    is open from the start when `loaded`."""
    folder, gate, inside = tmp_path / "gated", tmp_path / "load-gate", tmp_path / "inside"
    folder.mkdir()
    (folder / "model.py").write_text(GATED_HANDLER)
    properties = {"engine": "Python", "option.load_gate": gate, "option.inside": inside}
    write_properties(folder, {**properties, **extra})
    if loaded:
        gate.touch()
    return folder, gate, inside


def first_answer(server: Server, path: str = "/ping", timeout: float = 120.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            return requests.get(f"{server.url}{path}", timeout=10)
        except (requests.ConnectionError, requests.Timeout):
            time.sleep(0.05)
    raise AssertionError("server never answered")


def ping_if(server: Server, status: int) -> dict | None:
    """/ping's body if it comes with `status`."""
    try:
        answer = requests.get(f"{server.url}/ping", timeout=10)
    except (requests.ConnectionError, requests.Timeout):
        return None
    return answer.json() if answer.status_code == status else None


def test_ping_is_503_while_loading_then_200(tmp_path):
    folder, gate, _ = gated_folder(tmp_path, loaded=False)
    server = Server(folder)
    try:
        loading = first_answer(server)  # the model cannot have loaded: its gate is shut
        assert loading.status_code == 503
        ((name, status),) = loading.json().items()
        assert status["status"] == "PENDING"  # DJL's word for a model still loading
        (listed,) = requests.get(f"{server.url}/models", timeout=30).json()["models"]
        assert (listed["modelName"], listed["status"]) == (name, "PENDING")
        early = requests.post(f"{server.url}/invocations", json={"inputs": "hi"}, timeout=30)
        assert early.status_code == 503
        gate.touch()
        server.wait_healthy()
        healthy = requests.get(f"{server.url}/ping", timeout=30)
        assert healthy.status_code == 200
        assert healthy.json() == {name: {"status": "Healthy"}}
        assert requests.post(f"{server.url}/invocations", json={}, timeout=30).json() == {
            "loaded": True
        }
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


def test_engine_death_answers_waiting_clients_and_exits_nonzero(tmp_path):
    folder, _, inside = gated_folder(tmp_path, loaded=True)
    server = Server(folder)
    server.wait_healthy()
    answers: list[requests.Response] = []

    def ask():
        answers.append(requests.post(f"{server.url}/invocations", json={"hold": True}, timeout=120))

    client = threading.Thread(target=ask)
    client.start()
    wait_until(inside.exists, "the request inside the engine")  # where it stays
    server.ipc_dir()  # found while the server runs
    os.kill(server.engine_pid(), signal.SIGKILL)
    killed_at = time.monotonic()
    # Looked at the moment it is written: the supervisor keeps it only a grace period.
    wait_until(lambda: server.engine_state() == "failed", "engine marked failed", interval=0.001)
    with server.supervisor_stopped():
        client.join(timeout=120)
        assert answers, "the waiting client got no answer"
        # Answered by the failure, in seconds (option.predict_timeout, 120 s, would be a 424).
        assert time.monotonic() - killed_at < 60
        assert answers[0].status_code == 503
        assert "engine" in answers[0].json()["message"]
        ping = requests.get(f"{server.url}/ping", timeout=30)
        assert ping.status_code == 500
    assert server.process.wait(timeout=60) == 1
    assert server.stop() == 1


def test_model_loading_timeout_fails_the_server(tmp_path):
    # The model never loads: its gate stays shut.
    folder, _, _ = gated_folder(tmp_path, loaded=False, **{"option.model_loading_timeout": 1})
    server = Server(folder)
    with server.supervisor_stopped():  # the front end answers before the load may time out
        wait_until(server.ping_status, "the front end answering", timeout=120)
    # Looked at the moment it is written: the supervisor keeps it only a grace period.
    wait_until(lambda: server.engine_state() == "failed", "load timed out", interval=0.001)
    with server.supervisor_stopped():
        ping = requests.get(f"{server.url}/ping", timeout=30)
        assert ping.status_code == 500
        (status,) = ping.json().values()
        assert "option.model_loading_timeout" in status["reason"]
    assert server.process.wait(timeout=60) == 1
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
    # The engine marks itself failed; the supervisor, stopped, cannot end the server meanwhile.
    with server.supervisor_stopped():
        ping = wait_until(lambda: ping_if(server, 500), "/ping saying it failed", timeout=180)
        described = requests.get(f"{server.url}/models/{broken.name}", timeout=30).json()
    assert server.process.wait(timeout=60) == 1
    assert server.stop() == 1
    assert "model failed to load" in ping[broken.name]["reason"]
    # DJL's word, on /ping and /models/<name> alike
    assert ping[broken.name]["status"] == described["status"] == "FAILED"
