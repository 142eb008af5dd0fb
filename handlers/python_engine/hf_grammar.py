"""Structured output for engine=Python: a logits processor that HF `generate` calls each step,
masking every constrained row to what its grammar allows next (the rolling engine's masks,
rolling_batch/core/grammar.py and sampler.py). It runs before HF's temperature, top-k and top-p, as
the rolling engine's sampler masks before them."""

from __future__ import annotations

import torch
from transformers import LogitsProcessor

from lmserve.rolling_batch.core.grammar import GrammarState
from lmserve.rolling_batch.engine.sampler import grammar_masks, mask_disallowed


class GrammarLogitsProcessor(LogitsProcessor):
    """`grammars`: one GrammarState per row of the batch (None: the row is free text)."""

    def __init__(self, grammars: list[GrammarState | None], eos_token_ids: set[int]):
        self.grammars = list(grammars)
        self.eos_token_ids = eos_token_ids
        self._prompt_width: int | None = None

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.Tensor:
        if self._prompt_width is None:
            self._prompt_width = input_ids.shape[1]  # the first call: nothing generated yet
        else:
            self._take_last_tokens(input_ids[:, -1].tolist())
        return mask_disallowed(scores, grammar_masks(self.grammars))

    def _take_last_tokens(self, tokens: list[int]) -> None:
        for row, (grammar, token) in enumerate(zip(self.grammars, tokens)):
            if grammar is None:
                continue
            if token in self.eos_token_ids or grammar.is_finished:
                # The row has ended: generate pads it from here on, which no grammar allows.
                self.grammars[row] = None
                continue
            grammar.accept(token)
