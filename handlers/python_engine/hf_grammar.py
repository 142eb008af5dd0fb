"""Structured output for engine=Python, through HF `generate`'s hooks: a logits processor masks
every constrained row to what its grammar allows next (the rolling engine's masks,
rolling_batch/core/grammar.py and engine/sampler.py), before HF's temperature, top-k and
top-p, as the rolling engine's sampler masks before them; a stopping criterion feeds each new
token to its row's grammar and ends the row where the grammar ends, EOS or not (the rolling
scheduler's rule), so `ignore_eos` cannot run a finished answer on to max_new_tokens."""

from __future__ import annotations

import torch
from transformers import LogitsProcessor, StoppingCriteria

from lmserve.rolling_batch.core.grammar import GrammarState
from lmserve.rolling_batch.engine.sampler import grammar_masks, mask_disallowed


class GrammarRows:
    """One GrammarState per row of the batch (None: the row is free text, or has ended)."""

    def __init__(self, grammars: list[GrammarState | None], eos_token_ids: set[int]):
        self.grammars = list(grammars)
        self.eos_token_ids = eos_token_ids
        self.ended_at: dict[int, int] = {}  # row -> the tokens it keeps: its grammar's end

    def take(self, tokens: list[int], num_generated: int) -> None:
        """Each constrained row's newest token (the `num_generated`-th)."""
        for row, (grammar, token) in enumerate(zip(self.grammars, tokens)):
            if grammar is None:
                continue
            if token in self.eos_token_ids:
                # Allowed only where the grammar may end: the answer ends here, EOS kept, even
                # with ignore_eos (as the rolling scheduler ends it).
                self.grammars[row] = None
                self.ended_at[row] = num_generated
                continue
            grammar.accept(token)
            if grammar.is_finished:
                self.grammars[row] = None
                self.ended_at[row] = num_generated


class GrammarLogitsProcessor(LogitsProcessor):
    def __init__(self, rows: GrammarRows):
        self.rows = rows

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.Tensor:
        return mask_disallowed(scores, grammar_masks(self.rows.grammars))


class GrammarStoppingCriteria(StoppingCriteria):
    """Called after each token is appended; a row is done once its grammar is complete."""

    def __init__(self, rows: GrammarRows, prompt_width: int):
        self.rows = rows
        self.prompt_width = prompt_width

    def __call__(self, input_ids: torch.LongTensor, scores, **kwargs) -> torch.BoolTensor:
        self.rows.take(input_ids[:, -1].tolist(), input_ids.shape[1] - self.prompt_width)
        ended = [row in self.rows.ended_at for row in range(input_ids.shape[0])]
        return torch.tensor(ended, dtype=torch.bool, device=input_ids.device)
