"""Greedy generation of a set of prompts through the packed runtime, all at once.

Not the rolling scheduler (that admits requests while others run): every prompt that fits
the KV cache starts together; each step packs the remaining prompt chunks (under a prefill
token budget, so long prompts are chunked) with one decode token per running sequence. When
the cache cannot hold every prompt, the rest wait for blocks to free up.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .step import SequenceChunk


@dataclass
class _Sequence:
    index: int
    tokens: list[int]
    prompt_len: int
    max_total: int  # prompt + max_new_tokens
    blocks: tuple[int, ...] = ()
    num_computed: int = 0
    done: bool = False

    @property
    def generated(self) -> list[int]:
        return self.tokens[self.prompt_len :]


@dataclass
class _FreeBlocks:
    ids: list[int] = field(default_factory=list)

    def take(self, count: int) -> tuple[int, ...] | None:
        if count > len(self.ids):
            return None
        taken, self.ids = self.ids[:count], self.ids[count:]
        return tuple(taken)


def generate_greedy(
    execute: Callable[[list[SequenceChunk]], torch.Tensor],
    num_blocks: int,
    block_size: int,
    prompts: list[list[int]],
    max_new_tokens: int,
    eos_token_ids: set[int],
    ignore_eos: bool = False,
    prefill_token_budget: int = 4096,
) -> list[list[int]]:
    """The generated token ids of each prompt (EOS included when it ended the sequence)."""
    free = _FreeBlocks(list(range(num_blocks)))
    waiting = [
        _Sequence(i, list(p), len(p), len(p) + max_new_tokens) for i, p in enumerate(prompts)
    ]
    for sequence in waiting:
        if -(-sequence.max_total // block_size) > num_blocks:
            raise ValueError(
                f"prompt {sequence.index} needs {sequence.max_total} tokens of KV cache; the"
                f" cache holds {num_blocks * block_size}"
            )
    running: list[_Sequence] = []
    finished: list[_Sequence] = []
    while waiting or running:
        while waiting:
            blocks = free.take(-(-waiting[0].max_total // block_size))
            if blocks is None:
                break
            waiting[0].blocks = blocks
            running.append(waiting.pop(0))
        step = _schedule(running, prefill_token_budget)
        logits = execute([chunk for _, chunk in step])
        sampled = iter(torch.argmax(logits, dim=-1).tolist())
        for sequence, chunk in step:
            sequence.num_computed += len(chunk.token_ids)
            if not chunk.needs_logits:
                continue
            token = next(sampled)
            sequence.tokens.append(token)
            stopped = token in eos_token_ids and not ignore_eos
            if stopped or len(sequence.tokens) >= sequence.max_total:
                sequence.done = True
                free.ids.extend(sequence.blocks)
        finished += [s for s in running if s.done]
        running = [s for s in running if not s.done]
    return [s.generated for s in sorted(finished, key=lambda s: s.index)]


def _schedule(running: list[_Sequence], budget: int) -> list[tuple[_Sequence, SequenceChunk]]:
    """Decode tokens for every sequence past its prompt; prompt chunks while the budget lasts."""
    step = []
    for sequence in running:
        pending = len(sequence.tokens) - sequence.num_computed
        is_prompt = sequence.num_computed < sequence.prompt_len
        count = min(pending, budget) if is_prompt else pending
        if count == 0:
            continue
        if is_prompt:
            budget -= count
        new = sequence.tokens[sequence.num_computed : sequence.num_computed + count]
        needs_logits = sequence.num_computed + count == len(sequence.tokens)
        step.append(
            (
                sequence,
                SequenceChunk(tuple(new), sequence.num_computed, sequence.blocks, needs_logits),
            )
        )
    return step
