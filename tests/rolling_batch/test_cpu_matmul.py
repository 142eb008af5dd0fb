"""Which packed form a CPU linear takes, and that it computes the linear it replaced."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lmserve.kernels import cpu_native
from lmserve.rolling_batch.layers.cpu_matmul import NativeLinearWeight, PackedWeight, try_pack


@pytest.mark.skipif(cpu_native.native_ops() is None, reason="the C++ kernels are not built here")
def test_fp32_weights_take_the_native_panels_and_compute_the_same_linear():
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(100, 64, generator=generator)
    bias = torch.randn(100, generator=generator)
    packed = try_pack(weight)
    assert isinstance(packed, NativeLinearWeight)
    x = torch.randn(2, 3, 64, generator=generator)  # leading dims kept, as F.linear keeps them
    torch.testing.assert_close(packed(x, bias), F.linear(x, weight, bias), rtol=1e-5, atol=1e-4)


def test_bf16_weights_take_onednns_layout():
    weight = torch.randn(100, 64).to(torch.bfloat16)
    packed = try_pack(weight)
    if packed is None:
        pytest.skip("oneDNN takes no bf16 weight on this CPU")
    assert isinstance(packed, PackedWeight)
    x = torch.randn(5, 64).to(torch.bfloat16)
    torch.testing.assert_close(packed(x).float(), F.linear(x, weight).float(), rtol=2e-2, atol=2e-2)
