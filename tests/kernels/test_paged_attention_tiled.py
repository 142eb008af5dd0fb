"""The tiled (FlashAttention-style) Triton kernel against the torch reference, on the GPU or in
Triton's interpreter: prompts, chunks and decodes at once, grouped query heads (one K/V tile
for the group), decodes split over their context, windows and soft-capped scores."""

from __future__ import annotations

import pytest
import torch

from lmserve.kernels.paged_attention import paged_attention_reference
from lmserve.kernels.paged_attention_tiled import paged_attention_tiled

from . import DEVICE
from .paged_cases import make_case
from .test_paged_attention import SCENARIOS, contiguous_attention


# The interpreter runs Triton 400-1400x slower than torch: small shapes only.
@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize(("q_heads", "kv_heads", "head_dim"), [(6, 2, 12), (8, 1, 16)])
def test_tiled_kernel_equals_reference_fp32(scenario, block_size, q_heads, kv_heads, head_dim):
    case = make_case(SCENARIOS[scenario], block_size, q_heads, kv_heads, head_dim)
    expected = paged_attention_reference(*case.args(head_dim**-0.5))
    got = paged_attention_tiled(*case.to(DEVICE).args(head_dim**-0.5)).cpu()
    # fp32 dots (IEEE, not tf32); only the order of the sums differs (online softmax).
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("scenario", ["decode", "decode_spread"])
@pytest.mark.parametrize("num_splits", [2, 4, 3])
def test_decodes_split_over_their_context_merge_to_the_same_answer(scenario, num_splits):
    """Splits past a short context see no key and weigh nothing in the merge; 3 rounds up."""
    case = make_case(SCENARIOS[scenario], 4, 6, 2, 8)
    expected = paged_attention_reference(*case.args(0.3))
    got = paged_attention_tiled(*case.to(DEVICE).args(0.3), num_splits=num_splits).cpu()
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_tiled_kernel_equals_reference_bf16():
    case = make_case(SCENARIOS["mixed_spread"], 4, 6, 2, 16, dtype=torch.bfloat16, seed=3)
    expected = paged_attention_reference(*case.args(0.25))
    got = paged_attention_tiled(*case.to(DEVICE).args(0.25)).cpu()
    assert got.dtype == torch.bfloat16
    # Both round to bf16 once at the end (a GPU rounds the weights to bf16 for P.V too).
    torch.testing.assert_close(got.float(), expected.float(), rtol=3e-2, atol=2e-2)


@pytest.mark.parametrize("scenario", ["chunked", "mixed_spread", "decode_spread"])
@pytest.mark.parametrize(("window", "softcap"), [(5, None), (40, None), (None, 2.0), (7, 3.0)])
def test_tiled_kernel_keeps_windows_and_softcaps(scenario, window, softcap):
    case = make_case(SCENARIOS[scenario], 4, 6, 2, 8)
    expected = contiguous_attention(case, 0.3, window, softcap)
    got = paged_attention_tiled(*case.to(DEVICE).args(0.3), window, softcap, num_splits=2).cpu()
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
