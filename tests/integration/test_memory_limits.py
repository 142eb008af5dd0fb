"""Memory running out on a real server (engine=MPI, one rank, the tiny model) with a KV pool made
deliberately small: option.num_kv_blocks=4, 64 tokens. A request the pool can never hold is
refused with 400 naming max_new_tokens while requests beside it that fit are served, though
together they need more blocks than the pool has (they take turns, preempted, never failed);
/ping stays 200 and a later request is served."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import requests

from ..servers import Server, write_properties

NUM_KV_BLOCKS = 4  # of 16 tokens
FITS = 40  # new tokens of a request that fits alone; four of them do not fit together


def post(server: Server, max_new_tokens: int) -> requests.Response:
    parameters = {"max_new_tokens": max_new_tokens, "ignore_eos_token": True, "details": True}
    body = {"inputs": "Hello", "parameters": parameters}
    return requests.post(f"{server.url}/invocations", json=body, timeout=300)


def ping(server: Server) -> int:
    return requests.get(f"{server.url}/ping", timeout=10).status_code


def test_a_request_the_kv_pool_can_never_hold_is_400_and_the_others_go_on(tmp_path, tiny_model_dir):
    properties = {
        "engine": "MPI",
        "option.model_id": tiny_model_dir,
        "option.max_model_len": 256,  # the context admits what the KV pool cannot hold
        "option.num_kv_blocks": NUM_KV_BLOCKS,
        "option.max_rolling_batch_size": 4,
    }
    server = Server(write_properties(tmp_path / "model", properties))
    try:
        server.wait_healthy()
        with ThreadPoolExecutor(5) as pool:
            responses = list(pool.map(lambda n: post(server, n), [100, FITS, FITS, FITS, FITS]))
        too_big, *fitting = responses
        assert too_big.status_code == 400, too_big.text
        message = too_big.json()["message"]
        assert "max_new_tokens" in message and "KV cache" in message, message
        for response in fitting:
            assert response.status_code == 200, response.text
            assert response.json()["details"]["generated_tokens"] == FITS
        assert ping(server) == 200
        later = post(server, 8)
        assert later.status_code == 200, later.text
        assert ping(server) == 200
    finally:
        assert server.stop() == 0
