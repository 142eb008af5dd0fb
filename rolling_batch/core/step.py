"""What one sequence contributes to a model step: the description rank 0 sends to every rank.
Torch-free (the scheduler builds it)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple


@dataclass(frozen=True)
class SequenceChunk:
    """One sequence's part of a step: `token_ids` are new (positions `num_computed`...), its KV
    blocks are `block_ids`, and `needs_logits` asks for the logits after its last token.

    A prompt whose log-probs were asked for is scored as it is computed: the chunk's rows from
    `score_from` on predict `score_targets` (the prompt's next tokens), and the step returns
    their log-probs, with the `score_top` most likely alternatives at each when above 0.

    A speculating decode (speculation.py) ends with `num_drafts` drafted tokens after its
    newest one; the step returns the logits after each of the last `num_drafts` + 1 tokens.

    `argmax_only` (with `needs_logits`): the step returns the greedy token after the chunk's
    last token instead of its logits (the model's GreedyHead: a greedy request without
    log-probs, penalties or drafts)."""

    token_ids: tuple[int, ...]
    num_computed: int
    block_ids: tuple[int, ...]
    needs_logits: bool
    score_from: int = 0
    score_targets: tuple[int, ...] = ()
    score_top: int = 0
    adapter: str | None = None  # the LoRA adapter of the sequence; None: the base model
    num_drafts: int = 0
    argmax_only: bool = False

    @property
    def num_logits(self) -> int:
        """Rows of the step's logits after this chunk's tokens."""
        return self.num_drafts + 1 if self.needs_logits and not self.argmax_only else 0

    @property
    def num_argmax(self) -> int:
        """Greedy tokens the step picks after this chunk's tokens without logits."""
        return 1 if self.needs_logits and self.argmax_only else 0


class Sample(NamedTuple):
    """The token sampled for one sequence at a step (rank 0's sampler)."""

    token: int
    log_prob: float
    top_logprobs: list[tuple[int, float]] | None = None  # when the request asks for them


@dataclass(frozen=True)
class AdapterSources:
    """Rank 0 to the other ranks between steps: the LoRA adapters known from now on, name ->
    folder (the management API registered or dropped one)."""

    folders: dict[str, str]
