"""LoRA on the sharded linears, for a packed batch mixing adapters and the base model.

Each linear that adapters may modify holds `max_loras` slots. A slot holds one adapter's A and B
for each of the linear's projections (q, k and v of the fused QKV linear; gate and up; or the
one), zero-padded to `max_lora_rank`. Stacked slot after slot, all slots' A are one matrix
[slots x projections x rank, in] and all B one [out, slots x projections x rank], so a step adds

    ((x @ A_all^T) * mask) @ B_all^T

to the linear's output: two matmuls for the whole batch, whatever its mix. `mask` [tokens,
slots, 1] is 1 where a token's adapter sits in that slot and 0 elsewhere (a base-model token's
row is all zeros), built once per step and shared by every layer (LoraStep). This is the
masked form of a segmented LoRA matmul (Punica's SGMV, S-LoRA): on a CPU with a few adapters
per step one dense matmul through oneDNN beats per-adapter pieces, and it costs work in
proportion to the slots in use (the step uses slots 0..n-1 only). A projection's B rows outside
its own output rows are zero in the fused linears.

Sharding follows the linear: a column-parallel linear has the whole A and its rows of B, a
row-parallel one its columns of A and the whole B, so its partial LoRA output joins the partial
matmul in the same all-reduce.
"""

from __future__ import annotations

import torch
from torch import nn


class LoraStep:
    """What every LoRA linear reads during one step: the token-to-slot mask, or None when no
    token of the step uses an adapter (the linears then skip LoRA entirely)."""

    def __init__(self):
        self.mask: torch.Tensor | None = None  # [tokens, slots in use, 1]


class LoraSlots:
    def __init__(
        self,
        linear: nn.Module,
        num_projections: int,
        num_slots: int,
        max_rank: int,
        step: LoraStep,
        dtype: torch.dtype,
        device: torch.device,
    ):
        self.linear = linear
        self.num_projections = num_projections
        self.max_rank = max_rank
        self.step = step
        width = num_slots * num_projections * max_rank
        self.a = torch.zeros(width, linear.in_features, dtype=dtype, device=device)
        self.b = torch.zeros(linear.out_features, width, dtype=dtype, device=device)

    @property
    def num_bytes(self) -> int:
        return self.a.nbytes + self.b.nbytes

    def delta(self, x: torch.Tensor) -> torch.Tensor:
        mask = self.step.mask
        num_tokens, num_slots = mask.shape[0], mask.shape[1]
        width = num_slots * self.num_projections * self.max_rank
        low_rank = nn.functional.linear(x, self.a[:width]).view(num_tokens, num_slots, -1)
        return nn.functional.linear((low_rank * mask).view(num_tokens, width), self.b[:, :width])

    def clear(self, slot: int) -> None:
        width = self.num_projections * self.max_rank
        self.a[slot * width : (slot + 1) * width].zero_()
        self.b[:, slot * width : (slot + 1) * width].zero_()

    def load(self, slot: int, projection, a: torch.Tensor, b: torch.Tensor) -> None:
        """One projection's A [r, in] and scaled B [out, r], whole (unsharded) as the adapter
        has them; `projection` is the shard id the linear's weight_loader takes (None for a
        linear with one projection)."""
        rank = a.shape[0]
        index = 0 if projection is None else self._projection_index(projection)
        start = (slot * self.num_projections + index) * self.max_rank
        a_local = self.a[start : start + rank]
        b_local = self.b[:, start : start + rank]
        if self.linear.shards_input:  # row-parallel: this rank's columns of A
            self.linear.weight_loader(a_local, a)
            b_local.copy_(b)
        else:  # column-parallel: this rank's rows of B, where the linear puts that projection
            a_local.copy_(a)
            sharded = torch.zeros_like(b_local)
            self.linear.weight_loader(sharded, b, projection)
            b_local.copy_(sharded)

    def _projection_index(self, projection) -> int:
        return projection if isinstance(projection, int) else "qkv".index(projection)
