"""A Prometheus scrape under load: with dozens of streaming requests held open, /metrics and
/models/<name> answer with lmserve_up 1 and the engine's real numbers, on the rolling engine
(answers between steps) and on engine=Python, whose engine answers only between batches of
seconds (the front end then serves the newest stats it has, with their age): never waiting
for the engine. That holds by construction, not by timing: scrapes are also made while the
engine is stopped (SIGSTOP) in the middle of its work, and each must be answered before it
goes on, well within Prometheus' default scrape timeout."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from ..servers import Server, stopped, write_properties

NUM_REQUESTS = 40  # below a gunicorn worker's 64 threads: a scrape always finds a free one
# Each stream outlasts the scrapes by construction (they run while the engine is stopped), so
# its length only has to keep later batches queued behind the first: 100 tokens do.
NEW_TOKENS = 100
SCRAPE_TIMEOUT_S = 10  # Prometheus' default scrape_timeout


def values(text: str) -> dict[str, float]:
    found = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            found[name.split("{")[0]] = float(value)
    return found


def stream_one(server: Server, index: int, started: threading.Event) -> int:
    body = {
        "inputs": f"Request {index}: once upon a time",
        "parameters": {"max_new_tokens": NEW_TOKENS, "ignore_eos_token": True},
        "stream": True,
    }
    with requests.post(f"{server.url}/invocations", json=body, stream=True, timeout=300) as r:
        assert r.status_code == 200, r.text
        lines = 0
        for line in r.iter_lines():
            if line:
                lines += 1
                started.set()
        return lines


@pytest.mark.parametrize(
    "properties",
    [
        {"engine": "MPI", "option.max_rolling_batch_size": 8},
        {
            "engine": "Python",
            "option.rolling_batch": "disable",
            "batch_size": 8,
            "max_batch_delay": 100,
        },
    ],
    ids=["rolling", "python"],
)
def test_metrics_answer_without_waiting_for_the_engine_while_requests_stream(
    tmp_path, tiny_model_dir, properties
):
    options = {
        "option.model_id": tiny_model_dir,
        "option.max_model_len": 1024,
        # Most requests queue behind others (for minutes on a slow machine, engine=Python's
        # last batch waits for four): a wait that option.predict_timeout bounds, not under test.
        "option.predict_timeout": 3600,
    }
    folder = write_properties(tmp_path / "model", {**properties, **options})
    server = Server(folder)
    server.wait_healthy()
    name = tiny_model_dir.name
    engine = server.rank_pid(0) if properties["engine"] == "MPI" else server.engine_pid()

    def scrape():
        begun = time.monotonic()
        metrics = requests.get(f"{server.url}/metrics", timeout=60)
        between = time.monotonic()
        model = requests.get(f"{server.url}/models/{name}", timeout=60)
        times = (between - begun, time.monotonic() - between)
        return times, values(metrics.text), model.json()

    try:
        started = threading.Event()
        with ThreadPoolExecutor(NUM_REQUESTS) as pool:
            streams = [pool.submit(stream_one, server, i, started) for i in range(NUM_REQUESTS)]
            # A hang guard: engine=Python streams a batch's lines when its HF generate ends, a
            # minute and more for 8 x 500 tokens on a loaded 2-core host; 100 here.
            assert started.wait(600), "no stream started"
            # The engine stopped mid-work: nothing ends meanwhile, and a scrape that waited for
            # the engine would not come back before it goes on.
            with stopped(engine):
                open_streams = sum(not s.done() for s in streams)
                frozen = [scrape() for _ in range(3)]
            running = [scrape() for _ in range(3)]  # the engine at work, answering as it can
            lines = [s.result() for s in streams]
        assert lines == [NEW_TOKENS] * NUM_REQUESTS  # every stream ran to its end
    finally:
        assert server.stop() == 0
    assert open_streams >= 8, "the requests ended before the scrapes could overlap them"
    for times, found, model in frozen + running:
        assert max(times) < SCRAPE_TIMEOUT_S, times
        assert found["lmserve_up"] == 1, found
        assert model["engine"]["stats"] is not None
        assert found["lmserve_stats_age_seconds"] < 60
    # While stopped, the engine answered nothing: the newest stats the front end had.
    assert all(found["lmserve_stats_age_seconds"] > 0 for _, found, _ in frozen)
    busy = [found for _, found, _ in frozen + running]
    if properties["engine"] == "MPI":
        assert any(found["lmserve_num_running"] > 0 for found in busy)
        assert any(found["lmserve_step_seconds_count"] > 0 for found in busy)
    else:
        assert all("lmserve_num_queued" in found for found in busy)
