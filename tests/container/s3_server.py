"""A real S3-compatible HTTP server for tests: moto's standalone server as a subprocess.

`s3_server` (session) starts `moto_server` on a free loopback port and stops it at teardown;
`s3` (per test) empties it, points boto3 at it through the environment (AWS_ENDPOINT_URL and
dummy credentials, exactly how the product is configured) and returns a client for setting up
buckets. Tests talk to it over HTTP only; no in-process mocking.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import requests

from ..servers import alive, free_port

MOTO_SERVER = Path(sys.executable).with_name("moto_server")
CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "test",
    "AWS_SECRET_ACCESS_KEY": "test",
    "AWS_DEFAULT_REGION": "us-east-1",
}
# Anything on the machine that could send boto3 elsewhere or change how it signs.
_UNSET = (
    "AWS_PROFILE",
    "AWS_SESSION_TOKEN",
    "AWS_SECURITY_TOKEN",
    "AWS_REGION",
    "AWS_ENDPOINT_URL_S3",
    "AWS_S3_ADDRESSING_STYLE",
)


@dataclass
class S3Server:
    url: str
    process: subprocess.Popen
    log_path: Path

    def env(self) -> dict[str, str]:
        """What a process needs to reach this server with boto3's default configuration."""
        return {**CREDENTIALS, "AWS_ENDPOINT_URL": self.url}

    def reset(self) -> None:
        """Forgets every bucket and object (moto's own reset endpoint)."""
        requests.post(f"{self.url}/moto-api/reset", timeout=10).raise_for_status()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]


def start_s3_server(log_path: Path, timeout: float = 120.0) -> S3Server:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = open(log_path, "wb")
    process = subprocess.Popen(
        [str(MOTO_SERVER), "-H", "127.0.0.1", "-p", str(port)],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    log.close()  # the child holds its own copy
    server = S3Server(url, process, log_path)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"moto_server exited early:\n{server.log()}")
        try:
            if requests.get(f"{url}/moto-api/data.json", timeout=10).status_code == 200:
                return server
        except (requests.ConnectionError, requests.Timeout):
            pass  # not listening yet, or still starting on a busy machine
        time.sleep(0.1)
    stop_s3_server(server)
    raise AssertionError(f"moto_server not answering after {timeout} s:\n{server.log()}")


def stop_s3_server(server: S3Server) -> None:
    if server.process.poll() is None:
        server.process.terminate()
        try:
            server.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            server.process.kill()
            server.process.wait(timeout=10)
    assert not alive(server.process.pid), "moto_server left running"


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    server = start_s3_server(tmp_path_factory.mktemp("moto") / "moto_server.log")
    try:
        yield server
    finally:
        stop_s3_server(server)


@pytest.fixture
def s3(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    """A boto3 S3 client on an empty server; the environment points boto3 at that server, so
    code under test that calls plain `boto3.client("s3")` reaches it too."""
    import boto3

    s3_server.reset()
    for name in _UNSET:
        monkeypatch.delenv(name, raising=False)
    # No ~/.aws files on this machine may add profiles, endpoints or credentials.
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials"))
    for name, value in s3_server.env().items():
        monkeypatch.setenv(name, value)
    client = boto3.client("s3")  # no endpoint_url: proves boto3 honours AWS_ENDPOINT_URL
    assert client.meta.endpoint_url == s3_server.url
    return client


def upload_folder(client, folder: Path, bucket: str, prefix: str) -> dict[str, bytes]:
    """Uploads every file below `folder` under `prefix/`; returns relative path -> content."""
    uploaded = {}
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        relative = path.relative_to(folder).as_posix()
        client.upload_file(str(path), bucket, f"{prefix}/{relative}")
        uploaded[relative] = path.read_bytes()
    return uploaded


def folder_contents(folder: Path) -> dict[str, bytes]:
    return {
        p.relative_to(folder).as_posix(): p.read_bytes() for p in folder.rglob("*") if p.is_file()
    }
