"""Starts a real `lmserve serve` (supervisor, engine process, gunicorn) on a free loopback port,
and finds the processes it started, for tests that check nothing is left behind.

Tests here never rest on the machine's speed: they wait for what they can observe (with a
deadline that only guards against a hang), size a generation from the step time they measure,
and make a process as slow as they need by stopping it (`stopped`)."""

from __future__ import annotations

import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

import requests

from lmserve.rolling_batch.ipc import protocol
from lmserve.rolling_batch.ipc.runtime import STATE_FILE

from .conftest import TEST_CACHE_DIR


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def write_properties(folder: Path, properties: dict[str, object]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    lines = [f"{key}={value}" for key, value in properties.items()]
    (folder / "serving.properties").write_text("\n".join(lines) + "\n")
    return folder


def descendants(pid: int) -> set[int]:
    """All live processes below `pid` (read from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(entry.name))
    found: set[int] = set()
    stack = [pid]
    while stack:
        for child in children.get(stack.pop(), []):
            found.add(child)
            stack.append(child)
    return found


def command_line(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def process_state(pid: int) -> str:
    """The kernel's one-letter state of `pid` ("" when it is gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return ""


T = TypeVar("T")


def wait_until(
    condition: Callable[[], T], what: str, timeout: float = 60.0, interval: float = 0.02
) -> T:
    """Polls `condition` every `interval` s until it returns something true, and returns that.
    `timeout` only guards against a hang: nothing a test asserts rests on how soon it holds."""
    deadline = time.monotonic() + timeout
    while True:
        found = condition()
        if found:
            return found
        assert time.monotonic() < deadline, f"not within {timeout:.0f} s: {what}"
        time.sleep(interval)


@contextmanager
def stopped(pid: int) -> Iterator[None]:
    """`pid` stopped (SIGSTOP) for the block, the way a stalled host would leave it: from the
    first line of the block it runs no instruction (the kernel says so); it goes on after."""
    os.kill(pid, signal.SIGSTOP)
    try:
        wait_until(lambda: process_state(pid) in ("T", "t", "Z", ""), f"process {pid} stopped")
        yield
    finally:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass


class Server:
    def __init__(self, model_dir: Path, env: dict[str, str] | None = None, log_path: Path = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._ipc_dir: Path | None = None
        # Beside the model dir, never in it: a model dir holding files but no model is refused.
        self.log_path = log_path or model_dir.with_name(f"{model_dir.name}-server.log")
        full_env = {**os.environ, "LMSERVE_CACHE_DIR": str(TEST_CACHE_DIR), **(env or {})}
        self._log = open(self.log_path, "wb")
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "lmserve.container.cli",
                "serve",
                "--model-dir",
                str(model_dir),
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
            ],
            env=full_env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )

    def wait_healthy(self, timeout: float = 180.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise AssertionError(f"server exited early:\n{self.log()}")
            try:
                if requests.get(f"{self.url}/ping", timeout=2).status_code == 200:
                    return
            except (requests.ConnectionError, requests.Timeout):
                pass  # not listening yet, or its web workers still booting on a busy machine
            time.sleep(0.3)
        raise AssertionError(f"server not healthy after {timeout} s:\n{self.log()}")

    def engine_pid(self) -> int:
        for pid in descendants(self.process.pid):
            if "lmserve.handlers.python_engine.process" in command_line(pid):
                return pid
        raise AssertionError("no engine process found")

    def rank_pid(self, rank: int) -> int:
        """The process of MPI rank `rank` of the rolling engine."""
        for pid in descendants(self.process.pid):
            try:
                environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            ranked = f"PMI_RANK={rank}".encode() in environ
            if b"lmserve.rolling_batch.engine.process" in cmdline and ranked:
                return pid
        raise AssertionError(f"rank {rank} not found")

    def ipc_dir(self) -> Path:
        """The server's private IPC directory (runtime.json, the engine's state file, its
        socket), named in the HTTP server's command line."""
        if self._ipc_dir is None:
            for pid in descendants(self.process.pid):
                found = re.search(r"create_app\('(.+)'\)", command_line(pid))
                if found:
                    self._ipc_dir = Path(found.group(1)).parent
                    break
            else:
                raise AssertionError("no HTTP server found")
        return self._ipc_dir

    def engine_state(self) -> str:
        """The state the supervisor and the engine write for the front end (loading, ready,
        failed): read at once, without waiting for the front end."""
        try:
            return json.loads((self.ipc_dir() / STATE_FILE).read_text())["state"]
        except (FileNotFoundError, json.JSONDecodeError):
            return protocol.EngineState.LOADING

    @contextmanager
    def supervisor_stopped(self) -> Iterator[None]:
        """The supervisor (`lmserve serve` itself) stopped for the block, once it has started the
        HTTP server, which goes on answering: what the supervisor would do next waits (mark a
        slow load failed; end the server FAILED_GRACE_S after a failure, or restart the
        engine). A test that must see a state the server keeps only for a grace period looks
        at it in here, however slowly the front end started or answers."""
        wait_until(
            lambda: (
                self.process.poll() is not None
                or any("gunicorn" in command_line(pid) for pid in descendants(self.process.pid))
            ),
            "the supervisor started the HTTP server",
        )
        assert self.process.poll() is None, f"server exited early:\n{self.log()}"
        with stopped(self.process.pid):
            yield

    def ping_status(self) -> int | None:
        """/ping's status code; None while nothing answers."""
        try:
            return requests.get(f"{self.url}/ping", timeout=10).status_code
        except (requests.ConnectionError, requests.Timeout):
            return None

    def engine_stats(self) -> dict:
        """The engine's stats from /models/<name>: fresh, or the newest the front end has
        while the engine is busy (waits while it has none, as while the engine loads)."""
        name = requests.get(f"{self.url}/models", timeout=30).json()["models"][0]["modelName"]

        def stats() -> dict | None:
            model = requests.get(f"{self.url}/models/{name}", timeout=30).json()
            return model["engine"]["stats"]

        return wait_until(stats, "the engine's stats")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-6000:]

    def stop(self, signum: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        """Stops the server with `signum`; returns its exit code after checking that every
        process it had started is gone."""
        started = descendants(self.process.pid)
        if self.process.poll() is None:
            self.process.send_signal(signum)
        code = self.process.wait(timeout=timeout)
        self._log.close()
        leftovers = [pid for pid in started if alive(pid)]
        assert not leftovers, f"processes left behind: {[command_line(p) for p in leftovers]}"
        return code


def decode_step_seconds(server: Server, probe_tokens: int = 200) -> float:
    """This machine's time per decode step for one request that is not streamed, measured now:
    a short generation's time over its tokens (prefill and HTTP add a little: it errs long)."""
    body = {
        "inputs": "Once upon a time",
        "parameters": {"max_new_tokens": probe_tokens, "ignore_eos_token": True},
    }
    started = time.monotonic()
    answer = requests.post(f"{server.url}/invocations", json=body, timeout=300)
    assert answer.status_code == 200, answer.text
    return (time.monotonic() - started) / probe_tokens


def tokens_lasting(server: Server, seconds: float, limit: int) -> int:
    """How many new tokens one greedy request should ask for to take at least `seconds` here,
    at the step time just measured (a step never gets cheaper as its context grows), at most
    `limit` (what option.max_model_len leaves for them)."""
    step_s = decode_step_seconds(server)
    num_tokens = min(limit, math.ceil(seconds / step_s))
    print(f"probe: {step_s * 1e3:.2f} ms per step: {num_tokens} tokens for {seconds} s")
    return num_tokens
