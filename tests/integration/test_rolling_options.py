"""Server options on the rolling engine (tiny model, two ranks): tgi_compat shapes, and
predict_timeout, which (as in DJL) never cuts a generation that is under way: one far longer
than the timeout is answered in full, and its blocks are free after.

"Far longer" holds on any machine: the generation is sized from the step time measured on this
one to last twice the timeout, and should it still end sooner (the machine sped up after the
probe: on two busy cores a step's time can change tenfold), it runs again, sized at the speed
it just had (at most twice more)."""

from __future__ import annotations

import json
import math
import time

import requests

from ..servers import Server, tokens_lasting, wait_until, write_properties

TIMEOUT_S = 2  # option.predict_timeout
# Lifts the model's own 4,096 positions: room for ~16x the ~9,000 tokens that last 2 x TIMEOUT_S
# on the fastest machine seen (4,000 took 1.76 s), and steps grow with the context.
MAX_MODEL_LEN = 1 << 15


def test_tgi_compat_and_predict_timeout(tmp_path, tiny_model_dir):
    properties = {
        "engine": "MPI",
        "option.tensor_parallel_degree": 2,
        "option.model_id": tiny_model_dir,
        "option.max_model_len": MAX_MODEL_LEN,
        "option.max_rolling_batch_size": 2,  # the KV cache sized for two long contexts
        "option.tgi_compat": "true",
        "option.predict_timeout": TIMEOUT_S,
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

        limit = MAX_MODEL_LEN - 64  # room for the prompt
        num_tokens = tokens_lasting(server, 2 * TIMEOUT_S, limit)
        for _ in range(3):
            endless = {
                "inputs": "Hello",
                "parameters": {"max_new_tokens": num_tokens, "ignore_eos_token": True},
            }
            started = time.monotonic()
            answered = requests.post(f"{server.url}/invocations", json=endless, timeout=600)
            took = time.monotonic() - started
            print(f"{num_tokens} tokens in {took:.1f} s")
            assert answered.status_code == 200, answered.text
            assert len(answered.json()[0]["generated_text"]) > 0
            if took > TIMEOUT_S:
                break
            # Sped up since the probe: its measure is the better one now.
            num_tokens = min(limit, math.ceil(num_tokens * 2 * TIMEOUT_S / took))
        assert took > TIMEOUT_S, f"{num_tokens} tokens in {took:.1f} s: no longer than the timeout"
        # The request is done: its blocks are free again.
        wait_until(lambda: server.engine_stats()["kv_blocks_used"] == 0, "the blocks freed")
    finally:
        assert server.stop() == 0
