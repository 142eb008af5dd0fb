"""What one sequence contributes to a model step: the description rank 0 sends to every rank.
Torch-free (the scheduler builds it)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SequenceChunk:
    """One sequence's part of a step: `token_ids` are new (positions `num_computed`...), its KV
    blocks are `block_ids`, and `needs_logits` asks for the logits after its last token."""

    token_ids: tuple[int, ...]
    num_computed: int
    block_ids: tuple[int, ...]
    needs_logits: bool
