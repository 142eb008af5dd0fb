"""The soak, short: a few hundred requests of every kind (plain, streamed, dropped mid-stream,
chat, sampled, list, completions, malformed) at concurrency 32 against a real server on the
rolling batch, through `lmserve bench --soak`: every request answered well, and the engine
idle, healthy and holding no KV block right after."""

from __future__ import annotations

import os
import subprocess
import sys

from ..conftest import TEST_CACHE_DIR
from ..servers import Server, write_properties


def test_short_soak_loses_nothing_and_leaves_the_engine_idle(tiny_model_dir, tmp_path):
    properties = {"option.model_id": tiny_model_dir, "option.max_rolling_batch_size": 16}
    server = Server(write_properties(tmp_path / "soak", properties))
    try:
        server.wait_healthy()
        command = [
            sys.executable, "-m", "lmserve.container.cli", "bench", "--soak", "--url", server.url,
            "--num-requests", "240", "--concurrency", "32", "--output-len", "24",
            "--tokenizer", str(tiny_model_dir),
        ]  # fmt: skip
        env = {**os.environ, "LMSERVE_CACHE_DIR": str(TEST_CACHE_DIR)}
        result = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
    finally:
        assert server.stop() == 0
    assert result.returncode == 0, result.stdout + result.stderr
    table = result.stdout
    for kind in ("plain", "streamed", "dropped", "chat", "sampled", "list", "completion"):
        assert f"| {kind} |" in table
    assert "running 0, waiting 0, KV blocks in use 0" in table
