"""Pure-torch reference for the Triton weight-only matmul (weight_only_matmul_triton.py), in the
same layouts: int4 codes two a byte along the inputs (input 2j in byte j's low nibble) with a
scale and zero a group, w = (q - 8) * scale + zero; int8 codes with a scale a group, w = q * scale.
The weight is widened to fp32, rounded to the activations' dtype (as the kernel feeds its dot),
and the products are summed in fp32."""

from __future__ import annotations

import torch


def unpack_int4(codes: torch.Tensor) -> torch.Tensor:
    """[out, in / 2] uint8, two codes a byte -> [out, in] codes 0..15."""
    return torch.stack([codes & 15, codes >> 4], dim=-1).reshape(codes.shape[0], -1)


def dequantized_weight(codes, scales, zeros, group_size: int) -> torch.Tensor:
    """The fp32 [out, in] weight the codes stand for (int4 when `zeros` is given, else int8)."""
    expand = lambda t: t.float().repeat_interleave(group_size, dim=1)  # noqa: E731
    if zeros is None:
        return codes.float() * expand(scales)
    return (unpack_int4(codes).float() - 8) * expand(scales) + expand(zeros)


def weight_only_matmul_reference(x, codes, scales, zeros, group_size: int, bias=None):
    weight = dequantized_weight(codes, scales, zeros, group_size).to(x.dtype)
    out = x.float() @ weight.float().T
    if bias is not None:
        out += bias.float()
    return out.to(x.dtype)
