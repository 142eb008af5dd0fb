"""LoRA for a packed batch mixing adapters: each token through its own adapter, the adapters'
tokens taken together (a segmented LoRA matmul, as Punica's SGMV and S-LoRA do on GPUs).

The tokens that use an adapter are listed by slot (`order`: their indices, the tokens of one slot
together, `slots`/`lengths`: each segment's slot and length). For every segment the shrink
x_seg @ A_slot^T and, per projection of a fused linear, the expand h_seg @ B_slot^T are dense
matmuls of just those tokens; the result is added to the projection's output rows of the tokens
it came from. Base-model tokens cost nothing. On CPU the C++ op (cpu_native) runs the same loop
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
    starts: list[int],  # each projection's first output row in `out`
    order: torch.Tensor,  # [N] int64, tokens with an adapter, grouped by slot
    slots: list[int],  # each segment's slot
    lengths: list[int],  # each segment's number of tokens
    rank: int,
) -> None:
    width = len(bs) * rank
    picked = x.index_select(0, order)
    low_rank = torch.empty(len(order), width, dtype=x.dtype, device=x.device)
    for begin, slot, length in _segments(slots, lengths):
        rows = slice(begin, begin + length)
        torch.mm(picked[rows], a[slot * width : (slot + 1) * width].t(), out=low_rank[rows])
    for index, (b, start) in enumerate(zip(bs, starts)):
        part = low_rank[:, index * rank : (index + 1) * rank]
        expanded = torch.empty(len(order), b.shape[0], dtype=x.dtype, device=x.device)
        for begin, slot, length in _segments(slots, lengths):
            rows = slice(begin, begin + length)
            torch.mm(part[rows], b[:, slot * rank : (slot + 1) * rank].t(), out=expanded[rows])
        out[:, start : start + b.shape[0]].index_add_(0, order, expanded)


def lora_add(out, x, a, bs, starts, order, slots, lengths, rank) -> None:
    """`lora_add_reference`'s result, through the C++ op where there is one."""
    native = cpu_native.ops_for(x)
    if native is not None:
        native.lora_add_(out, x, a, bs, starts, order, slots, lengths, rank)
    else:
        lora_add_reference(out, x, a, bs, starts, order, slots, lengths, rank)


def _segments(slots: list[int], lengths: list[int]):
    begin = 0
    for slot, length in zip(slots, lengths):
        yield begin, slot, length
        begin += length
