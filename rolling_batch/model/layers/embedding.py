"""Vocab-parallel embedding and LM head: each rank holds a contiguous slice of the vocabulary.
A tied LM head reuses the embedding's slice."""

from __future__ import annotations

import torch
from torch import nn

from .parallel import TensorParallelGroup, balanced_split
from .quantized import QuantizedWeight, int8_parameters, int8_weight, quantize_int8


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

    def expect_int8(self) -> None:
        make_room_for_int8(self)

    def quantize(self) -> QuantizedWeight:
        """int8 rows replace the weight (layers/quantized.py); returned for a tied LM head."""
        self.dtype = self.weight.dtype
        self.quantized = take_int8(self)
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

    def expect_int8(self) -> None:
        make_room_for_int8(self)

    def weight_loader(self, param: nn.Parameter, full: torch.Tensor, shard=None) -> None:
        start = self.embedding.vocab_start
        param.data.copy_(full[start : start + self.embedding.num_local])


def make_room_for_int8(module: nn.Module) -> None:
    """The checkpoint brings `module.weight` as int8 codes and scales (GGUF's Q8_0): they load
    into its place through the module's `weight_loader` (rows slice alike). An empty stand-in
    keeps the dtype (and, moved with the module, the device) the layer computes in."""
    rows, columns = module.weight.shape
    dtype, device = module.weight.dtype, module.weight.device
    del module.weight
    module.register_buffer("weight", torch.empty(0, dtype=dtype, device=device), persistent=False)
    module.int8_codes, module.int8_scales = int8_parameters(rows, columns)


def take_int8(module: nn.Module) -> QuantizedWeight:
    """`module.weight` as int8, the checkpoint's own codes where it brought them; what stays
    of the weight is an empty tensor of its dtype."""
    if hasattr(module, "int8_codes"):
        weight = int8_weight(module.int8_codes.data, module.int8_scales.data)
        del module.int8_codes, module.int8_scales
        return weight
    weight = int8_weight(*quantize_int8(module.weight.data))
    module.weight.data = module.weight.new_empty(0)
    return weight
