"""The GPU's weight-only int4/int8 matmul (Triton: on the GPU where there is one, else run by
its CPU interpreter) and its pure-torch reference (kernels/weight_only_matmul.py) against the
dequantized weight: in fp32 the same product as a dense fp32 linear up to summation order; in
fp16/bf16 the weight rounded to the activations' dtype, as a dense half-precision model holds
it, products summed in fp32 and the output rounded once. The interpreter narrows to bf16 by
truncating (a GPU rounds to nearest), so the kernel's bf16 is held to one bf16 unit a weight
and on the output."""

from __future__ import annotations

import pytest
import torch

from lmserve.kernels.weight_only_matmul import weight_only_matmul_reference
from lmserve.kernels.weight_only_matmul_triton import weight_only_matmul
from lmserve.rolling_batch.model.layers.quantized import dequantize_int8
from lmserve.rolling_batch.model.layers.quantized_gpu import GpuInt4Weight, GpuInt8Weight

from . import DEVICE

UNIT_ROUNDING = {torch.float32: 2**-24, torch.float16: 2**-11, torch.bfloat16: 2**-8}


def int4_case(out_features, in_features, group_size, generator):
    shape = (out_features, in_features)
    codes = torch.randint(0, 16, shape, dtype=torch.uint8, generator=generator)
    groups = in_features // group_size
    scales = torch.rand(out_features, groups, generator=generator) * 0.1 + 0.01
    zeros = torch.randn(out_features, groups, generator=generator) * 0.1
    weight = (codes.float() - 8) * scales.repeat_interleave(group_size, 1)
    weight += zeros.repeat_interleave(group_size, 1)
    return (codes, scales, zeros), weight


def assert_product(got, x, weight, bias=None, interpreted=True):
    """`got` is x @ weight.T + bias with weight and x in x's dtype, summed exactly enough:
    within fp32 summation error plus one rounding to x's dtype (`interpreted`: bf16 truncated
    instead)."""
    assert got.dtype == x.dtype and got.shape == (x.shape[0], weight.shape[0])
    exact = x.double() @ weight.to(x.dtype).double().T
    magnitude = x.double().abs() @ weight.to(x.dtype).double().abs().T
    if bias is not None:
        exact += bias.double()
        magnitude += bias.double().abs()
    bound = exact.abs() * UNIT_ROUNDING[x.dtype] + magnitude * weight.shape[1] * 2**-24
    if interpreted and x.dtype == torch.bfloat16:  # truncated: a whole unit, on weights too
        bound = exact.abs() * 2**-7 + magnitude * (2**-7 + weight.shape[1] * 2**-24)
    assert bool(((got.double() - exact).abs() <= bound + 1e-30).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    ("rows", "out_features", "in_features", "group_size"),
    [(1, 64, 128, 32), (7, 200, 256, 64), (33, 96, 256, 128), (70, 64, 512, 256)],
)
def test_int4_product_is_the_dequantized_weights(
    dtype, rows, out_features, in_features, group_size
):
    generator = torch.Generator().manual_seed(rows)
    (codes, scales, zeros), weight = int4_case(out_features, in_features, group_size, generator)
    x = torch.randn(rows, in_features, generator=generator).to(dtype)
    codes, scales, zeros, weight, x = (t.to(DEVICE) for t in (codes, scales, zeros, weight, x))
    int4 = GpuInt4Weight(codes, scales, zeros, group_size)
    assert_product(int4(x), x, weight)
    parts = (int4.codes, int4.scales, int4.zeros, group_size)
    assert_product(weight_only_matmul_reference(x, *parts), x, weight, interpreted=False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("rows", "out_features"), [(1, 64), (20, 130)])
def test_int8_product_is_the_dequantized_weights_and_rows_are_its_rows(dtype, rows, out_features):
    generator = torch.Generator().manual_seed(out_features)
    codes = torch.randint(-127, 128, (out_features, 256), dtype=torch.int8, generator=generator)
    scales = torch.rand(out_features, 8, generator=generator) * 0.01
    weight = dequantize_int8(codes, scales)
    x = torch.randn(rows, 256, generator=generator).to(dtype)
    codes, scales, weight, x = (t.to(DEVICE) for t in (codes, scales, weight, x))
    int8 = GpuInt8Weight(codes, scales)
    assert_product(int8(x), x, weight)
    reference = weight_only_matmul_reference(x, int8.codes, int8.scales, None, 32)
    assert_product(reference, x, weight, interpreted=False)
    ids = torch.tensor([3, 0, out_features - 1], device=DEVICE)
    assert torch.equal(int8.rows(ids, dtype), weight[ids].to(dtype))


def test_bias_is_added_once_and_a_strided_input_is_read_right():
    generator = torch.Generator().manual_seed(5)
    (codes, scales, zeros), weight = int4_case(64, 128, 32, generator)
    wide = torch.randn(9, 256, generator=generator).to(DEVICE)
    x = wide[:, 64:192]  # rows 256 apart: not contiguous
    bias = torch.randn(64, generator=generator)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).contiguous()
    packed, scales, zeros, weight, bias = (
        t.to(DEVICE) for t in (packed, scales, zeros, weight, bias)
    )
    got = weight_only_matmul(x, packed, scales, zeros, 32, bias)
    assert_product(got, x, weight, bias)
    assert weight_only_matmul(x[:0], packed, scales, zeros, 32).shape == (0, 64)
