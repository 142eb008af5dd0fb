"""Weight-only quantized weights on CPU.

Int4: 4-bit codes in groups of 32 input features, each group with its own scale and zero
(w = (q - 8) * scale + zero), multiplied by torch's CPU int4 GEMM (`_weight_int4pack_mm_for_cpu`,
the kernel torchao's int4 weight-only CPU path calls).

That kernel is fast with bf16 activations only (fp32 and fp16 take a slow fallback: 1.7 ms
and 2.6 ms against 60 us at one row for a 3072x576 weight here), so the input is rounded to
bf16, the scales and zeros are bf16, and the output is widened back to the model's dtype.
Measured against the packed fp32 oneDNN weight it replaces
(benchmarks/log/2026-11-23-prefix-quantize-lora-tp.md): ~5x faster at 1 row, equal at about
32 rows, 10-15% slower at 64-128 rows and 2.4x slower at 2,048. A decode step reads every
weight once, so a small step gains from reading about a sixth of
fp32's bytes. A big step is compute bound: where the CPU has native bf16 it widens the whole
weight to bf16 (a C++ kernel, `int4_dequantize`, 0.4 ms for 3072 x 576; the weights are then
rounded to bf16 too, a relative 2^-9) and multiplies with oneDNN's bf16 matmul
(`dense_from_rows`); elsewhere (AVX2: the int4 kernel's bf16 is emulated too) it widens to fp32
from 64 rows (`_int4_dense_dtype`). No dense copy is kept, so a weight takes 0.5 bytes plus 4
bytes of scale and zero a group (0.625).

Int8: GGUF's Q8_0 layout, int8 codes with one fp32 scale a group of 32 (1.125 bytes a weight),
for every linear with option.quantize=int8, and with int4 too for the LM head and the embedding
it is tied to: the largest matrix of a small model, read whole by every decode step, and where
an error lands on every logit directly. The C++ kernel (`int8_linear`,
kernels/csrc/quantized_linear.h) widens each group's codes in registers for 8 rows of x at a
time; against the packed fp32 weight of SmolLM2's LM head (49152 x 576, 2 threads) it took
1.4 / 3.6 / 7.0 / 12.6 ms at 1 / 8 / 16 / 32 rows against 5.0 / 5.5 / 7.0 / 10.6 ms. Big
steps widen the weight to the activations' dtype and multiply it densely (in fp32, exactly the
dequantized weight). Without the C++ kernels, dense matmuls run on blocks dequantized in turn.
"""

from __future__ import annotations

import functools
import math
from typing import Protocol

import torch

from lmserve.kernels import cpu_native

GROUP_SIZE = 32  # GGUF's Q4_0/Q4_1 block, and what option.quantize makes
KERNEL_GROUP_SIZES = (256, 128, 64, 32)  # what the int4 kernel takes (checkpoints bring theirs)
# The packing wants output features in multiples of 16, and lays out blocks of 64 or 32 outputs
# (a partial last block differently), which int4_dequantize reads: whole blocks only.
_ROW_MULTIPLE = 64
_SCALE_DTYPE = torch.bfloat16  # the kernel reads scales and zeros in the activations' dtype
_INT8_BLOCK = 4096  # output features dequantized at once (9 MiB of fp32 at 576 inputs)
_DENSE_BF16_FROM_ROWS = 32  # see dense_from_rows
_DENSE_FP32_FROM_ROWS = 128
_INT4_DENSE_FP32_FROM_ROWS = 64  # see _int4_dense_dtype


class QuantizedWeight(Protocol):
    """What the linears call: an int4 or int8 weight, on CPU or GPU."""

    bits: int
    out_features: int
    in_features: int

    @property
    def nbytes(self) -> int: ...

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor: ...


class Int4Weight:
    """A [out, in] weight as int4 codes; called like `linear(x, weight, bias)`."""

    bits = 4

    def __init__(
        self,
        codes: torch.Tensor,
        scales: torch.Tensor,
        zeros: torch.Tensor,
        group_size: int = GROUP_SIZE,
    ):
        """codes [out, in] in 0..15; scales and zeros [out, in / group_size]."""
        assert group_size in KERNEL_GROUP_SIZES, group_size
        self.out_features, self.in_features = codes.shape
        self.group_size = group_size
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
        native = cpu_native.ops_for(x)
        widen_to = _int4_dense_dtype(x.shape[0]) if native is not None else None
        if widen_to is not None:
            # A big step: the whole weight widened for one dense matmul.
            parts = (self.packed, self.scales_and_zeros, self.group_size)
            like = x.new_empty(0, dtype=widen_to)
            dense = native.int4_dequantize(*parts, like, torch_int4_block())
            out = torch.matmul(x.to(widen_to), dense)
        else:
            out = torch.ops.aten._weight_int4pack_mm_for_cpu(
                x.to(torch.bfloat16), self.packed, self.group_size, self.scales_and_zeros
            )
        out = out[:, : self.out_features].to(x.dtype)
        return out if bias is None else out + bias


