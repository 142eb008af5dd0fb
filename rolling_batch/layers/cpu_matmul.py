"""Linear-layer weights in oneDNN's blocked layout for CPU inference.

`nn.functional.linear` re-lays out (bf16) or takes MKL's generic path (fp32, slow on AMD) on
every call; a weight reordered once is 1.5-3x faster for the small row counts of a decode
step here (benchmarks/README.md, performance log). The packed copy replaces the weight.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from .lora import LoraSlots
from .quantized import (
    GROUP_SIZE,
    QuantizedWeight,
    can_quantize,
    frozen,
    int4_weight,
    int8_parameters,
    int8_weight,
    quantize_int4,
    quantize_int8,
)

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
    """Base of the sharded linears: `matmul` uses the packed weight once `pack` succeeded, and
    adds the step's LoRA adapters' part when the model serves adapters (layers/lora.py)."""

    weight: nn.Parameter
    in_features: int  # of this rank's shard
    out_features: int
    shards_input = False  # row-parallel: the input features are split across the ranks
    packed: PackedWeight | QuantizedWeight | None = None
    in_start = 0  # of this rank's shard among the layer's inputs (row-parallel: see RowLinear)
    int4_group_size: int | None = None  # set when the checkpoint brings int4 codes
    int8_from_checkpoint = False  # ... or int8 codes
    lora: LoraSlots | None = None

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.packed is None:
            out = nn.functional.linear(x, self.weight, bias)
        else:
            out = self.packed(x, bias)
        if self.lora is not None and self.lora.step.slots:
            self.lora.add_to(out, x)
        return out

    @property
    def projection_sizes(self) -> list[int]:
        """The output rows of each projection, side by side (fused linears have several)."""
        return [self.out_features]

    def expect_int4(self, group_size: int) -> None:
        """The checkpoint brings this layer as int4 codes with a scale and zero a group of
        `group_size` inputs (AWQ, GPTQ: rolling_batch/quantized_checkpoint.py; GGUF's Q4).
        They take the weight's place and load through the same `weight_loader`: output rows
        slice alike, and a row-parallel shard's inputs must start and end on a group
        boundary."""
        out_features, in_features = self._make_room_for_groups(group_size)
        self.int4_group_size = group_size
        self.int4_codes = frozen(torch.empty(out_features, in_features, dtype=torch.uint8))
        groups = in_features // group_size
        self.int4_scales = frozen(torch.empty(out_features, groups, dtype=torch.float32))
        self.int4_zeros = frozen(torch.empty(out_features, groups, dtype=torch.float32))

    def expect_int8(self) -> None:
        """As `expect_int4`, for int8 codes with a scale a group of GROUP_SIZE inputs (GGUF's
        Q8_0)."""
        out_features, in_features = self._make_room_for_groups(GROUP_SIZE)
        self.int8_from_checkpoint = True
        self.int8_codes, self.int8_scales = int8_parameters(out_features, in_features)

    def _make_room_for_groups(self, group_size: int) -> tuple[int, int]:
        out_features, in_features = self.weight.shape
        if in_features % group_size or self.in_start % group_size:
            raise ValueError(
                f"inputs [{self.in_start}, {self.in_start + in_features}) of this rank's shard"
                f" split the checkpoint's groups of {group_size} inputs"
            )
        del self.weight
        return out_features, in_features

    def pack(self, quantize: str | None = None) -> None:
        """`quantize`: None (oneDNN-packed, same dtype, on CPU; a GPU keeps the weight), "int4"
        or "int8" (layers/quantized.py, CPU or GPU). Int4 codes from the checkpoint are packed
        as they are, int8 codes too."""
        if self.int4_group_size is not None:
            parts = (self.int4_codes, self.int4_scales, self.int4_zeros)
            self.packed = int4_weight(*(p.data for p in parts), self.int4_group_size)
            del self.int4_codes, self.int4_scales, self.int4_zeros
            return
        if self.int8_from_checkpoint:
            self.packed = int8_weight(self.int8_codes.data, self.int8_scales.data)
            del self.int8_codes, self.int8_scales
            return
        weight = self.weight.data
        if quantize is not None and can_quantize(weight):
            if quantize == "int4":
                self.packed = int4_weight(*quantize_int4(weight))
            else:
                self.packed = int8_weight(*quantize_int8(weight))
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
            self.weight.data = self.weight.new_empty(0)
