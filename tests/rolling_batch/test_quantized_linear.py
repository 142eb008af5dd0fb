"""Weight-only int4 linears and int8 weights (layers/quantized.py): codes within half a step
of each weight, the product HF-style arithmetic gives on the dequantized weight, 0.625 and
1.125 bytes a weight, and a layer whose input size is no multiple of the group size left
dense."""

from __future__ import annotations

import pytest
import torch

from lmserve.kernels import cpu_native
from lmserve.rolling_batch.model.layers import quantized
from lmserve.rolling_batch.model.layers.linear import RowLinear
from lmserve.rolling_batch.model.layers.parallel import TensorParallelGroup
from lmserve.rolling_batch.model.layers.quantized import (
    GROUP_SIZE,
    Int4Weight,
    Int8Weight,
    dequantize_int4,
    dequantize_int8,
    quantize_int4,
    quantize_int8,
)


def test_codes_are_within_half_a_step_of_each_weight():
    weight = torch.randn(48, 96, generator=torch.Generator().manual_seed(0))
    weight[3, :GROUP_SIZE] = 0.25  # a constant group is exact
    codes, scales, zeros = quantize_int4(weight)
    assert codes.dtype == torch.uint8 and int(codes.max()) <= 15
    error = (dequantize_int4(codes, scales, zeros) - weight).abs()
    step = scales.repeat_interleave(GROUP_SIZE, dim=1)
    # Half a step, plus the bf16 rounding of the zero (2^-9 of its size).
    slack = zeros.abs().repeat_interleave(GROUP_SIZE, dim=1) * 2**-8
    assert bool((error <= step / 2 + slack + 1e-7).all())
    assert float(error[3, :GROUP_SIZE].max()) == 0.0


@pytest.mark.parametrize("rows", [0, 1, 7, 64, 300])  # 64, 300: widened where bf16 is native
@pytest.mark.parametrize("out_features", [40, 64])  # 40: padded to the packing's 64-row blocks
def test_int4_linear_equals_bf16_arithmetic_on_the_dequantized_weight(rows, out_features):
    generator = torch.Generator().manual_seed(rows)
    layer = RowLinear(0, 96, out_features, TensorParallelGroup(), bias=True)
    layer.weight.data = torch.randn(out_features, 96, generator=generator)
    layer.bias.data = torch.randn(out_features, generator=generator)
    dequantized = dequantize_int4(*quantize_int4(layer.weight.data))
    x = torch.randn(rows, 96, generator=generator)

    layer.pack("int4")
    got = layer(x)

    assert isinstance(layer.packed, Int4Weight) and layer.weight.numel() == 0
    assert got.dtype == torch.float32 and got.shape == (rows, out_features)
    widened = quantized._int4_dense_dtype(rows) if cpu_native.native_ops() is not None else None
    if widened == torch.float32:  # no native bf16 (AVX2): x times the fp32 weight, unrounded
        expected = torch.nn.functional.linear(x, dequantized) + layer.bias
    else:
        if widened == torch.bfloat16:  # the weight widened to bf16
            dequantized = dequantized.bfloat16().float()
        product = torch.nn.functional.linear(x.bfloat16().float(), dequantized)
        expected = product.bfloat16().float() + layer.bias
    # bf16 outputs: a rounding step (2^-8 of the value) apart where the sums' order differs.
    torch.testing.assert_close(got, expected, rtol=2**-7, atol=1e-2)


