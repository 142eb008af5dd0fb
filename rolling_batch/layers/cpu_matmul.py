"""Linear-layer weights in oneDNN's blocked layout for CPU inference.

`nn.functional.linear` re-lays out (bf16) or takes MKL's generic path (fp32, slow on AMD) on
every call; a weight reordered once is 1.5-3x faster for the small row counts of a decode
step here (benchmarks/README.md, performance log). The packed copy replaces the weight.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from .quantized import GROUP_SIZE, Int4Weight, can_quantize_int4

log = logging.getLogger(__name__)


class PackedWeight:
    """`weight` [out, in] reordered once; called like `linear(x, weight, bias)`."""

    def __init__(self, weight: torch.Tensor):
        self.dtype = weight.dtype
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed, bias, "none", [], "")


def try_pack(weight: torch.Tensor) -> PackedWeight | None:
    """None where oneDNN cannot take this weight (not on CPU, or fp16 on a CPU without
    AVX512-FP16): the caller keeps the plain matmul."""
    if weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return None
    try:
        return PackedWeight(weight)
    except RuntimeError as error:
        log.info("plain matmuls for %s weights: %s", weight.dtype, str(error).splitlines()[0])
        return None


class PackableLinear(nn.Module):
    """Base of the sharded linears: `matmul` uses the packed weight once `pack` succeeded."""

    weight: nn.Parameter
    packed: PackedWeight | Int4Weight | None = None

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.packed is None:
            return nn.functional.linear(x, self.weight, bias)
        return self.packed(x, bias)

    def pack(self, quantize: str | None = None) -> None:
        """`quantize`: None (oneDNN-packed, same dtype) or "int4" (layers/quantized.py)."""
        weight = self.weight.data
        if quantize == "int4" and can_quantize_int4(weight):
            self.packed = Int4Weight.quantize(weight)
        else:
            if quantize is not None:
                log.warning(
                    "%s: a %s weight stays dense (inputs no multiple of %d)",
                    quantize,
                    tuple(weight.shape),
                    GROUP_SIZE,
                )
            self.packed = try_pack(weight)
        if self.packed is not None:  # the packed copy replaces the weight: no doubled memory
            self.weight.data = torch.empty(0, dtype=self.weight.dtype)
