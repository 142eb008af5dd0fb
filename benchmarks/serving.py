"""Starting and stopping a real `lmserve serve` for the benchmark scripts."""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import requests

from lmserve.properties.python_command import python_command


@contextmanager
def running_server(properties: dict[str, object], port: int, env: dict[str, str] | None = None):
    """Yields (base URL, seconds from start to a healthy /ping); `env` adds to the server's
    environment."""
    folder = Path(tempfile.mkdtemp())
    lines = [f"{key}={value}" for key, value in properties.items()]
    (folder / "serving.properties").write_text("\n".join(lines) + "\n")
    started = time.monotonic()
    server = subprocess.Popen(
        python_command(
            "-m",
            "lmserve.container.cli",
            "serve",
            "--model-dir",
            str(folder),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
        ),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, **(env or {})},
    )
    url = f"http://127.0.0.1:{port}"
    try:
        if not wait_healthy(server, f"{url}/ping", started + 300):
            raise SystemExit(f"server did not become healthy: {properties}")
        yield url, time.monotonic() - started
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait()


def wait_healthy(server: subprocess.Popen, health_url: str, deadline: float) -> bool:
    """Poll `health_url` until it answers 200 (True), or the server exits or the monotonic
    `deadline` passes (False)."""
    while True:
        try:
            if requests.get(health_url, timeout=1).status_code == 200:
                return True
        except (requests.ConnectionError, requests.Timeout):  # not listening, or busy starting
            pass
        if server.poll() is not None or time.monotonic() > deadline:
            return False
        time.sleep(0.1)
