"""Concurrent requests with different parameters are grouped into batches, never failed (DJL
fails such a batch): each gets its own length, greedy ones equal their answer alone."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from ..servers import Server, write_properties

GREEDY = [{"max_new_tokens": n, "ignore_eos_token": True} for n in (3, 7, 12)]
SAMPLED = [{"max_new_tokens": 5, "do_sample": True, "temperature": 0.8, "top_k": 20, "seed": 4}] * 3


def test_mixed_parameters_share_the_server_without_failing(tmp_path, tiny_model_dir):
    folder = write_properties(
        tmp_path / "model",
        {
            "engine": "Python",
            "option.rolling_batch": "disable",
            "batch_size": 4,
            "max_batch_delay": 300,
            "option.dtype": "fp32",
            "option.model_id": tiny_model_dir,
        },
    )
    server = Server(folder)
    server.wait_healthy()
    try:

        def ask(parameters):
            body = {"inputs": "Once upon a time", "parameters": {**parameters, "details": True}}
            # a hang guard: six requests queue behind each other on a loaded host
            return requests.post(f"{server.url}/invocations", json=body, timeout=600)

        with ThreadPoolExecutor(6) as pool:
            together = list(pool.map(ask, GREEDY + SAMPLED))
        assert [r.status_code for r in together] == [200] * 6
        for parameters, response in zip(GREEDY + SAMPLED, together):
            assert response.json()["details"]["generated_tokens"] == parameters["max_new_tokens"]
        for parameters, response in zip(GREEDY, together):
            batched, alone = response.json(), ask(parameters).json()
            assert batched["generated_text"] == alone["generated_text"]
            batched_tokens, alone_tokens = batched["details"]["tokens"], alone["details"]["tokens"]
            assert [t["id"] for t in batched_tokens] == [t["id"] for t in alone_tokens]
            # Batch-size-dependent matmul blocking moves the last float digits only.
            assert [t["log_prob"] for t in batched_tokens] == pytest.approx(
                [t["log_prob"] for t in alone_tokens], abs=1e-4
            )

        stats = requests.get(f"{server.url}/models/{tiny_model_dir.name}", timeout=10).json()
        sizes = {int(k): v for k, v in stats["engine"]["stats"]["batch_sizes"].items()}
        assert sum(size * count for size, count in sizes.items()) == 6 + len(GREEDY)
        assert max(sizes) <= 4
    finally:
        assert server.stop() == 0
