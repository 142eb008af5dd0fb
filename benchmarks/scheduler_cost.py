"""The rolling scheduler's own cost per step (schedule + update, block manager and prefix cache
included), without a model: a burst of requests that share a long system prompt, driven as
rank 0's loop drives them, with fake sampled tokens. The forward pass is what a step is for;
this is what rank 0 spends around it.

    python -m benchmarks.scheduler_cost [--requests 64] [--system 1024] [--rounds 5]

Prints microseconds per step (median of the rounds) for the workload with the prefix cache on
and off. Torch-free: the scheduler imports no torch.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from lmserve.rolling_batch.core.block_manager import BlockManager
from lmserve.rolling_batch.core.request import Request
from lmserve.rolling_batch.core.scheduler import Scheduler
from lmserve.rolling_batch.core.step import Sample
from lmserve.rolling_batch.ipc.protocol import GenerationParams

_EOS = 0  # never sampled: every request runs to max_new_tokens


def shared_prompt_requests(args: argparse.Namespace, seed: int) -> list[Request]:
    rng = random.Random(seed)
    system = [rng.randrange(1, 50_000) for _ in range(args.system)]
    params = GenerationParams(max_new_tokens=args.new_tokens, ignore_eos=True)
    return [
        Request(
            f"r{index}", system + [rng.randrange(1, 50_000) for _ in range(args.own)], params, 0
        )
        for index in range(args.requests)
    ]


def run_round(args: argparse.Namespace, caching: bool, seed: int) -> tuple[float, int]:
    """(seconds in schedule + update, steps) for one burst, arriving `per_step` a step."""
    blocks = BlockManager(args.num_blocks, args.block_size, enable_prefix_caching=caching)
    scheduler = Scheduler(
        blocks, args.max_rolling_batch_size, args.prefill_budget, max_model_len=8192
    )
    pending = shared_prompt_requests(args, seed)
    rng = random.Random(seed)
    spent, steps = 0.0, 0
    while pending or scheduler.has_work():
        for _ in range(args.per_step):
            if pending:
                scheduler.add(pending.pop(0))
        start = time.perf_counter()
        out = scheduler.schedule()
        spent += time.perf_counter() - start
        sampled = {request: Sample(rng.randrange(1, 50_000), -1.0) for request in out.sampling}
        start = time.perf_counter()
        scheduler.update(out, sampled, {_EOS})
        spent += time.perf_counter() - start
        steps += 1
    return spent, steps


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--per-step", type=int, default=4, help="requests arriving per step")
    parser.add_argument("--system", type=int, default=1024, help="shared prompt tokens")
    parser.add_argument("--own", type=int, default=128, help="each prompt's own tokens")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--num-blocks", type=int, default=8192)
    parser.add_argument("--max-rolling-batch-size", type=int, default=32)
    parser.add_argument("--prefill-budget", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    print("| prefix cache | steps | us per step (median of rounds) | all rounds |")
    print("|---|---|---|---|")
    for caching in (True, False):
        per_step = []
        for seed in range(args.rounds):
            spent, steps = run_round(args, caching, seed)
            per_step.append(spent / steps * 1e6)
        rounds = " ".join(f"{value:.0f}" for value in per_step)
        print(
            f"| {'on' if caching else 'off'} | {steps} | {statistics.median(per_step):.0f} |"
            f" {rounds} |"
        )


if __name__ == "__main__":
    main()
