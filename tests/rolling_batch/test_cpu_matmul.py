"""oneDNN-packed CPU linears give the plain matmul's answer, for every dtype the CPU takes
(and fall back to the plain matmul for one it does not), and free the unpacked weight."""

from __future__ import annotations

import pytest
import torch

from lmserve.rolling_batch.layers.linear import RowLinear
from lmserve.rolling_batch.layers.parallel import TensorParallelGroup


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
