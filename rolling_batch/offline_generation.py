"""Greedy generation of a set of prompts for the offline `LLM`: the rolling scheduler run to
completion (every prompt queued at once, chunked prefill, blocks on demand, preemption when
the cache is short), with argmax sampling."""

from __future__ import annotations

from collections.abc import Callable

import torch

from .block_manager import BlockManager
from .protocol import GenerationParams
from .request import Request
from .scheduler import Scheduler
from .step import Sample, SequenceChunk


def generate_greedy(
    execute: Callable[[list[SequenceChunk]], torch.Tensor],
    num_blocks: int,
    block_size: int,
    max_model_len: int,
    max_running: int,
    prompts: list[list[int]],
    max_new_tokens: int,
    eos_token_ids: set[int],
    ignore_eos: bool = False,
    prefill_token_budget: int = 4096,
) -> list[list[int]]:
    """The generated token ids of each prompt (EOS included when it ended the sequence)."""
    capacity = min(num_blocks * block_size, max_model_len)
    params = GenerationParams(max_new_tokens=max_new_tokens, ignore_eos=ignore_eos)
    requests = [Request(str(i), list(p), params, 0.0) for i, p in enumerate(prompts)]
    for index, request in enumerate(requests):
        if request.num_tokens + max_new_tokens > capacity:
            raise ValueError(
                f"prompt {index}: {request.num_tokens} tokens + max_new_tokens={max_new_tokens}"
                f" exceed the {capacity} tokens one sequence may hold"
            )
    scheduler = Scheduler(
        BlockManager(num_blocks, block_size), max_running, prefill_token_budget, max_model_len
    )
    for request in requests:
        scheduler.add(request)
    while scheduler.has_work():
        out = scheduler.schedule()
        tokens = torch.argmax(execute(out.chunks), dim=-1).tolist()
        sampled = {request: Sample(token, 0.0) for request, token in zip(out.sampling, tokens)}
        scheduler.update(out, sampled, eos_token_ids)
    return [request.output_ids for request in requests]
