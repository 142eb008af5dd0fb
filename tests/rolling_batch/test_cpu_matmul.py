"""Packed CPU linears (fp32 on the C++ kernels' panels, other dtypes in oneDNN's layout) give
the plain matmul's answer, for every dtype the CPU takes (and fall back to the plain matmul
for one it does not), and free the unpacked weight."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lmserve.kernels import cpu_native
from lmserve.rolling_batch.model.layers.cpu_matmul import (
    NativeGatedWeight,
    NativeLinearWeight,
    PackedWeight,
    try_pack,
)
from lmserve.rolling_batch.model.layers.linear import MergedColumnLinear, RowLinear
from lmserve.rolling_batch.model.layers.parallel import TensorParallelGroup


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [0, 1, 7, 64])
def test_packed_linear_equals_plain_linear(dtype, rows):
    generator = torch.Generator().manual_seed(rows)
    layer = RowLinear(0, 48, 40, TensorParallelGroup(), bias=True)
    layer.weight.data = torch.randn(40, 48, generator=generator).to(dtype)
    layer.bias.data = torch.randn(40, generator=generator).to(dtype)
    weight = layer.weight.data.clone()
    x = torch.randn(rows, 48, generator=generator).to(dtype)
    expected = torch.nn.functional.linear(x.float(), weight.float()) + layer.bias.float()

    layer.pack()
    got = layer(x)

    assert got.dtype == dtype and got.shape == (rows, 40)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), expected, rtol=tolerance, atol=tolerance * 10)
    if layer.packed is not None:
        assert layer.weight.numel() == 0  # no second copy of the weights
    else:
        assert torch.equal(layer.weight.data, weight)


@pytest.mark.skipif(cpu_native.native_ops() is None, reason="the C++ kernels are not built here")
def test_fp32_weights_take_the_native_panels_and_compute_the_same_linear():
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(100, 64, generator=generator)
    bias = torch.randn(100, generator=generator)
    packed = try_pack(weight)
    assert isinstance(packed, NativeLinearWeight)
    x = torch.randn(2, 3, 64, generator=generator)  # leading dims kept, as F.linear keeps them
    torch.testing.assert_close(packed(x, bias), F.linear(x, weight, bias), rtol=1e-5, atol=1e-4)


@pytest.mark.skipif(cpu_native.native_ops() is None, reason="the C++ kernels are not built here")
def test_gate_and_up_pack_paired_and_give_the_mlps_activation():
    """An MLP's gate and up projection packs into the paired panels: called as a linear it
    gives [gate | up] (a LoRA adapter adds to those), fused it gives silu(gate) * up."""
    generator = torch.Generator().manual_seed(0)
    layer = MergedColumnLinear(64, [40, 40], TensorParallelGroup(), bias=True, gated=True)
    layer.weight.data = torch.randn(80, 64, generator=generator)
    layer.bias.data = torch.randn(80, generator=generator)
    weight, bias = layer.weight.data.clone(), layer.bias.data.clone()
    x = torch.randn(2, 3, 64, generator=generator)

    layer.pack()

    assert isinstance(layer.packed, NativeGatedWeight)
    expected = F.linear(x, weight, bias)
    torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-4)
    gate, up = expected.split(40, dim=-1)
    torch.testing.assert_close(
        layer.packed.silu_and_mul(x, layer.bias), F.silu(gate) * up, rtol=1e-5, atol=1e-4
    )


def bf16_panels() -> bool:
    native = cpu_native.native_ops()
    return native is not None and native.bf16_panels()


@pytest.mark.parametrize("in_features", [64, 63])
def test_bf16_weights_take_the_bf16_panels_where_the_cpu_has_them_else_onednns_layout(
    in_features,
):
    """AVX512-BF16 multiplies bf16 panels (pairs of inputs: an even number of them); other
    CPUs, and odd inputs, keep oneDNN's layout."""
    weight = torch.randn(100, in_features).to(torch.bfloat16)
    packed = try_pack(weight)
    if packed is None:
        pytest.skip("oneDNN takes no bf16 weight on this CPU")
    panels = bf16_panels() and in_features % 2 == 0
    assert isinstance(packed, NativeLinearWeight if panels else PackedWeight)
    x = torch.randn(5, in_features).to(torch.bfloat16)
    torch.testing.assert_close(packed(x).float(), F.linear(x, weight).float(), rtol=2e-2, atol=2e-2)
