"""Cold start, single-request latency and concurrent throughput of `lmserve serve` on the
embedded SmolLM2-135M-Instruct, engine=Python. Prints a markdown table.

    .venv/bin/python -m lmserve.benchmarks.serve_latency --batch-size 4 --max-batch-delay 100
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import requests

from .serving import running_server

PROMPT = "Write a short story about a robot who learns to paint."


def generate(port: int, new_tokens: int) -> float:
    body = {
        "inputs": PROMPT,
        "parameters": {"max_new_tokens": new_tokens, "ignore_eos_token": True},
    }
    started = time.monotonic()
    response = requests.post(f"http://127.0.0.1:{port}/invocations", json=body, timeout=600)
    response.raise_for_status()
    return time.monotonic() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--max-batch-delay", type=int, default=100)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--port", type=int, default=8097)
    parser.add_argument("--dtype", default="fp32")
    args = parser.parse_args()
    properties = {
        "engine": "Python",
        "option.rolling_batch": "disable",
        "batch_size": args.batch_size,
        "max_batch_delay": args.max_batch_delay,
        "option.dtype": args.dtype,
    }
    with running_server(properties, args.port) as (url, cold_start):
        generate(url, 4)  # first request warms up allocator and kernels
        single = [generate(url, args.new_tokens) for _ in range(args.repeats)]
        rates = []
        for _ in range(args.repeats):
            started = time.monotonic()
            with ThreadPoolExecutor(args.concurrency) as pool:
                list(pool.map(lambda _: generate(url, args.new_tokens), range(args.concurrency)))
            rates.append(args.concurrency * args.new_tokens / (time.monotonic() - started))
    print(
        f"engine=Python batch_size={args.batch_size} max_batch_delay={args.max_batch_delay} ms,"
        f" SmolLM2-135M {args.dtype}, {os.cpu_count()} cores\n"
    )
    print("| measure | median | min | max |\n|---|---|---|---|")
    print(f"| cold start to healthy /ping (s) | {cold_start:.1f} | | |")
    print(
        f"| 1 request, {args.new_tokens} new tokens (s) | {statistics.median(single):.2f} |"
        f" {min(single):.2f} | {max(single):.2f} |"
    )
    print(
        f"| {args.concurrency} concurrent x {args.new_tokens} new tokens (tokens/s) |"
        f" {statistics.median(rates):.1f} | {min(rates):.1f} | {max(rates):.1f} |"
    )


if __name__ == "__main__":
    main()
