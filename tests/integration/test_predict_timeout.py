"""option.predict_timeout over real HTTP with the rolling batch, as DJL means it: a generation
that runs far longer than the timeout is answered in full (not streamed, so nothing flows until
it ends), a request that finds no place in the batch within the timeout gets a 503 saying so,
and a client that hangs up on a non-streamed request frees the engine at once.

"Far longer" holds on any machine: the long generation is sized from the step time measured on
this one, and should it still end too soon (the machine sped up after the probe: on two busy
cores a step's time can change tenfold), the test runs again, sized at the speed the long one
just had (at most twice more)."""

from __future__ import annotations

import math
import socket
import threading
import time
from urllib.parse import urlparse

import pytest
import requests

from ..servers import Server, tokens_lasting, wait_until, write_properties

# 2 s: at 1 s a fresh-clone run of the whole suite once saw the engine silent that long
# (not reproduced alone, nor beside two busy loops); the tests mean the same at 2 s.
TIMEOUT_S = 2
# Past the model's own 4,096 positions: option.max_model_len lifts them (as in
# test_long_generation.py), room for a long generation on a machine many times faster.
MAX_MODEL_LEN = 1 << 15
LIMIT = MAX_MODEL_LEN - 64  # room for the prompt


def long_parameters(num_tokens: int) -> dict:
    return {"max_new_tokens": num_tokens, "ignore_eos_token": True, "details": True}


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    folder = write_properties(
        tmp_path_factory.mktemp("predict-timeout"),
        {
            "option.model_id": tiny_model_dir,
            "option.predict_timeout": TIMEOUT_S,
            "option.max_rolling_batch_size": 1,  # a second request waits for the first
            "option.max_model_len": MAX_MODEL_LEN,
        },
    )
    server = Server(folder)
    server.wait_healthy()
    yield server
    assert server.stop() == 0


@pytest.fixture(scope="module")
def long_tokens(server) -> int:
    """A generation that lasts four times the timeout at this machine's measured speed."""
    return tokens_lasting(server, 4 * TIMEOUT_S, LIMIT)


def generate(server, parameters, results: list, timeout=600):
    started = time.monotonic()
    answer = requests.post(
        f"{server.url}/invocations",
        json={"inputs": "Once upon a time", "parameters": parameters},
        timeout=timeout,
    )
    results.append((answer, time.monotonic() - started))


def test_long_generation_answered_while_a_waiting_request_gets_503(server: Server, long_tokens):
    num_tokens = long_tokens
    for _ in range(3):
        long_results, short_results = [], []
        runner = threading.Thread(
            target=generate, args=(server, long_parameters(num_tokens), long_results)
        )
        runner.start()
        # The long one holds the batch's only place: the short one waits for it.
        wait_until(
            lambda done=long_results: done or server.engine_stats()["num_running"] == 1,
            "the long one running",
        )
        generate(server, {"max_new_tokens": 4}, short_results)
        runner.join()
        (long_answer, long_s), (short_answer, _) = long_results[0], short_results[0]
        print(f"{num_tokens} tokens in {long_s:.1f} s; beside it: {short_answer.status_code}")
        assert long_answer.status_code == 200, long_answer.text
        assert long_answer.json()["details"]["generated_tokens"] == num_tokens
        if short_answer.status_code != 200:
            break
        # The long one ended before the short one had waited the timeout: only a machine that
        # sped up since the probe makes it that short (else the 503 below fails the test).
        # Again, sized at the speed it just had.
        num_tokens = min(LIMIT, math.ceil(num_tokens * 4 * TIMEOUT_S / long_s))
    assert short_answer.status_code == 503, short_answer.text
    assert "option.predict_timeout" in short_answer.json()["message"]
    # It held the place from before the short one came until after that one's timeout.
    assert long_s > TIMEOUT_S


def test_client_that_hangs_up_frees_the_engine(server: Server):
    # As long as the model's context allows: it is dropped long before it could end.
    long_tokens = LIMIT
    url = urlparse(server.url)
    body = b'{"inputs": "Once upon a time", "parameters": {"max_new_tokens": %d,' % long_tokens
    body += b' "ignore_eos_token": true}}'
    request = (
        f"POST /invocations HTTP/1.1\r\nHost: {url.hostname}\r\nContent-Type: application/json"
        f"\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode() + body
    before = server.engine_stats()
    with socket.create_connection((url.hostname, url.port)) as client:
        client.sendall(request)
        hung_up = wait_until(
            lambda: (stats := server.engine_stats())["num_running"] == 1 and stats,
            "the request running",
        )
    wait_until(
        lambda: server.engine_stats()["num_running"] == 0, "the engine dropped the gone client"
    )
    stats = server.engine_stats()
    assert stats["kv_blocks_used"] == 0
    aborted = stats["finished"].get("abort", 0) - before["finished"].get("abort", 0)
    assert aborted == 1, (before["finished"], stats["finished"])
    # At once, not near the end: of the tokens left when the client hung up, the engine made
    # only a few more (the time it takes to notice).
    made = hung_up["tokens_generated"] - before["tokens_generated"]
    after = stats["tokens_generated"] - hung_up["tokens_generated"]
    assert after < (long_tokens - made) / 2, (long_tokens, made, after)
