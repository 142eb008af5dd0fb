"""LoRA on the sharded linears, for a packed batch mixing adapters and the base model.

Each linear that adapters may modify holds `max_loras` slots. A slot holds one adapter's A and B
for each of the linear's projections (q, k and v of the fused QKV linear; gate and up; or the
one), zero-padded to `max_lora_rank`: all slots' A stacked as one matrix [slots x projections x
rank, in], and each projection's B as one [its outputs, slots x rank].

A step lists its segments once (LoraStep, shared by every layer): runs of consecutive tokens of
one adapter (a run an adapter: the scheduler puts the sequences of an adapter side by side).
Each linear then adds x_seg @ A_slot^T @ B_slot^T to every segment's outputs
(kernels/lora_segments.py: dense matmuls on row slices, a C++ loop on CPU), a segmented LoRA
matmul as Punica and S-LoRA compute it on GPUs. Base-model tokens cost nothing, and a token costs
its own adapter's rank only. An earlier form multiplied every token by all the slots' A and B and
masked the other slots' part away: its work grew with the adapters in a step
(benchmarks/log/).

Sharding follows the linear: a column-parallel linear has the whole A and its rows of B, a
row-parallel one its columns of A and the whole B, so its partial LoRA output joins the partial
matmul in the same all-reduce.
"""

from __future__ import annotations

import torch
from torch import nn

from lmserve.kernels.lora_segments import lora_add


class LoraStep:
    """What every LoRA linear reads during one step: the segments of consecutive tokens that use
    one adapter (its slot, first token, number of tokens); none when no token uses an adapter
    (the linears then skip LoRA entirely)."""

    def __init__(self):
        self.slots: list[int] = []
        self.token_starts: list[int] = []
        self.lengths: list[int] = []


class LoraSlots:
    def __init__(
        self,
        linear: nn.Module,
        num_slots: int,
        max_rank: int,
        step: LoraStep,
        dtype: torch.dtype,
        device: torch.device,
    ):
        self.linear = linear
        self.max_rank = max_rank
        self.step = step
        # Each projection's first output row in the linear's (local) output.
        sizes = linear.projection_sizes
        self.starts = [sum(sizes[:index]) for index in range(len(sizes))]
        self.a = torch.zeros(
            num_slots * len(sizes) * max_rank, linear.in_features, dtype=dtype, device=device
        )
        self.b = [
            torch.zeros(size, num_slots * max_rank, dtype=dtype, device=device) for size in sizes
        ]

    @property
    def num_bytes(self) -> int:
        return self.a.nbytes + sum(b.nbytes for b in self.b)

    def add_to(self, out: torch.Tensor, x: torch.Tensor) -> None:
        """Adds the step's adapters' part to the linear's output `out`, in place."""
        step = self.step
        segments = (step.slots, step.token_starts, step.lengths)
        lora_add(out, x, self.a, self.b, self.starts, *segments, self.max_rank)

    def clear(self, slot: int) -> None:
        width = len(self.b) * self.max_rank
        self.a[slot * width : (slot + 1) * width].zero_()
        for b in self.b:
            b[:, slot * self.max_rank : (slot + 1) * self.max_rank].zero_()

    def load(self, slot: int, projection, a: torch.Tensor, b: torch.Tensor) -> None:
        """One projection's A [r, in] and scaled B [out, r], whole (unsharded) as the adapter
        has them; `projection` is the shard id the linear's weight_loader takes (None for a
        linear with one projection)."""
        rank = a.shape[0]
        index = 0 if projection is None else self._projection_index(projection)
        a_start = (slot * len(self.b) + index) * self.max_rank
        a_local = self.a[a_start : a_start + rank]
        b_local = self.b[index][:, slot * self.max_rank : slot * self.max_rank + rank]
        if self.linear.shards_input:  # row-parallel: this rank's columns of A
            self.linear.weight_loader(a_local, a)
            b_local.copy_(b)
        else:  # column-parallel: this rank's rows of B, where the linear puts that projection
            a_local.copy_(a)
            sharded = torch.zeros(self.linear.out_features, rank, dtype=b.dtype)
            self.linear.weight_loader(sharded, b, projection)
            start, size = self.starts[index], self.b[index].shape[0]
            b_local.copy_(sharded[start : start + size])

    def _projection_index(self, projection) -> int:
        return projection if isinstance(projection, int) else "qkv".index(projection)
