"""Greedy generation of a set of prompts for the offline `LLM`: the rolling scheduler run to
completion (every prompt queued at once, chunked prefill, blocks on demand, preemption when
the cache is short), with argmax sampling."""

from __future__ import annotations

from collections.abc import Callable

import torch

from .block_manager import BlockManager
from .lora_manager import LoraManager
from .protocol import GenerationParams, adapter_refusal
from .request import Request
from .sampler import Sampler
from .scheduler import Scheduler
from .speculation import NgramDrafter
from .step import Sample, SequenceChunk


def generate_greedy(
    execute: Callable[[list[SequenceChunk]], torch.Tensor],
    num_blocks: int,
    block_size: int,
    max_model_len: int,
    max_rolling_batch_size: int,
    prompts: list[list[int]],
    max_new_tokens: int,
    eos_token_ids: set[int],
    ignore_eos: bool = False,
    prefill_token_budget: int = 4096,
    adapters: list[str | None] | None = None,
    lora: LoraManager | None = None,
    speculative_length: int = 0,
) -> list[list[int]]:
    """The generated token ids of each prompt (EOS included when it ended the sequence);
    `adapters`: each prompt's LoRA adapter (None: the base model), served by `lora`;
    `speculative_length` above 0: up to that many n-gram drafts a step (speculation.py)."""
    capacity = min(num_blocks * block_size, max_model_len)
    adapters = adapters or [None] * len(prompts)
    requests = [
        Request(
            str(i),
            list(p),
            GenerationParams(max_new_tokens=max_new_tokens, ignore_eos=ignore_eos, adapter=a),
            0.0,
        )
        for i, (p, a) in enumerate(zip(prompts, adapters, strict=True))
    ]
    served = None if lora is None else lora.sources
    for index, request in enumerate(requests):
        refusal = adapter_refusal(str(index), request.params.adapter, served)
        if refusal is not None:
            raise ValueError(f"prompt {index}: {refusal.message}")
        if request.num_tokens + max_new_tokens > capacity:
            raise ValueError(
                f"prompt {index}: {request.num_tokens} tokens + max_new_tokens={max_new_tokens}"
                f" exceed the {capacity} tokens one sequence may hold"
            )
    scheduler = Scheduler(
        BlockManager(num_blocks, block_size),
        max_rolling_batch_size,
        prefill_token_budget,
        max_model_len,
        None if lora is None else len(lora.slots),
        NgramDrafter(speculative_length) if speculative_length > 0 else None,
    )
    for request in requests:
        scheduler.add(request)
    while scheduler.has_work():
        out = scheduler.schedule()
        logits = execute(out.chunks)
        plain, plain_rows, drafts, draft_rows = out.logit_rows()
        chosen = torch.argmax(logits[plain_rows] if drafts else logits, dim=-1).tolist()
        sampled: dict = {r: Sample(token, 0.0) for r, token in zip(plain, chosen)}
        if drafts:
            sampled.update(Sampler(logits.device).verify(logits[draft_rows], drafts))
        scheduler.update(out, sampled, eos_token_ids)
    return [request.output_ids for request in requests]
