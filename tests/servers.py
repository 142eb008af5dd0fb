"""Starts a real `lmserve serve` (supervisor, engine process, gunicorn) on a free loopback port,
and finds the processes it started, for tests that check nothing is left behind."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import requests

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


class Server:
    def __init__(self, model_dir: Path, env: dict[str, str] | None = None, log_path: Path = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
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
            except requests.ConnectionError:
                pass
            time.sleep(0.3)
        raise AssertionError(f"server not healthy after {timeout} s:\n{self.log()}")

    def engine_pid(self) -> int:
        for pid in descendants(self.process.pid):
            if "lmserve.handlers.worker" in command_line(pid):
                return pid
        raise AssertionError("no engine process found")

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
