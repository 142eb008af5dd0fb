"""A served run's steps against this machine's floor, from the engine's step trace.

    serving.properties: option.step_trace=/tmp/steps.jsonl   (then serve and run a workload)
    .venv/bin/python -m lmserve.benchmarks.step_floor /tmp/steps.jsonl [--replay] [--dtype fp32]

Each traced step's floor is the roofline of its work on this machine: the larger of its
multiply-adds at the measured matmul rate (`runtime_throughput`'s packed-linear roofline) and
its bytes at the measured memory stream (a sum over 512 MiB on every thread). Work: every
row's linears in every layer, each logits row's LM head, attention over the keys before each
row; bytes: the weights once a step and every key's K/V once a step. The steps are grouped by
kind (a step with a prompt chunk, decode steps by batch size), and each group's served forward
time is set against its floor: what the model's arithmetic and memory traffic cannot go below,
whatever the engine does; and against a second floor that adds each step's K/V read to its
arithmetic, which is how a 2-core Zen 4 runs them (`kv_apart_floor_seconds`). `--replay` also
runs each step's shape offline on the runtime (one process, no server, the same chunk sizes
and contexts on disjoint blocks) for the share the serving environment costs. `--burst-only`
drops a burst's warm-up (`lmserve bench`'s and `vllm_compare`'s two requests before it).
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import torch

from lmserve.properties.config import default_cache_dir

from .bench_cli import WARMUP_REQUESTS
from .runtime_throughput import DTYPES, batch_runner, matmul_rates

# Decode steps grouped by batch size: few rows stream the weights, many are bound by the
# multiply-adds (on a 2-core CPU and SmolLM2-135M the two meet at about 8 rows).
DECODE_GROUPS = ((24, "decode, 24+ rows"), (8, "decode, 8-23 rows"), (1, "decode, 1-7 rows"))
PROMPT_GROUP = "with prompt chunks"


@dataclass(frozen=True)
class Chunk:
    new_tokens: int
    computed: int  # tokens of the sequence before this step's
    needs_logits: bool
    argmax_only: bool


@dataclass(frozen=True)
class TracedStep:
    chunks: tuple[Chunk, ...]
    phases: dict[str, float]  # seconds (engine/stats.py: PHASES)

    @property
    def rows(self) -> int:
        return sum(c.new_tokens for c in self.chunks)

    @property
    def group(self) -> str:
        if any(c.new_tokens > 1 for c in self.chunks):
            return PROMPT_GROUP
        return next(name for least, name in DECODE_GROUPS if self.rows >= least)


def read_trace(path: Path) -> list[TracedStep]:
    steps = []
    for line in path.read_text().splitlines():
        step = json.loads(line)
        chunks = tuple(Chunk(*fields) for fields in step["chunks"])
        steps.append(TracedStep(chunks, step["phases"]))
    return steps


def burst_steps(steps: list[TracedStep]) -> list[TracedStep]:
    """The steps from the first of more sequences than the warm-up's requests on: a burst
    without the warm-up that `lmserve bench` and `vllm_compare` send before it (none if no
    step has more)."""
    first = next(
        (i for i, step in enumerate(steps) if len(step.chunks) > WARMUP_REQUESTS), len(steps)
    )
    return steps[first:]


@dataclass(frozen=True)
class ModelShape:
    """What a step's work depends on, from a Llama-style config.json."""

    hidden: int
    intermediate: int
    layers: int
    q_heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    element_bytes: int  # of the weights and the K/V cache

    @classmethod
    def from_config(cls, config: dict, element_bytes: int) -> ModelShape:
        q_heads = config["num_attention_heads"]
        return cls(
            hidden=config["hidden_size"],
            intermediate=config["intermediate_size"],
            layers=config["num_hidden_layers"],
            q_heads=q_heads,
            kv_heads=config.get("num_key_value_heads", q_heads),
            head_dim=config.get("head_dim") or config["hidden_size"] // q_heads,
            vocab=config["vocab_size"],
            element_bytes=element_bytes,
        )

    @property
    def layer_weights(self) -> int:
        """Multiply-adds of a row in one layer: Q, K, V, O, gate, up and down."""
        attention = self.hidden * (self.q_heads + 2 * self.kv_heads) * self.head_dim
        return (
            attention
            + self.q_heads * self.head_dim * self.hidden
            + 3 * self.hidden * self.intermediate
        )


