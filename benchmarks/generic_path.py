"""The generic path (the model's transformers modules over lmserve's paged attention) against
the native module on the same folder: prefill and decode tokens/s of the runner, one process.

    .venv/bin/python -m lmserve.benchmarks.generic_path [--batches 1 8 32] [--dtypes fp32]

Each batch: B prompts of --prompt-len random tokens prefilled in one packed step, then
--decode-steps steps of B decode tokens (runtime_throughput's workload). The two paths run in
turns, --rounds times, and each keeps its best round: the machine's drift lands on both.
The goal the issue sets: the generic path within 2x of the native one.
"""

from __future__ import annotations

import argparse

import torch

from lmserve.properties.config import default_cache_dir
from lmserve.rolling_batch.model.source import local_model_path

from .runtime_throughput import native, run_under_engine_allocator

PATHS = ("auto", "transformers")  # option.model_impl: native where it exists, generic


def compare(model_path, dtype: str, batch: int, prompt_len: int, steps: int, rounds: int):
    """{path: (prefill tok/s, decode tok/s)}, each the best of `rounds` alternating runs."""
    best = {path: (0.0, 0.0) for path in PATHS}
    for _ in range(rounds):
        for path in PATHS:
            prefill, decode = native(model_path, dtype, batch, prompt_len, steps, path)
            best[path] = (max(best[path][0], prefill), max(best[path][1], decode))
    return best


def main() -> None:
    run_under_engine_allocator("lmserve.benchmarks.generic_path")
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=None, help="an HF folder (default: SmolLM2-135M)")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--dtypes", nargs="+", default=["fp32"])
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--decode-steps", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    model_path = local_model_path(args.model, default_cache_dir())
    print(f"{model_path.name}: torch threads {torch.get_num_threads()}, prompts of")
    print(f"{args.prompt_len} tokens, {args.decode_steps} decode steps, best of {args.rounds}\n")
    print(
        "| dtype | batch | native prefill tok/s | generic prefill tok/s | native decode tok/s |"
        " generic decode tok/s | decode generic/native |\n|---|---|---|---|---|---|---|"
    )
    for dtype in args.dtypes:
        for batch in args.batches:
            result = compare(
                model_path, dtype, batch, args.prompt_len, args.decode_steps, args.rounds
            )
            (n_pre, n_dec), (g_pre, g_dec) = result["auto"], result["transformers"]
            print(
                f"| {dtype} | {batch} | {n_pre:.0f} | {g_pre:.0f} | {n_dec:.1f} | {g_dec:.1f} |"
                f" {g_dec / n_dec:.2f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
