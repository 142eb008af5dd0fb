"""The C++ CPU kernels against their torch references: fp32 to 1e-5, bf16 and fp16 within
their precision. Every vector ISA this CPU has is built and tested (an AVX-512 machine also
checks the AVX2 build), so both paths of the one source stay correct."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lmserve.kernels import cpu_native
from lmserve.kernels.kv_store import store_kv_reference
from lmserve.kernels.paged_attention import paged_attention_reference
from lmserve.rolling_batch.model.layers.norm_and_rotary import RMSNorm, StepRope
from lmserve.rolling_batch.model.layers.quantized import (
    Int4Weight,
    dequantize_int4,
    quantize_int4,
    torch_int4_block,
)

from ..conftest import TEST_CACHE_DIR
from .paged_cases import make_case, share_leading_blocks
from .test_paged_attention import SCENARIOS, contiguous_attention

ISAS = [isa for isa in ("avx512", "avx2") if isa in cpu_native.usable_isas()]
pytestmark = pytest.mark.skipif(not ISAS, reason="this CPU has neither AVX2 nor AVX-512")

LOW_PRECISION = [torch.bfloat16, torch.float16]
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 3e-2, torch.float16: 3e-3}


@pytest.fixture(scope="module", params=ISAS)
def native(request):
    folder = cpu_native.build_dir(request.param, TEST_CACHE_DIR)
    return cpu_native.load(cpu_native.build(request.param, folder))


def close(got, expected, dtype=torch.float32):
    tolerance = TOLERANCE[dtype]
    torch.testing.assert_close(got.float(), expected.float(), rtol=tolerance, atol=tolerance)


def attention_args(case, scale):
    return case.args(scale)[:7]


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
@pytest.mark.parametrize("block_size", [1, 5, 16])
@pytest.mark.parametrize(("q_heads", "kv_heads", "head_dim"), [(4, 4, 8), (6, 2, 24), (9, 3, 64)])
def test_paged_attention_equals_reference_fp32(
    native, scenario, block_size, q_heads, kv_heads, head_dim
):
    case = make_case(SCENARIOS[scenario], block_size, q_heads, kv_heads, head_dim)
    got = native.paged_attention(*attention_args(case, 0.3))
    close(got, paged_attention_reference(*case.args(0.3)))


def test_paged_attention_long_chunked_prompt_beside_decodes(native):
    """A prompt chunk longer than one query tile (16 tokens), on top of cached context, in
    the same call as decodes and a one-token prompt."""
    seqs = [(120, 70), (300, 1), (1, 1), (45, 45), (64, 1)]
    case = make_case(seqs, 16, 9, 3, 64, seed=3)
    close(native.paged_attention(*attention_args(case, 0.125)), contiguous_attention(case, 0.125))


def test_paged_attention_streaming_ahead_over_long_contexts(native):
    """Enough K/V (over 1 MiB) that the rows are asked for keys ahead as they are read:
    prompt chunks and decodes over many chunks of keys, blocks of an odd size."""
    seqs = [(700, 70), (650, 1), (300, 1), (45, 45), (513, 1)]
    case = make_case(seqs, 5, 9, 3, 64, seed=5)
    close(native.paged_attention(*attention_args(case, 0.125)), contiguous_attention(case, 0.125))


# Decodes of 1 to 600 keys: shorter and longer than the 32 keys rows are asked for ahead,
# whole and partial vectors of keys, one block or many; between them a prompt chunk, and a
# prompt of 17 tokens whose second query tile is its last token alone (a decode's shape).
DECODES = [
    *[(1, 1), (16, 1), (31, 1), (33, 1), (600, 1), (2, 1), (40, 6), (129, 1), (64, 1)],
    *[(17, 17), (5, 1)],
]


def takes_decode_path(native, dtype, q_heads, kv_heads, head_dim):
    """Whether one-token decodes of this shape take the three-pass path: 1-4 query heads a KV
    head and head_dim in whole vectors, up to 8 (1-8 on AVX-512, 2-8 on AVX2); bf16 rows only
    where the CPU has AVX512-BF16 and head_dim is whole steps of 32."""
    vectors, left = divmod(head_dim, native.vector_width())
    fits = q_heads // kv_heads <= 4 and left == 0 and vectors <= 8
    if dtype == torch.bfloat16:
        return fits and native.bf16_panels() and head_dim % 32 == 0
    return fits


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [1, 5, 16])
@pytest.mark.parametrize(
    ("q_heads", "kv_heads", "head_dim"),
    # 8 query heads a KV head, or head_dim 72 (not whole vectors on AVX-512, 9 on AVX2), go
    # the general way; so do bf16's 48 and 16 (no whole steps of 32).
    [
        *[(2, 2, 16), (4, 2, 32), (9, 3, 48), (12, 3, 64), (8, 4, 96), (8, 4, 128)],
        *[(8, 1, 64), (6, 2, 72)],
    ],
)
def test_paged_attention_decodes_of_every_shape_equal_reference(
    native, dtype, block_size, q_heads, kv_heads, head_dim
):
    case = make_case(DECODES, block_size, q_heads, kv_heads, head_dim, dtype=dtype, seed=7)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # every item on this thread, whose fast-path count we read
    try:
        before = native.fast_decode_items()
        got = native.paged_attention(*attention_args(case, 0.2))
        fast_items = native.fast_decode_items() - before
    finally:
        torch.set_num_threads(threads)
    assert got.dtype == dtype
    close(got, contiguous_attention(case, 0.2), dtype)
    if takes_decode_path(native, dtype, q_heads, kv_heads, head_dim):
        # at least each one-token decode at every KV head
        one_token = sum(1 for _, new_tokens in DECODES if new_tokens == 1)
        assert fast_items >= one_token * kv_heads
    else:
        assert fast_items == 0


def test_paged_attention_reads_query_heads_from_a_fused_qkv_row(native):
    """The attention layer passes the query as a view into the QKV projection's output."""
    case = make_case(SCENARIOS["chunked"], 4, 6, 2, 16)
    tokens = case.query.shape[0]
    qkv = torch.randn(tokens, (6 + 2 * 2) * 16)
    qkv[:, : 6 * 16] = case.query.reshape(tokens, -1)
    query = qkv[:, : 6 * 16].view(tokens, 6, 16)
    args = (query, *attention_args(case, 0.5)[1:])
    close(native.paged_attention(*args), paged_attention_reference(*case.args(0.5)))