@dataclass(frozen=True)
class Machine:
    flops: float  # multiply-adds count 2, per second, all threads
    stream: float  # bytes per second, all threads


def step_work(step: TracedStep, shape: ModelShape) -> tuple[float, float, float]:
    """(flops, bytes of the weights and LM head, bytes of K/V) of a step; see the module's
    docstring. A row whose greedy token the model picks (argmax_only) costs its LM head at
    bf16's price: the runtime screens the vocabulary with the head's bf16 copy at twice the
    fp32 rate (AVX512-BF16) and computes the few rows its bound leaves in fp32, so an fp32 head
    would put that step's floor above what it takes."""
    logits_rows = sum(c.needs_logits and not c.argmax_only for c in step.chunks)
    greedy_rows = sum(c.needs_logits and c.argmax_only for c in step.chunks)
    flops = 2.0 * step.rows * shape.layer_weights * shape.layers
    flops += 2.0 * (logits_rows + greedy_rows / 2) * shape.hidden * shape.vocab
    # Row i of a chunk (0-based) attends to computed + i + 1 keys: Q K^T and P V, per layer.
    attended = sum(
        c.new_tokens * c.computed + c.new_tokens * (c.new_tokens + 1) / 2 for c in step.chunks
    )
    flops += 4.0 * attended * shape.q_heads * shape.head_dim * shape.layers
    head_bytes = shape.element_bytes if logits_rows else min(2, shape.element_bytes)
    head = shape.hidden * shape.vocab * head_bytes if logits_rows + greedy_rows else 0
    keys = sum(c.computed + c.new_tokens for c in step.chunks)
    kv = keys * 2 * shape.kv_heads * shape.head_dim * shape.layers
    weights = float(shape.layer_weights * shape.layers) * shape.element_bytes + head
    return flops, weights, float(kv) * shape.element_bytes


def floor_seconds(step: TracedStep, shape: ModelShape, machine: Machine) -> float:
    flops, weights, kv = step_work(step, shape)
    return max(flops / machine.flops, (weights + kv) / machine.stream)


def kv_apart_floor_seconds(step: TracedStep, shape: ModelShape, machine: Machine) -> float:
    """The floor where a step's K/V read adds to its arithmetic instead of streaming under it:
    what a 2-core Zen 4 allows, where every way tried of reading K/V during the linears took
    from their weight stream what it gave attention (the performance log, 2026-11-27). The
    weights still stream under the multiply-adds."""
    flops, weights, kv = step_work(step, shape)
    return max(flops / machine.flops, weights / machine.stream) + kv / machine.stream


def measure_machine(dtype: torch.dtype) -> Machine:
    flops = max(matmul_rates(dtype).values()) * 1e9
    data = torch.ones(512 * 2**20 // 4)
    data.sum()  # touches every page once
    best = float("inf")
    for _ in range(5):
        started = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - started)
    return Machine(flops, data.numel() * 4 / best)


