"""Paged attention: the torch reference against plain causal attention on contiguous K/V, and
the Triton kernel (on the GPU, or in Triton's interpreter on CPU) against the reference."""

from __future__ import annotations

import pytest
import torch

from lmserve.kernels.paged_attention import ReferencePlan, paged_attention_reference

from . import DEVICE
from .paged_cases import make_case

SCENARIOS = {
    "decode": [(1, 1), (7, 1), (33, 1)],
    "prefill": [(5, 5), (17, 17), (1, 1)],
    "chunked": [(20, 6), (9, 9), (40, 1), (3, 2)],
    # Decodes of very different lengths are attended in separate groups.
    "decode_spread": [(600, 1), (20, 1), (590, 1), (15, 1), (33, 1), (9, 1), (12, 1)],
    "mixed_spread": [(600, 1), (20, 1), (40, 6), (590, 1), (15, 1), (33, 1), (9, 1)],
}


def contiguous_attention(case, scale, window=None, softcap=None):
    """The textbook computation, one sequence at a time, for checking the reference: with a
    `window`, keys within `window` of the query's position (HF's mask); with a `softcap`,
    scores squashed by tanh before the softmax (Gemma 2's)."""
    outputs = []
    block_size = case.k_cache.shape[1]
    for s in range(case.seq_lens.shape[0]):
        total = int(case.seq_lens[s])
        start, end = int(case.query_start_loc[s]), int(case.query_start_loc[s + 1])
        slots = [
            int(case.block_tables[s, i // block_size]) * block_size + i % block_size
            for i in range(total)
        ]
        keys = case.k_cache.view(-1, *case.k_cache.shape[2:])[slots].float()
        values = case.v_cache.view(-1, *case.v_cache.shape[2:])[slots].float()
        query = case.query[start:end].float()
        group = query.shape[1] // keys.shape[1]
        keys = keys.repeat_interleave(group, dim=1)
        values = values.repeat_interleave(group, dim=1)
        positions = torch.arange(total - (end - start), total)
        mask = torch.arange(total)[None, :] <= positions[:, None]
        if window is not None:
            mask &= torch.arange(total)[None, :] > positions[:, None] - window
        scores = torch.einsum("qhd,khd->hqk", query, keys) * scale
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        weights = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
        outputs.append(torch.einsum("hqk,khd->qhd", weights, values))
    return torch.cat(outputs)


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize(("q_heads", "kv_heads"), [(4, 4), (6, 2), (9, 3)])
def test_reference_equals_contiguous_attention(scenario, block_size, q_heads, kv_heads):
    case = make_case(SCENARIOS[scenario], block_size, q_heads, kv_heads, head_dim=8)
    got = paged_attention_reference(*case.args(0.3))
    torch.testing.assert_close(got, contiguous_attention(case, 0.3), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
@pytest.mark.parametrize(("window", "softcap"), [(4, None), (16, None), (None, 5.0), (7, 2.0)])
def test_sliding_window_and_softcap_equal_contiguous_attention(scenario, window, softcap):
    """Prompt chunks, decodes and both at once, with contexts past the window and within it;
    a softcap small enough to change the weights."""
    case = make_case(SCENARIOS[scenario], 4, 6, 2, head_dim=8)
    got = paged_attention_reference(*case.args(0.3), window=window, softcap=softcap)
    expected = contiguous_attention(case, 0.3, window, softcap)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    if window is not None:  # the window matters here
        plain = contiguous_attention(case, 0.3, None, softcap)
        assert not torch.allclose(got, plain, rtol=1e-3, atol=1e-3)


def test_paged_attention_serves_windows_and_softcaps_on_whatever_kernel_is_here():
    """paged_attention's dispatch (the C++ kernel where it builds, else the reference) keeps a
    window and a softcap, and a window no context outgrows is plain attention."""
    from lmserve.kernels.paged_attention import paged_attention

    case = make_case(SCENARIOS["mixed_spread"], 4, 6, 2, head_dim=8)
    args = case.args(0.3)
    windowed = paged_attention(*args, window=9, softcap=3.0)
    expected = contiguous_attention(case, 0.3, 9, 3.0)
    torch.testing.assert_close(windowed, expected, rtol=1e-5, atol=1e-5)
    wide = paged_attention(*args, window=10_000)
    torch.testing.assert_close(wide, contiguous_attention(case, 0.3), rtol=1e-5, atol=1e-5)


def test_decodes_of_spread_lengths_are_split_into_groups():
    case = make_case(SCENARIOS["mixed_spread"], 16, 4, 2, head_dim=8)
    plan = ReferencePlan.build(case.block_tables, case.seq_lens, case.query_start_loc, 16)
    members = sorted(sorted(group.rows.tolist()) for group in plan.groups)
    # The two long decodes, the short decodes, the prompt chunk (rows 2..7).
    assert members == [[0, 8], [1, 9, 10, 11], [2, 3, 4, 5, 6, 7]]


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
@pytest.mark.parametrize(("q_heads", "kv_heads"), [(4, 4), (9, 3)])
def test_bf16_reference_stays_within_bf16_of_fp32_attention(scenario, q_heads, kv_heads):
    """bf16 takes its own path (scores in bf16, softmax in fp32, as HF's eager attention)."""
    case = make_case(SCENARIOS[scenario], 4, q_heads, kv_heads, 16, dtype=torch.bfloat16)
    got = paged_attention_reference(*case.args(0.25))
    assert got.dtype == torch.bfloat16
    expected = contiguous_attention(case, 0.25)
    torch.testing.assert_close(got.float(), expected, rtol=3e-2, atol=3e-2)


# The interpreter runs Triton 400-1400x slower than torch: small shapes only.
@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize(("q_heads", "kv_heads", "head_dim"), [(2, 2, 8), (6, 2, 12)])
def test_triton_kernel_equals_reference_fp32(scenario, block_size, q_heads, kv_heads, head_dim):
    from lmserve.kernels.paged_attention_triton import paged_attention_triton

    case = make_case(SCENARIOS[scenario], block_size, q_heads, kv_heads, head_dim)
    expected = paged_attention_reference(*case.args(head_dim**-0.5))
    got = paged_attention_triton(*case.to(DEVICE).args(head_dim**-0.5)).cpu()
    # fp32 throughout; only the order of the sums differs (online softmax in tiles).
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_triton_kernel_equals_reference_bf16():
    from lmserve.kernels.paged_attention_triton import paged_attention_triton

    case = make_case(SCENARIOS["chunked"], 4, 6, 2, 8, dtype=torch.bfloat16, seed=3)
    expected = paged_attention_reference(*case.args(0.35))
    got = paged_attention_triton(*case.to(DEVICE).args(0.35)).cpu()
    # Both compute in fp32 and round once to bf16 (8 bits of mantissa): one bf16 ulp apart.
    torch.testing.assert_close(got.float(), expected.float(), rtol=1.6e-2, atol=1e-2)


@pytest.mark.parametrize("scenario", ["chunked", "mixed_spread"])
@pytest.mark.parametrize(("window", "softcap"), [(5, None), (40, None), (None, 2.0), (7, 3.0)])
def test_triton_kernel_keeps_windows_and_softcaps(scenario, window, softcap):
    from lmserve.kernels.paged_attention_triton import paged_attention_triton

    case = make_case(SCENARIOS[scenario], 4, 6, 2, 8)
    expected = contiguous_attention(case, 0.3, window, softcap)
    got = paged_attention_triton(*case.to(DEVICE).args(0.3), window, softcap).cpu()
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