def shared_prefix_case(block_size, q_heads, kv_heads, head_dim, dtype=torch.float32):
    """Nine decodes of different lengths on one shared prompt prefix (20 full blocks of 16),
    one of them only one token past it; beside them a prompt chunk on the same prefix, a
    group of eight on another prefix, one of which leaves it early (the group shares less),
    and decodes of their own."""
    first = [(321 + 7 * i, 1) for i in range(8)] + [(321, 1)]
    second = [(260 + 3 * i, 1) for i in range(8)]
    seqs = first + [(400, 40)] + second + [(350, 1), (10, 1)]
    case = make_case(seqs, block_size, q_heads, kv_heads, head_dim, dtype=dtype, seed=5)
    shared = 320 // block_size
    share_leading_blocks(case, list(range(10)), shared)
    group = list(range(10, 18))
    share_leading_blocks(case, group, 250 // block_size)
    share_leading_blocks(case, group[:1] + group[-1:], 150 // block_size)
    return case


@pytest.mark.parametrize("block_size", [5, 16])
@pytest.mark.parametrize(("q_heads", "kv_heads", "head_dim"), [(4, 4, 8), (6, 2, 24), (9, 3, 64)])
def test_paged_attention_decodes_sharing_a_prefix_equal_reference(
    native, block_size, q_heads, kv_heads, head_dim
):
    """Decodes on a shared prefix are scored together (cascade) and merged: the same output."""
    case = shared_prefix_case(block_size, q_heads, kv_heads, head_dim)
    got = native.paged_attention(*attention_args(case, 0.3))
    close(got, paged_attention_reference(*case.args(0.3)))


@pytest.mark.parametrize("dtype", LOW_PRECISION)
def test_paged_attention_shared_prefix_low_precision(native, dtype):
    case = shared_prefix_case(16, 9, 3, 64, dtype)
    close(
        native.paged_attention(*attention_args(case, 0.125)),
        contiguous_attention(case, 0.125),
        dtype,
    )


@pytest.mark.parametrize("dtype", LOW_PRECISION)
@pytest.mark.parametrize("scenario", ["decode_spread", "mixed_spread", "chunked"])
def test_paged_attention_low_precision_within_its_precision(native, dtype, scenario):
    case = make_case(SCENARIOS[scenario], 16, 9, 3, 64, dtype=dtype)
    got = native.paged_attention(*attention_args(case, 0.125))
    assert got.dtype == dtype
    close(got, contiguous_attention(case, 0.125), dtype)


@pytest.mark.parametrize("head_dim", [32, 48, 128])
def test_paged_attention_bf16_decodes_any_head_dim_within_precision(native, head_dim):
    """bf16 decodes score by AVX512-BF16 dot products where head_dim is a multiple of 32 (the
    scale applied after the sum), by widened rows elsewhere: both within bf16's precision."""
    case = make_case(SCENARIOS["decode_spread"], 16, 6, 2, head_dim, dtype=torch.bfloat16)
    got = native.paged_attention(*attention_args(case, 0.3))
    close(got, contiguous_attention(case, 0.3), torch.bfloat16)


# Prompt chunks and decodes whose contexts run past the window by less than a chunk of 64
# keys and by many, next to ones within it; windows of a few keys (every row of a query tile
# sees different keys, chunks seen by some rows and by none) and of more than a chunk.
WINDOWED = [(700, 70), (650, 1), (300, 1), (45, 45), (513, 1), (9, 1), (130, 20), (3, 3)]


@pytest.mark.parametrize("block_size", [1, 5, 16])
@pytest.mark.parametrize(("q_heads", "kv_heads", "head_dim"), [(4, 4, 8), (9, 3, 64), (8, 1, 32)])
@pytest.mark.parametrize(("window", "softcap"), [(4, None), (100, None), (None, 2.5), (70, 5.0)])
def test_paged_attention_keeps_sliding_windows_and_softcaps(
    native, block_size, q_heads, kv_heads, head_dim, window, softcap
):
    """Mistral's and Qwen2's windows, Gemma 2's local layers and capped scores: HF's masked
    attention in the C++ kernel, on the general path and the decodes' fast one."""
    case = make_case(WINDOWED, block_size, q_heads, kv_heads, head_dim, seed=11)
    got = native.paged_attention(*attention_args(case, 0.3), window or 0, softcap or 0.0)
    close(got, contiguous_attention(case, 0.3, window, softcap))


@pytest.mark.parametrize("dtype", LOW_PRECISION)
def test_paged_attention_windows_low_precision_within_its_precision(native, dtype):
    case = make_case(WINDOWED, 16, 8, 2, 64, dtype=dtype, seed=2)
    got = native.paged_attention(*attention_args(case, 0.125), 33, 4.0)
    close(got, contiguous_attention(case, 0.125, 33, 4.0), dtype)


def test_paged_attention_window_leaves_shared_prefixes_alone(native):
    """Decodes on a shared prefix (the cascade's shape) with a window: each sees its own
    window, not the prefix."""
    case = shared_prefix_case(16, 9, 3, 64)
    got = native.paged_attention(*attention_args(case, 0.3), 50, 0.0)
    close(got, contiguous_attention(case, 0.3, 50))


@pytest.mark.parametrize("dtype", [torch.float32, *LOW_PRECISION])
def test_store_kv_writes_what_the_reference_writes(native, dtype):
    kv_heads, head_dim, tokens = 3, 12, 7
    qkv = torch.randn(tokens, (2 + 2 * kv_heads) * head_dim).to(dtype)
    key = qkv[:, 2 * head_dim : (2 + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    value = qkv[:, (2 + kv_heads) * head_dim :].view(tokens, kv_heads, head_dim)
    slots = torch.tensor([3, 0, -1, 17, 9, -1, 34])
    shape = (5, 7, kv_heads, head_dim)  # an odd block size
    expected = [torch.zeros(shape, dtype=dtype) for _ in range(2)]
    got = [torch.zeros(shape, dtype=dtype) for _ in range(2)]
    store_kv_reference(key, value, *expected, slots)
    native.store_kv(key, value, *got, slots)
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])


def test_store_kv_refuses_a_slot_outside_the_cache(native):
    k_cache, v_cache = torch.zeros(2, 4, 1, 8), torch.zeros(2, 4, 1, 8)
    with pytest.raises(RuntimeError, match="outside the cache"):
        native.store_kv(
            torch.ones(1, 1, 8), torch.ones(1, 1, 8), k_cache, v_cache, torch.tensor([8])
        )


@pytest.mark.parametrize("dtype", [torch.float32, *LOW_PRECISION])
@pytest.mark.parametrize("head_dim", [8, 64, 72])
def test_rotary_in_place_equals_reference(native, dtype, head_dim):
    max_positions, tokens, heads = 300, 9, 5
    angles = torch.rand(max_positions, head_dim // 2) * 6
    cos = torch.cat((angles.cos(), angles.cos()), dim=-1)
    sin = torch.cat((-angles.sin(), angles.sin()), dim=-1)
    positions = torch.tensor([0, 1, 2, 7, 299, 150, 3, 3, 40])
    qkv = torch.randn(tokens, (heads + 2) * head_dim).to(dtype)
    heads_view = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
    untouched = qkv[:, heads * head_dim :].clone()
    reference = StepRope(
        cos[positions][:, None].to(dtype), sin[positions][:, None].to(dtype), positions, None
    ).rotate(heads_view.clone())
    native.rotary_(heads_view, positions, cos, sin)
    close(heads_view, reference, dtype)
    assert torch.equal(qkv[:, heads * head_dim :], untouched)


@pytest.mark.parametrize("dtype", [torch.float32, *LOW_PRECISION])
@pytest.mark.parametrize("hidden", [8, 576, 100])
def test_rms_norm_and_fused_residual_add_equal_reference(native, dtype, hidden):
    norm = RMSNorm(hidden, 1e-5)
    norm.weight.data = torch.randn(hidden).to(dtype)
    x, residual = torch.randn(13, hidden).to(dtype), torch.randn(13, hidden).to(dtype)
    close(native.rms_norm(x, norm.weight, norm.eps), norm.reference(x), dtype)

    summed = residual + x
    native.add_rms_norm_(x, residual, norm.weight, norm.eps)
    assert torch.equal(residual, summed)  # the stream is added exactly as HF adds it
    close(x, norm.reference(summed), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, *LOW_PRECISION])
@pytest.mark.parametrize("intermediate", [16, 1536, 37])
def test_silu_and_mul_equals_reference(native, dtype, intermediate):
    gate_up = (torch.randn(11, 2 * intermediate) * 4).to(dtype)
    gate, up = gate_up.split(intermediate, dim=-1)
    close(native.silu_and_mul(gate_up), F.silu(gate) * up, dtype)


def linear_error_bound(x, weight, bias):
    """What any order of fp32 sums may be off by: in x eps x the sum of |terms| per output."""
    terms = x.abs().double() @ weight.abs().double().T
    if bias is not None:
        terms += bias.abs().double()
    return x.shape[1] * torch.finfo(torch.float32).eps * terms


@pytest.mark.parametrize(
    ("rows", "out_features", "in_features"),
    # one output; panels with a remainder; a tile row remainder; SmolLM2's q/k/v; more rows
    # than one pass over the weight serves (several row blocks of 1536 inputs)
    [(1, 1, 1), (5, 49, 7), (9, 100, 33), (33, 960, 576), (200, 130, 1536)],
)
@pytest.mark.parametrize("with_bias", [False, True])
def test_packed_linear_equals_the_matmul(native, rows, out_features, in_features, with_bias):
    generator = torch.Generator().manual_seed(rows)
    weight = torch.randn(out_features, in_features, generator=generator)
    bias = torch.randn(out_features, generator=generator) if with_bias else None
    x = torch.randn(rows, in_features, generator=generator)
    got = native.packed_linear(x, native.pack_linear_weight(weight), out_features, bias)
    expected = F.linear(x.double(), weight.double(), None if bias is None else bias.double())
    assert got.shape == (rows, out_features)
    assert ((got.double() - expected).abs() <= linear_error_bound(x, weight, bias)).all()


def test_packed_linear_gives_a_row_the_same_bits_in_any_batch(native):
    """Greedy text must not depend on which requests share a step."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(200, 576, generator=generator)
    packed = native.pack_linear_weight(weight)
    x = torch.randn(300, 576, generator=generator)
    whole = native.packed_linear(x, packed, 200, None)
    for row in (0, 7, 8, 299):
        alone = native.packed_linear(x[row : row + 1], packed, 200, None)
        assert torch.equal(alone[0], whole[row])
    strided = native.packed_linear(x[::3], packed, 200, None)  # rows of a wider tensor
    assert torch.equal(strided, whole[::3])
    assert native.packed_linear(x[:0], packed, 200, None).shape == (0, 200)


def panel_dtype_or_skip(native, dtype):
    if dtype == torch.bfloat16 and not native.bf16_panels():
        pytest.skip("bf16 panels need AVX512-BF16 and the AVX-512 build")
    return dtype


@pytest.mark.parametrize(
    ("rows", "out_features", "in_features"),
    # one output; panels and tiles with remainders; SmolLM2's q/k/v; several row blocks
    [(1, 1, 2), (5, 49, 8), (9, 100, 34), (33, 960, 576), (200, 130, 1536)],
)
@pytest.mark.parametrize("with_bias", [False, True])
def test_bf16_panels_equal_the_matmul_to_bf16s_rounding(
    native, rows, out_features, in_features, with_bias
):
    """bf16 weights multiply in pairs of inputs (AVX512-BF16) into fp32 sums: within an fp32
    sum's error of the exact product, then one bf16 rounding."""
    panel_dtype_or_skip(native, torch.bfloat16)
    generator = torch.Generator().manual_seed(rows)
    weight = torch.randn(out_features, in_features, generator=generator).bfloat16()
    bias = torch.randn(out_features, generator=generator).bfloat16() if with_bias else None
    x = torch.randn(rows, in_features, generator=generator).bfloat16()
    got = native.packed_linear(x, native.pack_linear_weight(weight), out_features, bias)
    expected = F.linear(x.double(), weight.double(), None if bias is None else bias.double())
    assert got.dtype == torch.bfloat16 and got.shape == (rows, out_features)
    bound = linear_error_bound(x.float(), weight.float(), bias) + expected.abs() * 2**-8
    assert ((got.double() - expected).abs() <= bound).all()


def test_bf16_panels_refuse_an_odd_number_of_inputs(native):
    panel_dtype_or_skip(native, torch.bfloat16)
    with pytest.raises(RuntimeError, match="even number of inputs"):
        native.pack_linear_weight(torch.randn(4, 7).bfloat16())


def test_bf16_panels_round_each_sum_as_torch_rounds_fp32_to_bf16(native):
    """Sums of two inputs on their way to bf16: ties to even, overflow to infinity, NaN kept,
    as `Tensor.bfloat16()` rounds them. (The dot-product instruction flushes subnormal inputs
    and sums to zero, as oneDNN's bf16 matmuls do.)"""
    panel_dtype_or_skip(native, torch.bfloat16)
    pairs = [
        (1.0, 2**-8),  # a tie: stays 1.0 (even)
        (1.0 + 2**-7, 2**-8),  # a tie: rounds up to even
        (1.0, 3 * 2**-10),  # under half an ulp
        (3e38, 3e38),  # overflow
        (float("nan"), 1.0),
        (-1.5, -(2**-9)),  # under half an ulp, negative
    ]
    x = torch.tensor(pairs).bfloat16()
    weight = torch.ones(1, 2).bfloat16()
    got = native.packed_linear(x, native.pack_linear_weight(weight), 1, None)[:, 0]
    expected = (x[:, 0].float() + x[:, 1].float()).bfloat16()
    torch.testing.assert_close(got, expected, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("rows", "intermediate", "in_features"),
    # one output; a pair with a remainder and a tile row remainder; SmolLM2's gate and up;
    # more rows than one pass over the weight serves
    [(1, 1, 2), (9, 40, 24), (33, 1536, 576), (200, 100, 1536)],
)
@pytest.mark.parametrize("with_bias", [False, True])
def test_gated_linear_gives_the_plain_panels_bits(
    native, dtype, rows, intermediate, in_features, with_bias
):
    """Gate and up paired in one panel: [gate | up] as packed_linear computes it, bit for bit,
    and fused silu(gate) * up as silu_and_mul computes from that (in bf16 with its roundings
    between the ops), so the model's greedy text stays what it was through either."""
    panel_dtype_or_skip(native, dtype)
    generator = torch.Generator().manual_seed(rows)
    weight = torch.randn(2 * intermediate, in_features, generator=generator).to(dtype)
    bias = torch.randn(2 * intermediate, generator=generator).to(dtype) if with_bias else None
    x = (torch.randn(rows, in_features, generator=generator) * 2).to(dtype)
    plain = native.packed_linear(x, native.pack_linear_weight(weight), 2 * intermediate, bias)
    paired = native.pack_gated_weight(weight)
    assert torch.equal(native.gated_linear(x, paired, intermediate, bias, False), plain)
    fused = native.gated_linear(x, paired, intermediate, bias, True)
    assert torch.equal(fused, native.silu_and_mul(plain))


def test_gated_linear_refuses_a_weight_not_packed_for_it(native):
    weight = torch.randn(20, 8)
    with pytest.raises(RuntimeError, match="pack_gated_weight"):  # panels of 3 outputs
        native.gated_linear(torch.randn(2, 8), torch.zeros(4, 8, 3), 10, None, True)
    with pytest.raises(RuntimeError, match="intermediate"):
        native.gated_linear(torch.randn(2, 8), native.pack_gated_weight(weight), 100, None, True)
    with pytest.raises(RuntimeError, match="2 \\* intermediate"):
        native.pack_gated_weight(torch.randn(7, 8))


def test_packed_linear_refuses_a_mismatched_weight(native):
    packed = native.pack_linear_weight(torch.randn(10, 8))
    with pytest.raises(RuntimeError, match="out_features"):
        native.packed_linear(torch.randn(2, 8), packed, 1000, None)
    with pytest.raises(RuntimeError, match="pack_linear_weight"):
        native.packed_linear(torch.randn(2, 9), packed, 10, None)
    with pytest.raises(RuntimeError, match="input feature"):
        native.packed_linear(
            torch.randn(2, 0), native.pack_linear_weight(torch.randn(3, 0)), 3, None
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 4, 9])
def test_int8_linear_equals_the_dequantized_matmul(native, dtype, rows):
    """Q8_0 layout: codes and a scale per 32 inputs; 200 outputs span blocks and a remainder."""
    generator = torch.Generator().manual_seed(rows)
    codes = torch.randint(-127, 128, (200, 96), generator=generator, dtype=torch.int8)
    scales = torch.rand(200, 3, generator=generator) / 100
    x = torch.randn(rows, 96, generator=generator).to(dtype)
    weight = codes.float() * scales.repeat_interleave(32, dim=1)
    got = native.int8_linear(x, codes, scales)
    assert got.dtype == dtype and got.shape == (rows, 200)
    close(got, x.float() @ weight.T, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_dequantize_widens_to_the_activations_dtype(native, dtype):
    generator = torch.Generator().manual_seed(3)
    codes = torch.randint(-127, 128, (200, 96), generator=generator, dtype=torch.int8)
    scales = torch.rand(200, 3, generator=generator) / 100
    got = native.int8_dequantize(codes, scales, torch.zeros(1, 96, dtype=dtype))
    expected = codes.float() * scales.repeat_interleave(32, dim=1)
    assert got.dtype == dtype and torch.equal(got, expected.to(dtype))


def test_int8_linear_refuses_inputs_no_multiple_of_32(native):
    with pytest.raises(RuntimeError, match="multiple of 32"):
        native.int8_linear(
            torch.randn(1, 40), torch.zeros(8, 40, dtype=torch.int8), torch.ones(8, 1)
        )


@pytest.mark.parametrize(("out_features", "group_size"), [(64, 32), (200, 64), (128, 128)])
def test_int4_dequantize_widens_torchs_int4_packing(native, out_features, group_size):
    """The codes in torch's CPU int4 packing (outputs padded to whole blocks of 64: 200 -> 256;
    blocks of 64 where torch runs AVX-512 code, of 32 on AVX2: torch_int4_block),
    widened to [in, out]: the weight the int4 kernel multiplies by, in fp32 (computed as
    q s + (z - 8 s): within two roundings of (q - 8) s + z) or rounded to bf16."""
    generator = torch.Generator().manual_seed(out_features)
    weight = torch.randn(out_features, 256, generator=generator)
    codes, scales, zeros = quantize_int4(weight, group_size)
    int4 = Int4Weight(codes, scales, zeros, group_size=group_size)
    parts = (int4.packed, int4.scales_and_zeros, group_size)
    fp32 = native.int4_dequantize(*parts, torch.zeros(0), torch_int4_block())
    padded = int4.packed.shape[0]
    assert fp32.dtype == torch.float32 and fp32.shape == (256, padded)
    expected = dequantize_int4(codes, scales, zeros, group_size)
    terms = dequantize_int4(torch.full_like(codes, 16), scales.abs(), zeros.abs(), group_size)
    assert bool(((fp32[:, :out_features] - expected.T).abs() <= terms.T * 2**-22).all())
    assert not fp32[:, out_features:].any()  # padding rows: scale 0, zero 0
    like = torch.zeros(0, dtype=torch.bfloat16)
    got = native.int4_dequantize(*parts, like, torch_int4_block())
    assert got.dtype == torch.bfloat16 and torch.equal(got, fp32.bfloat16())
    # The int4 kernel multiplies by the same weight (its products then round to bf16).
    x = torch.eye(256, dtype=torch.bfloat16)
    kernel = torch.ops.aten._weight_int4pack_mm_for_cpu(
        x, int4.packed, group_size, int4.scales_and_zeros
    )
    assert torch.equal(kernel, got)


def test_isa_is_read_from_cpu_flags():
    assert cpu_native.cpu_isa("flags\t: fpu sse2 avx2 fma f16c\n") == "avx2"
    flags = "flags\t: avx2 fma f16c avx512f avx512bw avx512vl avx512dq\n"
    assert cpu_native.cpu_isa(flags) == "avx512"
    assert cpu_native.cpu_isa("flags\t: fpu sse2 sse4_2\n") is None


@pytest.mark.skipif(len(ISAS) < 2, reason="this CPU runs one ISA's build only")
def test_each_isa_build_loads_as_its_own_module():
    """An AVX-512 machine tests the AVX2 build in the same process: loading it must not hand
    back the AVX-512 module loaded before it."""
    libraries = [cpu_native.build(isa, cpu_native.build_dir(isa, TEST_CACHE_DIR)) for isa in ISAS]
    modules = [cpu_native.load(library) for library in libraries]
    assert [module.__file__ for module in modules] == [str(library) for library in libraries]


def lora_case(dtype, outputs=(48, 16, 16), num_slots=4, rank=8, seed=0):
    """A fused linear's output, input and stacked adapters, with segments of uneven lengths:
    several slots, one token alone, a slot in two segments, base-model tokens between them."""
    generator = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=generator).to(dtype)

    width = len(outputs) * rank
    a, bs = rand(num_slots * width, 32), [rand(size, num_slots * rank) for size in outputs]
    starts = [sum(outputs[:index]) for index in range(len(outputs))]
    runs = [(2, 5), (-1, 3), (0, 1), (3, 11), (-1, 1), (2, 2)]  # (slot or -1: base, tokens)
    token_slot = torch.tensor([slot for slot, length in runs for _ in range(length)])
    firsts = [sum(length for _, length in runs[:index]) for index in range(len(runs))]
    segments = [(slot, first, n) for (slot, n), first in zip(runs, firsts) if slot >= 0]
    slots, token_starts, lengths = (list(column) for column in zip(*segments))
    out, x = rand(len(token_slot), sum(outputs)), rand(len(token_slot), 32)
    return (out, x, a, bs, starts, slots, token_starts, lengths, rank), token_slot


def lora_per_token(out, x, a, bs, starts, token_slot, rank):
    """Each token through its own adapter, one at a time: what the segments must add up to."""
    out = out.float().clone()
    width = len(bs) * rank
    for token, slot in enumerate(token_slot.tolist()):
        if slot < 0:
            continue
        low_rank = a[slot * width : (slot + 1) * width].float() @ x[token].float()
        for index, (b, start) in enumerate(zip(bs, starts)):
            part = low_rank[index * rank : (index + 1) * rank]
            out[token, start : start + b.shape[0]] += (
                b[:, slot * rank : (slot + 1) * rank].float() @ part
            )
    return out


@pytest.mark.parametrize("dtype", [torch.float32, *LOW_PRECISION])
def test_lora_segments_match_each_token_through_its_own_adapter(native, dtype):
    from lmserve.kernels.lora_segments import lora_add_reference

    if dtype != torch.float32 and not cpu_native.cpu_has_native_bf16():
        pytest.skip("bf16/fp16 matmuls are emulated here")
    (out, x, a, bs, starts, *segments, rank), token_slot = lora_case(dtype)
    expected = lora_per_token(out, x, a, bs, starts, token_slot, rank)
    reference, native_out = out.clone(), out.clone()
    lora_add_reference(reference, x, a, bs, starts, *segments, rank)
    native.lora_add_(native_out, x, a, bs, starts, *segments, rank)
    scale = expected.abs().max()
    close(reference / scale, expected / scale, dtype)
    close(native_out / scale, expected / scale, dtype)
    untouched = token_slot < 0
    assert torch.equal(native_out[untouched], out[untouched])  # base-model tokens: nothing added


def test_greedy_pick_equals_max_and_log_softmax(native):
    """Greedy decoding's token and log-prob, as torch.max and log_softmax give them: the first
    of equal maxima, NaN above everything, a row of -inf has no probabilities."""
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 1003, generator=generator) * 4  # no multiple of any vector width
    logits[1, 500] = logits[1, 20] = 99.0
    logits[2, 7] = logits[2, 900] = float("nan")
    logits[3] = float("-inf")
    logits[4, 1002] = 50.0  # the maximum in the scalar tail
    for rows in (logits, torch.cat([logits, logits], dim=1)[:, 3:1006]):  # also strided rows
        tokens, log_probs = native.greedy_pick(rows)
        expected = torch.max(rows, dim=-1).indices
        assert tokens.tolist() == expected.tolist()
        reference = torch.log_softmax(rows, dim=-1).gather(1, expected[:, None])[:, 0]
        torch.testing.assert_close(log_probs, reference, rtol=1e-6, atol=1e-6, equal_nan=True)
    tokens, _ = native.greedy_pick(logits)
    assert tokens[:3].tolist() == [int(logits[0].argmax()), 20, 7] and tokens[4] == 1002
