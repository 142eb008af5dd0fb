"""Vocab-parallel embedding and LM head: each rank holds a contiguous slice of the vocabulary.
A tied LM head reuses the embedding's slice."""

from __future__ import annotations

import torch
from torch import nn

from .parallel import TensorParallelGroup, balanced_split
from .quantized import QuantizedWeight, int8_weight, quantize_int8


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, group: TensorParallelGroup):
        super().__init__()
        self.group = group
        self.splits = [
            balanced_split(vocab_size, group.world_size, r) for r in range(group.world_size)
        ]
        self.vocab_start, self.num_local = self.splits[group.rank]
        self.weight = nn.Parameter(torch.empty(self.num_local, hidden_size), requires_grad=False)
        self.quantized: QuantizedWeight | None = None  # once `quantize` ran: the rows, in int8

    def quantize(self) -> QuantizedWeight:
        """int8 rows replace the weight (layers/quantized.py); returned for a tied LM head."""
        self.quantized = int8_weight(*quantize_int8(self.weight.data))
        self.dtype = self.weight.dtype
        self.weight.data = torch.empty(0, dtype=self.dtype)
        return self.quantized

    def _rows(self, token_ids: torch.Tensor) -> torch.Tensor:
        if self.quantized is not None:
            return self.quantized.rows(token_ids, self.dtype)
        return nn.functional.embedding(token_ids, self.weight)

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        if self.group.world_size == 1:
            return self._rows(token_ids)
        local = token_ids - self.vocab_start
        outside = (local < 0) | (local >= self.num_local)
        rows = self._rows(local.masked_fill(outside, 0))
        # Exactly one rank owns each token: the sum over ranks is that rank's row.
        return self.group.all_reduce(rows.masked_fill(outside[:, None], 0.0))

    def weight_loader(self, param: nn.Parameter, full: torch.Tensor, shard=None) -> None:
        param.data.copy_(full[self.vocab_start : self.vocab_start + self.num_local])

    def gather_logits(self, local: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary logits from this rank's slice (`hidden @ local LM head rows`)."""
        return self.group.all_gather_last_dim(local, [size for _, size in self.splits])


class ParallelLMHead(nn.Module):
    """Untied LM head, sharded like the embedding."""

    def __init__(self, embedding: VocabParallelEmbedding, hidden_size: int):
        super().__init__()
        self.embedding = embedding
        self.weight = nn.Parameter(
            torch.empty(embedding.num_local, hidden_size), requires_grad=False
        )

    def weight_loader(self, param: nn.Parameter, full: torch.Tensor, shard=None) -> None:
        start = self.embedding.vocab_start
        param.data.copy_(full[start : start + self.embedding.num_local])
