"""Issue 11 over real HTTP: generations that last over 150 s are answered in full under a short
option.predict_timeout (3 s), a streamed one (jsonlines) and a non-streamed one (plain JSON, no
byte sent until it ends) running side by side in the rolling batch (engine=MPI): no "Read
chunk timeout", no predict_timeout, no gunicorn worker timeout cuts them, and the server is
healthy after.

Sizing. The test must really run over 150 s, and not fail on a faster machine, so the length is
measured, not fixed. The model is the tiny random Llama (hidden 32, 2 layers, SmolLM2's
tokenizer) with a 2^19-wide MLP: 100M weights (200 MB in bf16) make each decode step cost the
same honest work on every token (22 ms for the pair on a 2-core CPU: ~7,000 tokens for 160 s),
while its attention stays as cheap as the tiny model's. With the plain tiny model a step cost
1.4 ms at the start and 7 ms at 24,000 tokens of context, so a short probe could not size
~32,000 tokens to within the 10% the threshold leaves; here attention adds ~5% by the end.
A short probe (the same pair, 200 tokens) gives the step time; the pair is sized for TARGET_S
at that speed. A step never gets cheaper as the context grows, so that lower-bounds its time.
option.max_model_len (2^18) lifts the model's own 4,096-token context, so a machine up to 30x
faster still gets a long enough generation. If the pair still ends under 150 s (the machine
sped up after the probe, e.g. other load stopped), it runs again, lengthened by 1.25 TARGET_S /
its measured time (time grows at least as fast as the length), up to four times: under load
that comes and goes (a CI run beside other work once had the pair at 105 s after one
lengthening) a round can be faster than the one that sized it. Measured on a quiet 2-core
CPU: the pair 166-175 s, the whole test (model, server, probe, pair) 180-190 s.
"""

from __future__ import annotations

import json
import math
import statistics
import threading
import time
from dataclasses import dataclass, field

import pytest
import requests

from ..conftest import save_tiny_llama
from ..servers import Server, write_properties

TIMEOUT_S = 3  # option.predict_timeout: far shorter than the generations
MIN_S = 150  # what the issue asks each generation to outlast
TARGET_S = 160  # what the pair is sized for; attention adds a little
MAX_MODEL_LEN = 1 << 18
PROBE_TOKENS = 200
# A pair that ends under MIN_S (the machine sped up after the measure that sized it) runs again
# longer, sized from its own time with this margin, at most this many times: a speed that keeps
# changing only makes more rounds, never a shorter pair.
MARGIN = 1.25
MAX_RETRIES = 4
PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def wide_mlp_model_dir(smollm2_dir, tmp_path_factory):
    import torch

    folder = tmp_path_factory.mktemp("wide-mlp-llama")
    return save_tiny_llama(folder, smollm2_dir, intermediate_size=1 << 19, dtype=torch.bfloat16)


@pytest.fixture(scope="module")
def server(wide_mlp_model_dir, tmp_path_factory):
    folder = write_properties(
        tmp_path_factory.mktemp("long-generation"),
        {
            "engine": "MPI",
            "option.model_id": wide_mlp_model_dir,
            "option.predict_timeout": TIMEOUT_S,
            "option.max_model_len": MAX_MODEL_LEN,
            "option.max_rolling_batch_size": 2,  # the pair; the KV cache holds two contexts
        },
    )
    server = Server(folder)
    server.wait_healthy()
    yield server
    assert server.stop() == 0


@dataclass
class Pair:
    """One streamed and one non-streamed generation of the same length, run side by side."""

    num_tokens: int
    stream_status: int = 0
    lines: list[bytes] = field(default_factory=list)
    line_times: list[float] = field(default_factory=list)  # s since the request was sent
    plain: requests.Response | None = None
    plain_s: float = 0.0

    @property
    def stream_s(self) -> float:
        return self.line_times[-1] if self.line_times else 0.0

    @property
    def shorter_s(self) -> float:
        return min(self.stream_s, self.plain_s)


