"""Prefill and decode throughput of the native runtime against HF transformers on the same
inputs, and this machine's best matmul rate (the roofline decode should approach).

    .venv/bin/python -m lmserve.benchmarks.runtime_throughput [--batches 1 8] [--dtypes fp32]

Each batch: B prompts of --prompt-len random tokens prefilled in one packed step, then
--decode-steps steps of B decode tokens. HF: `generate` (greedy, EOS ignored) with a logits
processor that timestamps every step: prompt forward, then each decode step. Both warmed up.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
from transformers import AutoModelForCausalLM, LogitsProcessor, LogitsProcessorList

from lmserve.properties.config import default_cache_dir
from lmserve.properties.python_command import python_command
from lmserve.rolling_batch.core.step import SequenceChunk
from lmserve.rolling_batch.engine.mpi_launch import engine_environment
from lmserve.rolling_batch.model.layers.cpu_matmul import try_pack
from lmserve.rolling_batch.model.layers.parallel import TensorParallelGroup
from lmserve.rolling_batch.model.runner_setup import RuntimeOptions, build_runner
from lmserve.rolling_batch.model.source import local_model_path

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def matmul_rates(dtype: torch.dtype, size: int = 2048, repeats: int = 5) -> dict[str, float]:
    """GFLOP/s of a size^3 matmul through torch's default path and through a packed weight
    (what the runtime's CPU linears use: the C++ panels in fp32, oneDNN's layout otherwise);
    the faster one is the roofline."""
    a, b = torch.randn(size, size, dtype=dtype), torch.randn(size, size, dtype=dtype)
    rates = {"torch matmul": _gflops(lambda: a @ b, size, repeats)}
    packed = try_pack(b.t().contiguous())  # a linear computes x @ weight^T
    if packed is not None:
        rates["packed linear"] = _gflops(lambda: packed(a), size, repeats)
    return rates


def _gflops(matmul, size: int, repeats: int) -> float:
    matmul()
    started = time.perf_counter()
    for _ in range(repeats):
        matmul()
    return 2 * size**3 * repeats / (time.perf_counter() - started) / 1e9


def batch_runner(model_path, dtype: str, batch: int, max_len: int, model_impl: str = "auto"):
    """(runner, HF config, each sequence's KV blocks): one process, no tensor parallelism,
    `batch` sequences of up to `max_len` tokens with disjoint blocks; `model_impl` as
    option.model_impl ("transformers": the generic path)."""
    options = RuntimeOptions(
        dtype=dtype, max_model_len=max_len, max_rolling_batch_size=batch, model_impl=model_impl
    )
    runner, hf_config, _ = build_runner(model_path, options, TensorParallelGroup())
    per_seq = -(-max_len // runner.block_size)
    blocks = [tuple(range(i * per_seq, (i + 1) * per_seq)) for i in range(batch)]
    return runner, hf_config, blocks


def prefill_chunks(blocks, prompt_len: int, vocab_size: int = 40000) -> list[SequenceChunk]:
    """One prompt of `prompt_len` random tokens (the same ones every run, below 40000 and the
    vocabulary's size) per sequence."""
    prompts = torch.randint(
        100,
        min(40000, vocab_size),
        (len(blocks), prompt_len),
        generator=torch.Generator().manual_seed(0),
    )
    return [SequenceChunk(tuple(p.tolist()), 0, blocks[i], True) for i, p in enumerate(prompts)]


def decode_chunks(runner, blocks, prompt_len: int) -> list[SequenceChunk]:
    """Prefills `prompt_len` tokens per sequence; the decode step that follows (one token each,
    repeatable: the same positions, the same KV slots overwritten)."""
    tokens = runner.execute(prefill_chunks(blocks, prompt_len)).argmax(-1).tolist()
    return [SequenceChunk((t,), prompt_len, b, True) for t, b in zip(tokens, blocks)]


def median_step_seconds(runner, chunks: list[SequenceChunk], repeats: int) -> float:
    for _ in range(3):  # warm-up: first calls allocate and pick kernels
        runner.execute(chunks)
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        runner.execute(chunks)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def native(
    model_path, dtype: str, batch: int, prompt_len: int, steps: int, model_impl: str = "auto"
) -> tuple[float, float]:
    """(prefill, decode) tokens/s of the rolling batch's runner."""
    runner, hf_config, blocks = batch_runner(
        model_path, dtype, batch, prompt_len + steps + 1, model_impl
    )
    prefill = prefill_chunks(blocks, prompt_len, hf_config.vocab_size)
    runner.execute(prefill)  # warm-up: first calls allocate and pick kernels
    started = time.perf_counter()
    next_tokens = runner.execute(prefill).argmax(-1).tolist()
    prefill_s = time.perf_counter() - started
    started = time.perf_counter()
    for step in range(steps):
        chunks = [
            SequenceChunk((next_tokens[i],), prompt_len + step, blocks[i], True)
            for i in range(batch)
        ]
        next_tokens = runner.execute(chunks).argmax(-1).tolist()
    decode_s = time.perf_counter() - started
    return batch * prompt_len / prefill_s, batch * steps / decode_s


class _StepClock(LogitsProcessor):
    """Called once per generated token, right after that step's forward: timestamps steps."""

    def __init__(self):
        self.times: list[float] = []

    def __call__(self, input_ids, scores):
        self.times.append(time.perf_counter())
        return scores


def hf(model, batch: int, prompt_len: int, steps: int) -> tuple[float, float]:
    prompts = torch.randint(
        100, 40000, (batch, prompt_len), generator=torch.Generator().manual_seed(0)
    )
    mask = torch.ones_like(prompts)

    def generate(new_tokens: int) -> tuple[float, list[float]]:
        clock = _StepClock()
        started = time.perf_counter()
        model.generate(
            prompts,
            attention_mask=mask,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=0,
            logits_processor=LogitsProcessorList([clock]),
        )
        return started, clock.times

    with torch.inference_mode():
        generate(2)  # warm-up, as for the native runtime
        started, times = generate(steps + 1)
    # The first stamp follows the prompt's forward; each later one follows one decode step.
    return batch * prompt_len / (times[0] - started), batch * steps / (times[-1] - times[0])


def run_under_engine_allocator(module: str) -> None:
    """Re-executes `python -m module` with the allocator settings the engine processes get,
    unless they are set already (glibc reads them at start-up only)."""
    if "MALLOC_TRIM_THRESHOLD_" not in os.environ:
        os.execve(sys.executable, python_command("-m", module, *sys.argv[1:]), engine_environment())


def main() -> None:
    # Both runtimes under the engine's allocator settings.
    run_under_engine_allocator("lmserve.benchmarks.runtime_throughput")
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"])
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--decode-steps", type=int, default=16)
    args = parser.parse_args()
    model_path = local_model_path(None, default_cache_dir())
    print(f"torch threads: {torch.get_num_threads()}")
    roofline = {}
    for dtype in args.dtypes:
        rates = matmul_rates(DTYPES[dtype])
        roofline[dtype] = max(rates.values())
        shown = ", ".join(f"{path} {rate:.1f}" for path, rate in rates.items())
        print(f"{dtype} matmul 2048^3 GFLOP/s: {shown}")
    print(
        f"\nSmolLM2-135M, prompts of {args.prompt_len} tokens, {args.decode_steps} decode steps;"
        " roofline = decode FLOPs (2 x parameters per token) / the faster matmul rate\n\n"
        "| dtype | batch | native prefill tok/s | HF prefill tok/s | native decode tok/s |"
        " HF decode tok/s | decode native/HF | native decode, % of roofline |\n"
        "|---|---|---|---|---|---|---|---|"
    )
    for dtype in args.dtypes:
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=DTYPES[dtype]).eval()
        flops_per_token = 2 * sum(p.numel() for p in model.parameters())
        for batch in args.batches:
            ours = native(model_path, dtype, batch, args.prompt_len, args.decode_steps)
            theirs = hf(model, batch, args.prompt_len, args.decode_steps)
            share = ours[1] * flops_per_token / (roofline[dtype] * 1e9)
            print(
                f"| {dtype} | {batch} | {ours[0]:.0f} | {theirs[0]:.0f} | {ours[1]:.1f} |"
                f" {theirs[1]:.1f} | {ours[1] / theirs[1]:.2f} | {100 * share:.0f}% |",
                flush=True,
            )


if __name__ == "__main__":
    main()
