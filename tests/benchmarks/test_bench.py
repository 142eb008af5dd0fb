"""`lmserve bench` against live servers on a tiny workload: the JSON's numbers are consistent
(every token requested was counted, latencies positive, TTFT before the end, no errors), the
table and PNG plots are written; once against a running URL in a burst, once starting its own
server from a serving.properties with Poisson arrivals."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from ..conftest import TEST_CACHE_DIR
from ..servers import Server, write_properties

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def bench(*args: str, out) -> dict:
    command = [sys.executable, "-m", "lmserve.container.cli", "bench", "--out", str(out), *args]
    env = {**os.environ, "LMSERVE_CACHE_DIR": str(TEST_CACHE_DIR)}
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "| config |" in result.stdout
    return json.loads((out / "results.json").read_text())


def check_consistent(run: dict, num_requests: int) -> None:
    summary, requests_ = run["summary"], run["requests"]
    assert summary["errors"] == 0 and summary["num_requests"] == num_requests
    assert len(requests_) == num_requests
    for request in requests_:
        assert request["error"] is None
        assert request["output_tokens"] == request["output_tokens_requested"]
        assert 0 < request["ttft"] <= request["latency"]
    assert summary["tokens_generated"] == summary["tokens_requested"]
    assert summary["tokens_requested"] == sum(r["output_tokens_requested"] for r in requests_)
    assert summary["throughput_tokens_per_s"] > 0
    for q in (50, 90, 99):
        assert summary[f"latency_p{q}_s"] > 0
    assert summary["latency_p50_s"] <= summary["latency_p90_s"] <= summary["latency_p99_s"]


def test_bench_against_a_running_server(tmp_path, tiny_model_dir):
    folder = write_properties(
        tmp_path / "model",
        {"engine": "MPI", "option.model_id": tiny_model_dir, "option.max_model_len": 256},
    )
    server = Server(folder)
    server.wait_healthy()
    try:
        out = tmp_path / "out"
        results = bench(
            "--url",
            server.url,
            "--label",
            "tiny",
            "--tokenizer",
            str(tiny_model_dir),
            "--num-requests",
            "6",
            "--input-len",
            "uniform:4:20",
            "--output-len",
            "uniform:2:9",
            out=out,
        )
    finally:
        assert server.stop() == 0
    check_consistent(results["tiny"], 6)
    assert {r["input_tokens"] for r in results["tiny"]["requests"]} != {4}
    assert all(r["sent_at"] < 1.0 for r in results["tiny"]["requests"])  # one burst
    for name in ("latency_cdf.png", "throughput.png"):
        assert (out / name).read_bytes()[:8] == PNG_MAGIC
    assert "| tiny | 6 | 0 |" in (out / "results.md").read_text()


def test_bench_starts_its_own_server_with_poisson_arrivals(tmp_path, tiny_model_dir):
    properties = tmp_path / "rolling.properties"
    properties.write_text(
        f"engine=MPI\noption.model_id={tiny_model_dir}\noption.max_model_len=128\n"
    )
    out = tmp_path / "out"
    results = bench(
        "--config",
        f"rolling={properties}",
        "--tokenizer",
        str(tiny_model_dir),
        "--num-requests",
        "5",
        "--input-len",
        "8",
        "--output-len",
        "4",
        "--qps",
        "5",
        out=out,
    )
    run = results["rolling"]
    check_consistent(run, 5)
    sent = [r["sent_at"] for r in run["requests"]]
    assert sent == sorted(sent) and sent[-1] > sent[0]  # spread out, in order
    assert all(r["input_tokens"] == 8 for r in run["requests"])
