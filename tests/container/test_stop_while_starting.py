"""`docker stop` while the model is still resolving: lmserve runs as PID 1 in the image, where
a signal without a handler is ignored, so SIGTERM must end start-up itself, at once and
cleanly, not wait for docker's SIGKILL. The S3 "endpoint" here accepts the download's
connection and never answers: the server is provably inside the download when it is stopped."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

from ..servers import free_port, write_properties


def test_sigterm_during_the_model_download_ends_start_up_cleanly(tmp_path: Path):
    endpoint = socket.socket()
    endpoint.bind(("127.0.0.1", 0))
    endpoint.listen()
    endpoint.settimeout(120)  # a hang guard only
    folder = write_properties(tmp_path / "model", {"option.model_id": "s3://bucket/model"})
    env = {
        **os.environ,
        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{endpoint.getsockname()[1]}",
        "AWS_ACCESS_KEY_ID": "test",
        "AWS_SECRET_ACCESS_KEY": "test",
        "AWS_DEFAULT_REGION": "us-east-1",
        "LMSERVE_CACHE_DIR": str(tmp_path / "cache"),
    }
    command = [sys.executable, "-m", "lmserve.container.cli", "serve", "--model-dir", str(folder)]
    server = subprocess.Popen(
        [*command, "--host", "127.0.0.1", "--port", str(free_port())],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        connection, _ = endpoint.accept()  # the download has begun, and now waits for us
        server.send_signal(signal.SIGTERM)
        output, _ = server.communicate(timeout=60)
    finally:
        server.kill()
        endpoint.close()
    assert server.returncode == 0, output
    assert "stopped (signal 15) before the server started" in output
    connection.close()
