"""LoRA for a packed batch mixing adapters: each token through its own adapter, the tokens of
one adapter taken together (a segmented LoRA matmul, as Punica's SGMV and S-LoRA do on GPUs).

The tokens that use an adapter come in segments, runs of consecutive tokens with one slot
(`slots`, `token_starts`, `lengths`: the scheduler puts a step's sequences of one adapter side by
side, so a step has a segment an adapter). For each segment the shrink x_seg @ A_slot^T and, per
projection of a fused linear, the expand h_seg @ B_slot^T are dense matmuls of just those rows,
the expand added in place to the projection's output columns of those rows. Tokens outside the
segments (the base model's) cost nothing. On CPU the C++ op (cpu_native) runs the same loop
without a Python call per segment; the pure-torch reference here is the fallback and what the op
is tested against.
"""

from __future__ import annotations

import torch

from . import cpu_native


def lora_add_reference(
    out: torch.Tensor,  # [T, out] the linear's output, added to in place
    x: torch.Tensor,  # [T, in]
    a: torch.Tensor,  # [slots x P x rank, in]: slot after slot, projection after projection
    bs: list[torch.Tensor],  # P x [projection's outputs, slots x rank]
    starts: list[int],  # each projection's first output column in `out`
    slots: list[int],  # each segment's slot
    token_starts: list[int],  # each segment's first token
    lengths: list[int],  # each segment's number of tokens
    rank: int,
) -> None:
    width = len(bs) * rank
    for slot, first, length in zip(slots, token_starts, lengths):
        rows = slice(first, first + length)
        low_rank = x[rows] @ a[slot * width : (slot + 1) * width].t()
        for index, (b, start) in enumerate(zip(bs, starts)):
            part = low_rank[:, index * rank : (index + 1) * rank]
            columns = slice(start, start + b.shape[0])
            out[rows, columns].addmm_(part, b[:, slot * rank : (slot + 1) * rank].t())


def lora_add(out, x, a, bs, starts, slots, token_starts, lengths, rank) -> None:
    """`lora_add_reference`'s result, through the C++ op where there is one."""
    native = cpu_native.ops_for(x)
    if native is not None:
        native.lora_add_(out, x, a, bs, starts, slots, token_starts, lengths, rank)
    else:
        lora_add_reference(out, x, a, bs, starts, slots, token_starts, lengths, rank)