def parameters(num_tokens: int) -> dict:
    return {"max_new_tokens": num_tokens, "ignore_eos_token": True, "details": True}


def run_stream(server, pair: Pair) -> None:
    body = {"inputs": PROMPT, "parameters": parameters(pair.num_tokens), "stream": True}
    started = time.monotonic()
    with requests.post(
        f"{server.url}/invocations", json=body, stream=True, timeout=(10, 600)
    ) as answer:
        pair.stream_status = answer.status_code
        for line in answer.iter_lines():
            if line:  # parsed later: reading keeps pace with the engine
                pair.line_times.append(time.monotonic() - started)
                pair.lines.append(line)


def run_plain(server, pair: Pair) -> None:
    body = {"inputs": PROMPT, "parameters": parameters(pair.num_tokens)}
    started = time.monotonic()
    # The read timeout only guards the test: the server sends nothing until the generation ends.
    pair.plain = requests.post(f"{server.url}/invocations", json=body, timeout=(10, 900))
    pair.plain_s = time.monotonic() - started


def run_pair(server, num_tokens: int) -> Pair:
    pair = Pair(num_tokens)
    threads = [threading.Thread(target=run, args=(server, pair)) for run in (run_plain, run_stream)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return pair


def check_answered_in_full(pair: Pair) -> None:
    n = pair.num_tokens
    assert pair.plain.status_code == 200, pair.plain.text[:500]
    details = pair.plain.json()["details"]
    assert details["generated_tokens"] == n and details["finish_reason"] == "length"
    assert pair.stream_status == 200
    events = [json.loads(line) for line in pair.lines]
    errors = [event for event in events if "error" in event or "code" in event]
    assert not errors, errors[:3]
    assert len(events) == n and all("token" in event for event in events)
    assert events[-1]["details"]["generated_tokens"] == n
    assert events[-1]["details"]["finish_reason"] == "length"
    # Tokens kept flowing: the stream never went quiet for as long as the timeout.
    gaps = [later - earlier for earlier, later in zip(pair.line_times, pair.line_times[1:])]
    assert pair.line_times[0] < TIMEOUT_S and max(gaps) < TIMEOUT_S, max(gaps)


def step_time(pair: Pair) -> float:
    """The pair's time per step: the median gap between stream lines (a pause the probe happens
    to meet would otherwise shorten the generation it sizes)."""
    gaps = [later - earlier for earlier, later in zip(pair.line_times, pair.line_times[1:])]
    return statistics.median(gaps)


def test_generations_over_150_s_are_never_cut_by_a_short_predict_timeout(server):
    probe = run_pair(server, PROBE_TOKENS)
    check_answered_in_full(probe)
    step_s = step_time(probe)
    num_tokens = math.ceil(TARGET_S / step_s)
    fits = MAX_MODEL_LEN - 64  # room for the prompt
    print(f"probe: {step_s * 1e3:.1f} ms per step ({1 / step_s:.0f} tokens/s): {num_tokens} tokens")
    assert num_tokens <= fits, f"{step_s=}: {MAX_MODEL_LEN} tokens last under {TARGET_S} s"

    pair = run_pair(server, num_tokens)
    for _ in range(MAX_RETRIES):
        if pair.shorter_s >= MIN_S:
            break
        # Sped up since the last measure (other load on the machine stopped): the pair just
        # run is the better measure; lengthened with a margin against speeding up again.
        check_answered_in_full(pair)
        longer = math.ceil(pair.num_tokens * MARGIN * TARGET_S / pair.shorter_s)
        print(f"{pair.num_tokens} tokens took {pair.shorter_s:.0f} s; again with {longer}")
        pair = run_pair(server, min(longer, fits))
    print(f"{pair.num_tokens} tokens: stream {pair.stream_s:.0f} s, plain {pair.plain_s:.0f} s")

    check_answered_in_full(pair)
    assert pair.stream_s > MIN_S and pair.plain_s > MIN_S, (pair.stream_s, pair.plain_s)
    assert requests.get(f"{server.url}/ping", timeout=10).status_code == 200