def replay_seconds(
    steps: list[TracedStep], model_path: Path, dtype: str, passes: int
) -> list[float]:
    """Each step's forward offline (the fastest of `passes`): its chunks' sizes and contexts
    on disjoint blocks, one block range a chunk position."""
    from lmserve.rolling_batch.core.step import SequenceChunk

    max_seqs = max(len(s.chunks) for s in steps)
    max_len = max(c.computed + c.new_tokens for s in steps for c in s.chunks)
    runner, _, blocks = batch_runner(model_path, dtype, max_seqs, max_len)

    def chunks_of(step: TracedStep) -> list:
        return [
            SequenceChunk(
                (1000 + i,) * c.new_tokens,
                c.computed,
                blocks[i],
                c.needs_logits,
                # As the scheduler does: argmax-only chunks where this CPU built a greedy head.
                argmax_only=c.argmax_only and runner.argmax_head,
            )
            for i, c in enumerate(step.chunks)
        ]

    for step in steps[:3]:  # warm-up: first calls allocate and pick kernels
        runner.execute_step(chunks_of(step))
    best = [float("inf")] * len(steps)
    for _ in range(passes):
        for index, step in enumerate(steps):
            chunks = chunks_of(step)
            started = time.perf_counter()
            runner.execute_step(chunks)
            best[index] = min(best[index], time.perf_counter() - started)
    return best


def table(
    steps: list[TracedStep],
    floors: list[float],
    kv_apart: list[float],
    offline: list[float] | None,
) -> str:
    """Steps summed by kind: served time, each floor (`floor_seconds`,
    `kv_apart_floor_seconds`) and its share of the forward time, and the offline replay's."""
    groups: dict[str, list[int]] = defaultdict(list)
    for index, step in enumerate(steps):
        groups[step.group].append(index)
    order = [PROMPT_GROUP, *(name for _, name in DECODE_GROUPS)]
    header = (
        "| steps | count | rows | served step s | served forward s | floor s | floor / forward"
        " | floor, K/V apart s | K/V apart / forward |"
    )
    rule = "|---|---|---|---|---|---|---|---|---|"
    if offline is not None:
        header += " offline forward s | served / offline |"
        rule += "---|---|"
    lines = [header, rule]
    for name, members in [
        *((n, groups[n]) for n in order if groups[n]),
        ("all", list(range(len(steps)))),
    ]:
        served = sum(sum(steps[i].phases.values()) for i in members)
        forward = sum(steps[i].phases.get("forward", 0.0) for i in members)
        floor = sum(floors[i] for i in members)
        apart = sum(kv_apart[i] for i in members)
        rows = sum(steps[i].rows for i in members)
        line = f"| {name} | {len(members)} | {rows} | {served:.2f} | {forward:.2f} | {floor:.2f}"
        line += f" | {floor / forward:.0%} | {apart:.2f} | {apart / forward:.0%} |"
        if offline is not None:
            replayed = sum(offline[i] for i in members)
            line += f" {replayed:.2f} | {forward / replayed:.3f} |"
        lines.append(line)
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("trace", type=Path, help="the file option.step_trace named")
    parser.add_argument("--model-dir", type=Path, help="default: the embedded model, converted")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32", help="the server's")
    parser.add_argument("--replay", action="store_true", help="also time each step offline")
    parser.add_argument("--passes", type=int, default=2, help="replays of the trace (fastest kept)")
    parser.add_argument(
        "--burst-only",
        action="store_true",
        help="drop the steps before the burst's first (those of its warm-up requests)",
    )
    options = parser.parse_args()
    steps = read_trace(options.trace)
    if options.burst_only:
        steps = burst_steps(steps)
    if not steps:
        raise SystemExit(f"{options.trace} holds no steps")
    from lmserve.rolling_batch.model.source import local_model_path

    model_dir = options.model_dir or local_model_path(None, default_cache_dir())
    dtype = DTYPES[options.dtype]
    shape = ModelShape.from_config(
        json.loads((model_dir / "config.json").read_text()), dtype.itemsize
    )
    machine = measure_machine(dtype)
    rates = f"{machine.flops / 1e9:.0f} GFLOP/s ({options.dtype} packed linear)"
    print(f"machine: {rates}, {machine.stream / 1e9:.1f} GB/s")
    floors = [floor_seconds(step, shape, machine) for step in steps]
    kv_apart = [kv_apart_floor_seconds(step, shape, machine) for step in steps]
    offline = (
        replay_seconds(steps, model_dir, options.dtype, options.passes) if options.replay else None
    )
    print(table(steps, floors, kv_apart, offline))


if __name__ == "__main__":
    main()