class Int8Weight:
    """A [out, in] weight as int8 codes, a scale a group; called like `linear(x, weight)`."""

    bits = 8

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor):
        """codes [out, in] int8; scales [out, in / GROUP_SIZE] (w = code * scale)."""
        self.codes = codes.to(torch.int8).contiguous()
        self.scales = scales.float().contiguous()
        self.out_features, self.in_features = codes.shape

    @classmethod
    def quantize(cls, weight: torch.Tensor) -> Int8Weight:
        return cls(*quantize_int8(weight))

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + self.scales.nbytes

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows `ids` of the weight (an embedding lookup)."""
        return dequantize_int8(self.codes[ids], self.scales[ids]).to(dtype)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        native = cpu_native.ops_for(x)
        if native is not None and x.shape[0] >= dense_from_rows(x.dtype):
            # A big step: the weight widened to the activations' dtype, one dense matmul.
            out = torch.nn.functional.linear(x, native.int8_dequantize(self.codes, self.scales, x))
        elif native is not None:
            out = native.int8_linear(x, self.codes, self.scales)
        else:
            blocks = []
            for start in range(0, self.out_features, _INT8_BLOCK):
                end = start + _INT8_BLOCK
                weight = dequantize_int8(self.codes[start:end], self.scales[start:end])
                blocks.append(torch.nn.functional.linear(x, weight.to(x.dtype)))
            out = torch.cat(blocks, dim=-1)
        return out if bias is None else out + bias


def on_cpu(codes: torch.Tensor) -> bool:
    """Whether a weight whose codes are on `codes`' device takes the CPU kernels (else the
    GPU's; the tests run those on CPU tensors through Triton's interpreter)."""
    return codes.device.type == "cpu"


def int4_weight(codes, scales, zeros, group_size: int = GROUP_SIZE):
    """The int4 weight for the device the codes are on: `Int4Weight` on CPU, else the Triton
    kernel's (layers/quantized_gpu.py)."""
    if on_cpu(codes):
        return Int4Weight(codes, scales, zeros, group_size)
    from .quantized_gpu import GpuInt4Weight

    return GpuInt4Weight(codes, scales, zeros, group_size)


def int8_weight(codes, scales):
    """As `int4_weight`, for int8 codes."""
    if on_cpu(codes):
        return Int8Weight(codes, scales)
    from .quantized_gpu import GpuInt8Weight

    return GpuInt8Weight(codes, scales)


def dense_from_rows(dtype: torch.dtype) -> int | float:
    """Steps of at least this many rows widen quantized weights to `dtype` (a C++ kernel) and
    multiply them densely: int4 in bf16 (its kernel's activations), int8 in the model's dtype.
    Measured (3072 x 576, 2 threads, AMX Xeon; ms at 16 / 32 / 256 / 2,048 rows):
    - int4 widened to bf16 (0.42 ms) + bf16 matmul 0.73 / 0.62 / 0.91 / 3.3 against the int4
      kernel's 0.55 / 0.85 / 5.5 / 52 (fp32's packed weight: 0.33 / 0.43 / 3.2 / 22);
    - int8 widened to fp32 (0.46 ms) + fp32 matmul 0.64 / 0.82 / 3.5 / 21 against the int8
      kernel's 0.32 / 0.73 / 5.5 / 45 (level at 64 rows); widened to bf16 (0.18 ms) 0.39 /
      0.40 / 0.81 / 3.2.
    Where bf16 is emulated (no AVX512-BF16 or AMX), never in bf16."""
    if dtype == torch.float32:
        return _DENSE_FP32_FROM_ROWS
    if dtype == torch.bfloat16 and cpu_native.cpu_has_native_bf16():
        return _DENSE_BF16_FROM_ROWS
    return math.inf


