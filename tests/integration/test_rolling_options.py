"""Server options on the rolling engine (tiny model, two ranks): tgi_compat shapes, and
predict_timeout, which (as in DJL) never cuts a generation that is under way: one far longer
than the timeout is answered in full, and its blocks are free after."""

from __future__ import annotations

import json
import time

import requests

from ..servers import Server, write_properties


def test_tgi_compat_and_predict_timeout(tmp_path, tiny_model_dir):
    properties = {
        "engine": "MPI",
        "option.tensor_parallel_degree": 2,
        "option.model_id": tiny_model_dir,
        "option.max_model_len": 4096,
        "option.tgi_compat": "true",
        "option.predict_timeout": 2,
    }
    server = Server(write_properties(tmp_path / "model", properties))
    server.wait_healthy()
    try:
        short = {"inputs": "Hello", "parameters": {"max_new_tokens": 4, "details": True}}
        answer = requests.post(f"{server.url}/invocations", json=short, timeout=30).json()
        assert isinstance(answer, list) and len(answer) == 1  # TGI wraps it in a list
        token = answer[0]["details"]["tokens"][0]
        assert set(token) == {"id", "text", "logprob", "special"}

        streamed = requests.post(
            f"{server.url}/invocations", json={**short, "stream": True}, stream=True, timeout=30
        )
        assert streamed.headers["content-type"].startswith("text/event-stream")
        events = [json.loads(line[6:]) for line in streamed.iter_lines() if line]
        assert [e["generated_text"] is None for e in events] == [True] * 3 + [False]
        assert "logprob" in events[0]["token"]

        endless = {
            "inputs": "Hello",
            "parameters": {"max_new_tokens": 4000, "ignore_eos_token": True},
        }
        started = time.monotonic()
        answered = requests.post(f"{server.url}/invocations", json=endless, timeout=300)
        assert answered.status_code == 200, answered.text
        assert time.monotonic() - started > 2, "shorter than option.predict_timeout: no test"
        assert len(answered.json()[0]["generated_text"]) > 0
        name = tiny_model_dir.name
        deadline = time.monotonic() + 10
        while True:  # the request is done: its blocks are free again
            stats = requests.get(f"{server.url}/models/{name}", timeout=10).json()["engine"]
            if stats["stats"]["kv_blocks_used"] == 0:
                break
            assert time.monotonic() < deadline, stats
            time.sleep(0.2)
    finally:
        assert server.stop() == 0