@pytest.mark.parametrize("rows", [64, 300])
def test_without_native_bf16_big_int4_steps_multiply_the_fp32_weight(rows, monkeypatch):
    """Where bf16 is emulated (AVX2 only) a big step widens the int4 weight to fp32 instead:
    the dequantized weight exactly (to two fp32 roundings) times x unrounded, where the int4
    kernel would round x and the product to bf16 (2^-9)."""
    if cpu_native.native_ops() is None:
        pytest.skip("no C++ CPU kernels on this machine")
    monkeypatch.setattr(cpu_native, "cpu_has_native_bf16", lambda: False)
    generator = torch.Generator().manual_seed(rows)
    weight = torch.randn(200, 96, generator=generator)
    int4 = Int4Weight.quantize(weight)
    dequantized = dequantize_int4(*quantize_int4(weight))
    x = torch.randn(rows, 96, generator=generator)
    assert rows >= quantized._INT4_DENSE_FP32_FROM_ROWS
    torch.testing.assert_close(int4(x), x @ dequantized.T, rtol=1e-5, atol=1e-5)


def test_int4_weights_take_five_eighths_of_a_byte_each():
    weight = Int4Weight.quantize(torch.randn(3072, 576))
    assert weight.nbytes / (3072 * 576) == pytest.approx(0.625)


def test_a_layer_whose_inputs_are_no_multiple_of_the_group_stays_dense():
    layer = RowLinear(0, 48, 40, TensorParallelGroup(), bias=False)
    layer.weight.data = torch.randn(40, 48)
    weight = layer.weight.data.clone()
    x = torch.randn(3, 48)

    layer.pack("int4")

    assert not isinstance(layer.packed, Int4Weight)
    torch.testing.assert_close(layer(x), x @ weight.T, rtol=1e-5, atol=1e-5)


def test_int8_codes_are_within_half_a_step_and_the_largest_is_exact():
    weight = torch.randn(20, 64, generator=torch.Generator().manual_seed(1))
    weight[2, 32:] = 0.0  # an all-zero group stays zero
    codes, scales = quantize_int8(weight)
    error = (dequantize_int8(codes, scales) - weight).abs()
    assert bool((error <= scales.repeat_interleave(GROUP_SIZE, dim=1) / 2 + 1e-7).all())
    assert int(codes.abs().max()) == 127
    assert float(dequantize_int8(codes, scales)[2, 32:].abs().max()) == 0.0


@pytest.mark.parametrize("rows", [1, 5, 33, 200])  # 200: widened to fp32, one dense matmul
@pytest.mark.parametrize("kernels", ["native", "reference"])
def test_int8_weight_multiplies_and_looks_up_its_dequantized_rows(rows, kernels, monkeypatch):
    if kernels == "reference":  # no C++ kernels: dense matmuls on dequantized blocks
        monkeypatch.setattr(cpu_native, "ops_for", lambda tensor: None)
    elif cpu_native.native_ops() is None:
        pytest.skip("no C++ CPU kernels on this machine")
    generator = torch.Generator().manual_seed(rows)
    weight = torch.randn(300, 64, generator=generator)
    int8 = Int8Weight.quantize(weight)
    dequantized = dequantize_int8(*quantize_int8(weight))
    x = torch.randn(rows, 64, generator=generator)
    torch.testing.assert_close(int8(x), x @ dequantized.T, rtol=1e-5, atol=1e-5)
    ids = torch.tensor([0, 299, 7, 7])
    torch.testing.assert_close(int8.rows(ids, torch.float32), dequantized[ids])
    assert int8.nbytes / weight.numel() == pytest.approx(1.125)


@pytest.mark.parametrize("rows", [5, 64])  # 64: widened to bf16 where bf16 is native
def test_int8_weight_with_bf16_activations_multiplies_in_bf16(rows):
    generator = torch.Generator().manual_seed(rows)
    weight = torch.randn(300, 64, generator=generator)
    int8 = Int8Weight.quantize(weight)
    x = torch.randn(rows, 64, generator=generator).bfloat16()
    got = int8(x)
    assert got.dtype == torch.bfloat16
    dequantized = dequantize_int8(*quantize_int8(weight))
    if rows >= quantized.dense_from_rows(torch.bfloat16):
        dequantized = dequantized.bfloat16().float()  # the weight itself rounded to bf16
    expected = (x.float() @ dequantized.T).bfloat16()
    torch.testing.assert_close(got.float(), expected.float(), rtol=2**-7, atol=1e-2)
