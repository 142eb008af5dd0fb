"""One layer's paged attention with a sliding window: the torch reference (what served windows
before the C++ kernel had them) against the C++ kernel, windowed and not.

    .venv/bin/python -m lmserve.benchmarks.window_attention [--heads 16 4 64] [--repeats 5]

Random K/V in a paged cache (blocks of 16 in shuffled order), fp32; best of `repeats` calls,
each the kernel alone (the reference's per-step plan built beforehand, as a model builds it
once a step). Prints a markdown table.
"""

from __future__ import annotations

import argparse
import time

import torch

from lmserve.kernels import cpu_native
from lmserve.kernels.paged_attention import ReferencePlan, attend

BLOCK = 16
BATCHES = {
    "32 decodes of 2048 keys": [(2048, 1)] * 32,
    "prefill 1024 + 8 decodes of 2048": [(1024, 1024)] + [(2048, 1)] * 8,
}


def paged_inputs(seqs: list[tuple[int, int]], q_heads: int, kv_heads: int, head_dim: int):
    """(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc) for sequences of
    (tokens cached after the step, new tokens)."""
    blocks = [-(-total // BLOCK) for total, _ in seqs]
    order = torch.randperm(sum(blocks)).to(torch.int32)
    tables = torch.zeros(len(seqs), max(blocks), dtype=torch.int32)
    for s, (start, count) in enumerate(zip(torch.tensor([0, *blocks]).cumsum(0), blocks)):
        tables[s, :count] = order[start : start + count]
    shape = (sum(blocks), BLOCK, kv_heads, head_dim)
    new = [n for _, n in seqs]
    return (
        torch.randn(sum(new), q_heads, head_dim),
        torch.randn(shape),
        torch.randn(shape),
        tables,
        torch.tensor([total for total, _ in seqs], dtype=torch.int32),
        torch.tensor([0, *new]).cumsum(0).to(torch.int32),
    )


def best_seconds(repeats: int, function, *args) -> float:
    function(*args)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        function(*args)
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--heads",
        type=int,
        nargs=3,
        default=[16, 4, 64],
        metavar=("Q_HEADS", "KV_HEADS", "HEAD_DIM"),
    )
    parser.add_argument("--windows", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    native = cpu_native.native_ops()
    if native is None:
        raise SystemExit("the C++ CPU kernels did not build on this machine")
    torch.manual_seed(0)
    scale = args.heads[2] ** -0.5
    print("| batch | window | torch reference ms | C++ windowed ms | C++ without window ms |")
    print("|---|---|---|---|---|")
    for name, seqs in BATCHES.items():
        query, k_cache, v_cache, tables, lens, starts = paged_inputs(seqs, *args.heads)
        plan = ReferencePlan.build(tables, lens, starts, BLOCK)
        call = (query, k_cache, v_cache, tables, lens, starts, scale)
        full = best_seconds(args.repeats, native.paged_attention, *call)
        for window in args.windows:
            reference = best_seconds(
                args.repeats, attend, query, k_cache, v_cache, plan, scale, window
            )
            windowed = best_seconds(args.repeats, native.paged_attention, *call, window, 0.0)
            cells = [reference, windowed, full]
            print(f"| {name} | {window} | " + " | ".join(f"{s * 1e3:.2f}" for s in cells) + " |")


if __name__ == "__main__":
    main()
