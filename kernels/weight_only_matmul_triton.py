"""Triton kernel for weight-only quantized linears on a GPU: `x @ W.T (+ bias)` where W is held
as int4 or int8 codes with a scale (and for int4 a zero) a group of inputs, and widened tile by
tile inside the kernel, so a step reads 0.5 (int4) or 1 (int8) byte a weight plus the groups'
scales instead of 2-4.

Layouts (what `layers/quantized_gpu.py` builds):
- int4: codes [out, in / 2] uint8, input 2j in the low nibble of byte j and 2j + 1 in the high
  one; w = (q - 8) * scale + zero (the CPU int4 linears' convention, so AWQ, GPTQ and GGUF
  codes load unchanged).
- int8: codes [out, in] int8; w = q * scale (GGUF's Q8_0).
- scales and zeros: [out, in / group_size] fp32.

Each program computes a BLOCK_M x BLOCK_N tile of the output, accumulating in fp32; the widened
weight tile is cast to the activations' dtype for `tl.dot` (fp32 activations use IEEE fp32
products, not TF32, so an fp32 model multiplies by exactly the dequantized weight). The
pure-torch reference: kernels/weight_only_matmul.py.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

# Triton's CPU interpreter (the tests') gets bf16 `tl.dot` wrong (2.7e10 off on a 16x16
# product, triton 3.7.1; fp16 and fp32 are right): there the dot runs in fp32 on the
# bf16-rounded operands, which is the same sum of the same exact products.
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
_BLOCK_N = 64
_BLOCK_K = 32  # divides every group size served (32..256) and every in_features


@triton.jit
def _weight_only_matmul_kernel(
    x_ptr,
    codes_ptr,
    scales_ptr,
    zeros_ptr,
    bias_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_codes_n,
    stride_scales_n,
    stride_om,
    GROUP_SIZE: tl.constexpr,
    BITS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    IEEE_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < M
    col_ok = cols < N
    accumulator = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k_start in range(0, K, BLOCK_K):
        inputs = k_start + tl.arange(0, BLOCK_K)
        input_ok = inputs < K
        x = tl.load(
            x_ptr + rows[:, None].to(tl.int64) * stride_xm + inputs[None, :],
            mask=row_ok[:, None] & input_ok[None, :],
            other=0.0,
        )
        # The weight tile transposed: [BLOCK_K inputs, BLOCK_N outputs].
        tile_ok = input_ok[:, None] & col_ok[None, :]
        weight_rows = cols[None, :].to(tl.int64)
        if BITS == 4:
            byte = tl.load(
                codes_ptr + weight_rows * stride_codes_n + inputs[:, None] // 2,
                mask=tile_ok,
                other=0,
            ).to(tl.int32)
            codes = ((byte >> ((inputs[:, None] % 2) * 4)) & 15).to(tl.float32) - 8.0
        else:
            codes = tl.load(
                codes_ptr + weight_rows * stride_codes_n + inputs[:, None], mask=tile_ok, other=0
            ).to(tl.float32)
        group_offsets = weight_rows * stride_scales_n + inputs[:, None] // GROUP_SIZE
        weight = codes * tl.load(scales_ptr + group_offsets, mask=tile_ok, other=0.0)
        if BITS == 4:
            weight += tl.load(zeros_ptr + group_offsets, mask=tile_ok, other=0.0)
        weight = weight.to(x.dtype)  # what a dot in x's dtype multiplies
        if IEEE_DOT:
            accumulator += tl.dot(x.to(tl.float32), weight.to(tl.float32), input_precision="ieee")
        else:
            accumulator += tl.dot(x, weight)
    if HAS_BIAS:
        accumulator += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(
        out_ptr + rows[:, None].to(tl.int64) * stride_om + cols[None, :],
        accumulator.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None] & col_ok[None, :],
    )


def weight_only_matmul(
    x: torch.Tensor,
    codes: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    group_size: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [rows, in] (fp32, fp16 or bf16) times the quantized [out, in] weight: int4 when `zeros`
    is given (codes [out, in / 2] uint8), else int8 (codes [out, in] int8). Returns
    [rows, out] in x's dtype."""
    bits = 4 if zeros is not None else 8
    x = x.contiguous()
    rows, in_features = x.shape
    out_features = codes.shape[0]
    assert codes.shape[1] * (2 if bits == 4 else 1) == in_features, (codes.shape, x.shape)
    assert in_features % group_size == 0 and group_size % _BLOCK_K == 0, group_size
    out = torch.empty(rows, out_features, dtype=x.dtype, device=x.device)
    if rows == 0:
        return out
    block_m = 16 if rows <= 16 else 32 if rows <= 32 else 64
    grid = (triton.cdiv(rows, block_m), triton.cdiv(out_features, _BLOCK_N))
    _weight_only_matmul_kernel[grid](
        x,
        codes,
        scales,
        zeros if zeros is not None else scales,  # unread for int8
        bias if bias is not None else out,  # unread without a bias
        out,
        rows,
        out_features,
        in_features,
        x.stride(0),
        codes.stride(0),
        scales.stride(0),
        out.stride(0),
        GROUP_SIZE=group_size,
        BITS=bits,
        HAS_BIAS=bias is not None,
        IEEE_DOT=x.dtype == torch.float32 or _INTERPRETED,
        BLOCK_M=block_m,
        BLOCK_N=_BLOCK_N,
        BLOCK_K=_BLOCK_K,
    )
    return out