def _int4_dense_dtype(rows: int) -> torch.dtype | None:
    """The dtype a step of `rows` widens int4 weights to (None: the int4 kernel serves it):
    bf16 from 32 rows where the CPU has it; elsewhere fp32 from _INT4_DENSE_FP32_FROM_ROWS.
    Measured with native bf16 set aside (3072 x 576, 2 threads, AMX Xeon; ms at 48 / 64 /
    256 / 2,048 rows): widened to fp32 (0.6 ms) + fp32 matmul 1.32 / 1.30 / 4.05 / 23.5
    against the int4 kernel's 1.23 / 1.58 / 5.65 / 47.1. An AVX2-only CPU, whose int4 kernel
    emulates bf16 in half-width vectors, is not measured."""
    if rows >= dense_from_rows(torch.bfloat16):
        return torch.bfloat16
    if not cpu_native.cpu_has_native_bf16() and rows >= _INT4_DENSE_FP32_FROM_ROWS:
        return torch.float32
    return None


def can_quantize(weight: torch.Tensor) -> bool:
    return weight.shape[1] % GROUP_SIZE == 0


def quantize_int4(
    weight: torch.Tensor, group_size: int = GROUP_SIZE
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes [out, in] in 0..15, scales, zeros [out, in / group_size]) for a weight, rounding
    to nearest: a group's min and max span codes 0..15 (what GGUF's Q4_1 stores). The scales
    and zeros are rounded to bf16 first and the codes chosen for the rounded ones."""
    out_features, in_features = weight.shape
    groups = weight.float().reshape(out_features, in_features // group_size, group_size)
    low, high = groups.amin(dim=-1), groups.amax(dim=-1)
    scales = ((high - low) / 15).to(_SCALE_DTYPE).float()
    zeros = (low + 8 * scales).to(_SCALE_DTYPE).float()  # (q - 8) * s + zero == q * s + low
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))  # a constant group: q = 8
    codes = ((groups - zeros[..., None]) / safe[..., None] + 8).round().clamp(0, 15)
    return codes.reshape(out_features, in_features).to(torch.uint8), scales, zeros


def dequantize_int4(
    codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int = GROUP_SIZE
):
    """The fp32 weight that int4 codes stand for: what a reference model computes with."""
    expand = lambda t: t.repeat_interleave(group_size, dim=1)  # noqa: E731
    return (codes.float() - 8) * expand(scales.to(_SCALE_DTYPE).float()) + expand(
        zeros.to(_SCALE_DTYPE).float()
    )


def frozen(tensor: torch.Tensor) -> torch.nn.Parameter:
    return torch.nn.Parameter(tensor, requires_grad=False)


def int8_parameters(rows: int, columns: int) -> tuple[torch.nn.Parameter, torch.nn.Parameter]:
    """Empty int8 codes [rows, columns] and their scales, for a checkpoint's to load into."""
    codes = torch.empty(rows, columns, dtype=torch.int8)
    return frozen(codes), frozen(torch.empty(rows, columns // GROUP_SIZE, dtype=torch.float32))


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes [out, in] int8, scales [out, in / GROUP_SIZE]): Q8_0's rounding, each group's
    largest magnitude at code +-127."""
    out_features, in_features = weight.shape
    groups = weight.float().reshape(out_features, in_features // GROUP_SIZE, GROUP_SIZE)
    scales = groups.abs().amax(dim=-1) / 127
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))  # an all-zero group: 0
    codes = (groups / safe[..., None]).round().clamp(-127, 127)
    return codes.reshape(out_features, in_features).to(torch.int8), scales


def dequantize_int8(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return codes.float() * scales.repeat_interleave(GROUP_SIZE, dim=-1)


def _pad_rows(t: torch.Tensor, pad: int) -> torch.Tensor:
    return t if pad == 0 else torch.cat([t, t.new_zeros(pad, *t.shape[1:])])


@functools.cache
def torch_int4_block() -> int:
    """The outputs a block of torch's CPU int4 packing holds here: 64 where torch runs its
    AVX-512 code, 32 on an AVX2-only CPU. Read off the packing of one code at output 32: the
    high half of the first byte in a block of 64, the second block's first byte otherwise."""
    codes = torch.zeros(64, 64, dtype=torch.int32)
    codes[32, 0] = 1
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1).reshape(-1)
    return 64 if int(packed[0]) == 0x10 else 32
