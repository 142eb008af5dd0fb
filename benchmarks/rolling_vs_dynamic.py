"""Rolling batch (engine=MPI) against dynamic batching (engine=Python, batch_size=4,
max_batch_delay=100) on the same burst: N concurrent requests of exactly --prompt-tokens
prompt tokens and --new-tokens new tokens (EOS ignored), embedded SmolLM2, one run.

    .venv/bin/python -m lmserve.benchmarks.rolling_vs_dynamic
"""

from __future__ import annotations

import argparse
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import requests

from .serving import running_server

CONFIGS = {
    "dynamic (Python, batch_size=4, delay=100)": {
        "engine": "Python",
        "batch_size": 4,
        "max_batch_delay": 100,
    },
    "rolling (MPI, TP=1)": {"engine": "MPI", "option.max_rolling_batch_size": 32},
    "rolling (MPI, TP=2)": {
        "engine": "MPI",
        "option.tensor_parallel_degree": 2,
        "option.max_rolling_batch_size": 32,
    },
}


def prompt_of(num_tokens: int, url: str) -> str:
    """A prompt the server tokenizes to exactly `num_tokens` tokens ("a" is one token)."""
    text = " ".join(["a"] * num_tokens)
    body = {"inputs": text, "parameters": {"max_new_tokens": 1, "details": True}}
    assert requests.post(f"{url}/invocations", json=body, timeout=60).status_code == 200
    return text


def burst(url: str, prompt: str, count: int, new_tokens: int) -> tuple[float, list[float]]:
    body = {
        "inputs": prompt,
        "parameters": {"max_new_tokens": new_tokens, "ignore_eos_token": True},
    }

    def one(_):
        started = time.monotonic()
        response = requests.post(f"{url}/invocations", json=body, timeout=1200)
        response.raise_for_status()
        return time.monotonic() - started

    started = time.monotonic()
    with ThreadPoolExecutor(count) as pool:
        latencies = list(pool.map(one, range(count)))
    return time.monotonic() - started, latencies


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--dtype", default="fp32")
    parser.add_argument("--port", type=int, default=8098)
    args = parser.parse_args()
    print(
        f"{args.requests} concurrent requests, {args.prompt_tokens} prompt tokens, "
        f"{args.new_tokens} new tokens, SmolLM2-135M {args.dtype}\n\n"
        "| config | tokens/s | p50 latency (s) | p90 latency (s) |\n|---|---|---|---|"
    )
    for label, properties in CONFIGS.items():
        with running_server({**properties, "option.dtype": args.dtype}, args.port) as (url, _):
            prompt = prompt_of(args.prompt_tokens, url)
            burst(url, prompt, 2, 4)  # warm-up
            wall, latencies = burst(url, prompt, args.requests, args.new_tokens)
        deciles = statistics.quantiles(latencies, n=10)
        rate = args.requests * args.new_tokens / wall
        print(f"| {label} | {rate:.1f} | {deciles[4]:.1f} | {deciles[8]:.1f} |", flush=True)


if __name__ == "__main__":
    main()
