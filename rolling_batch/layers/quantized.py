"""Weight-only int4 linears on CPU: 4-bit codes in groups of 32 input features, each group
with its own scale and zero (w = (q - 8) * scale + zero), multiplied by torch's CPU int4 GEMM
(`_weight_int4pack_mm_for_cpu`, the kernel torchao's int4 weight-only CPU path calls).

That kernel is fast with bf16 activations only (fp32 and fp16 take a slow fallback: 1.7 ms
and 2.6 ms against 60 us at one row for a 3072x576 weight here), so the input is rounded to
bf16, the scales and zeros are bf16, and the output is widened back to the model's dtype.
Measured against the packed fp32 oneDNN weight it replaces (benchmarks/README.md): ~5x faster
at 1 row, equal at about 32 rows, 10-15% slower at 64-128 rows. A decode step reads every
weight once, so a seventh of the bytes is what a small step gains; no dense copy is kept for
large steps, so a weight takes 0.5 bytes plus 4 bytes of scale and zero a group (0.625).
"""

from __future__ import annotations

import torch

GROUP_SIZE = 32  # GGUF's Q4_0/Q4_1 block; the kernel takes 32, 64, 128 or 256
_ROW_MULTIPLE = 16  # the packing wants output features in multiples of 16
_SCALE_DTYPE = torch.bfloat16  # the kernel reads scales and zeros in the activations' dtype


class Int4Weight:
    """A [out, in] weight as int4 codes; called like `linear(x, weight, bias)`."""

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor):
        """codes [out, in] in 0..15; scales and zeros [out, in / GROUP_SIZE]."""
        self.out_features, self.in_features = codes.shape
        pad = -self.out_features % _ROW_MULTIPLE  # padding rows are zeros: scale 0, zero 0
        codes = _pad_rows(codes.to(torch.int32), pad)
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
        pairs = torch.stack([_pad_rows(scales, pad), _pad_rows(zeros, pad)], dim=-1)
        # [in / GROUP_SIZE, out, 2], as the kernel reads them.
        self.scales_and_zeros = pairs.transpose(0, 1).contiguous().to(_SCALE_DTYPE)

    @classmethod
    def quantize(cls, weight: torch.Tensor) -> Int4Weight:
        return cls(*quantize_int4(weight))

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes + self.scales_and_zeros.nbytes

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(
            x.to(torch.bfloat16), self.packed, GROUP_SIZE, self.scales_and_zeros
        )
        out = out[:, : self.out_features].to(x.dtype)
        return out if bias is None else out + bias


def can_quantize_int4(weight: torch.Tensor) -> bool:
    return weight.device.type == "cpu" and weight.shape[1] % GROUP_SIZE == 0


def quantize_int4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes [out, in] in 0..15, scales, zeros [out, in / GROUP_SIZE]) for a weight, rounding
    to nearest: a group's min and max span codes 0..15 (what GGUF's Q4_1 stores). The scales
    and zeros are rounded to bf16 first and the codes chosen for the rounded ones."""
    out_features, in_features = weight.shape
    groups = weight.float().reshape(out_features, in_features // GROUP_SIZE, GROUP_SIZE)
    low, high = groups.amin(dim=-1), groups.amax(dim=-1)
    scales = ((high - low) / 15).to(_SCALE_DTYPE).float()
    zeros = (low + 8 * scales).to(_SCALE_DTYPE).float()  # (q - 8) * s + zero == q * s + low
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))  # a constant group: q = 8
    codes = ((groups - zeros[..., None]) / safe[..., None] + 8).round().clamp(0, 15)
    return codes.reshape(out_features, in_features).to(torch.uint8), scales, zeros


def dequantize_int4(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor):
    """The fp32 weight that int4 codes stand for: what a reference model computes with."""
    expand = lambda t: t.repeat_interleave(GROUP_SIZE, dim=1)  # noqa: E731
    return (codes.float() - 8) * expand(scales.to(_SCALE_DTYPE).float()) + expand(
        zeros.to(_SCALE_DTYPE).float()
    )


def _pad_rows(t: torch.Tensor, pad: int) -> torch.Tensor:
    return t if pad == 0 else torch.cat([t, t.new_zeros(pad, *t.shape[1:])])
