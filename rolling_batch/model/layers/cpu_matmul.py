"""Linear-layer weights laid out once for CPU inference.

fp32 weights go to the C++ kernels' panel layout (`kernels/csrc/panel_linear.h`,
`packed_linear`), which prefetches the weight stream: 1.3-1.7x oneDNN's packed matmul at the
1-64 rows of a decode step, level with it at prefill sizes; so do bf16 weights where the CPU
has AVX512-BF16 (`bf16_panels()`). Other dtypes (fp16, bf16 elsewhere), and fp32 where the
kernels are not built, take oneDNN's blocked layout: `nn.functional.linear`
re-lays out (bf16) or takes MKL's generic path (fp32, slow on AMD) on every call, and a weight
reordered once is 1.5-3x faster for a decode step's rows. Either packed copy replaces the
weight (benchmarks/log/).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from lmserve.kernels import cpu_native

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


class NativeLinearWeight:
    """An fp32 (or bf16, see `panels_take`) `weight` [out, in] in the C++ kernels' panels;
    called like `linear(x, weight, bias)`."""

    def __init__(self, weight: torch.Tensor, native):
        self.out_features = weight.shape[0]
        self.native = native
        self.packed = native.pack_linear_weight(weight)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        out = self.native.packed_linear(rows, self.packed, self.out_features, bias)
        return out.view(*x.shape[:-1], self.out_features)


class NativeGatedWeight:
    """A gate and up projection `weight` [2 * n, in] (gate's rows, then up's) in the C++
    kernels' paired panels. Called like `linear(x, weight, bias)` it gives [gate | up];
    `silu_and_mul` gives silu(gate) * up from the same pass without writing gate and up out.
    Either gives the bits of the plain panels (and silu_and_mul after them)."""

    def __init__(self, weight: torch.Tensor, native):
        self.intermediate = weight.shape[0] // 2
        self.native = native
        self.packed = native.pack_gated_weight(weight)

    def _gated(self, x: torch.Tensor, bias: torch.Tensor | None, fused: bool) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        out = self.native.gated_linear(rows, self.packed, self.intermediate, bias, fused)
        return out.view(*x.shape[:-1], out.shape[-1])

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return self._gated(x, bias, fused=False)

    def silu_and_mul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return self._gated(x, bias, fused=True)


DenseWeight = PackedWeight | NativeLinearWeight | NativeGatedWeight


def panels_take(weight: torch.Tensor, native) -> bool:
    """The C++ panels multiply fp32 weights, and bf16 ones in pairs of inputs where the CPU
    has AVX512-BF16."""
    if weight.dtype == torch.bfloat16:
        return native.bf16_panels() and weight.shape[1] % 2 == 0
    return weight.dtype == torch.float32


def try_pack(weight: torch.Tensor, gated: bool = False) -> DenseWeight | None:
    """The fastest packed form for `weight`, or None where neither the C++ kernels (fp32,
    bf16 with AVX512-BF16) nor oneDNN can take it (not on CPU, or fp16 on a CPU without
    AVX512-FP16): the caller keeps the plain matmul. `gated`: the weight is [gate; up], for the
    C++ kernels' paired panels."""
    if weight.device.type != "cpu":
        return None
    native = cpu_native.native_ops()
    if native is not None and panels_take(weight, native):
        kind = NativeGatedWeight if gated else NativeLinearWeight
        return kind(weight, native)
    if not torch.backends.mkldnn.is_available():
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
    packed: DenseWeight | QuantizedWeight | None = None
    in_start = 0  # of this rank's shard among the layer's inputs (row-parallel: see RowLinear)
    int4_group_size: int | None = None  # set when the checkpoint brings int4 codes
    int8_from_checkpoint = False  # ... or int8 codes
    gated = False  # the outputs are [gate | up] for silu(gate) * up (SwiGLU)
    lora: LoraSlots | None = None

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.packed is None:
            out = nn.functional.linear(x, self.weight, bias)
        else:
            out = self.packed(x, bias)
        if self.adapters_active:
            self.lora.add_to(out, x)
        return out

    @property
    def adapters_active(self) -> bool:
        """LoRA adapters add to this step's outputs."""
        return self.lora is not None and bool(self.lora.step.slots)

    @property
    def projection_sizes(self) -> list[int]:
        """The output rows of each projection, side by side (fused linears have several)."""
        return [self.out_features]

    def expect_int4(self, group_size: int) -> None:
        """The checkpoint brings this layer as int4 codes with a scale and zero a group of
        `group_size` inputs (AWQ, GPTQ: model/weights/quantized_checkpoint.py; GGUF's Q4).
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
        """`quantize`: None (packed, same dtype, on CPU; a GPU keeps the weight), "int4"
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
            self.packed = try_pack(weight, self.gated)
        if self.packed is not None:  # the packed copy replaces the weight: no doubled memory
            self.weight.data = self.weight.new_empty(0)
