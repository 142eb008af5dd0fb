"""The API document (`GET /openapi.json`) against the real server, fuzzed by schemathesis: it
generates requests from the document, valid and invalid, and checks every answer: no server
error (5xx) other than the documented ones, status codes and content types the document
lists, bodies that match its schemas (the document checked against the real responses), and
schema-violating requests refused. Bounded: a few examples per operation, deterministic."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from ..servers import Server, write_properties

CHECKS = (
    "not_a_server_error",
    "status_code_conformance",
    "content_type_conformance",
    "response_schema_conformance",
    "negative_data_rejection",
)


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    properties = {"option.model_id": tiny_model_dir, "option.max_model_len": 512}
    server = Server(write_properties(tmp_path_factory.mktemp("fuzz") / "model", properties))
    server.wait_healthy()
    yield server
    assert server.stop() == 0


def test_schemathesis_finds_nothing(server, tmp_path):
    st = Path(sys.executable).with_name("st")  # the venv's, whatever PATH says
    command = [
        str(st), "run", f"{server.url}/openapi.json", "--checks", ",".join(CHECKS),
        "--max-examples", "10", "--generation-deterministic", "--request-timeout", "60",
        "--no-color",
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-8000:] + result.stderr[-2000:]
    assert "Operations:       17 selected / 17 total" in result.stdout  # every route, fuzzed
