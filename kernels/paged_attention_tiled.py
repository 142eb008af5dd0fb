"""FlashAttention-style Triton kernel for `paged_attention.paged_attention_reference` (same
signature): the paged cache read in place, tiles through `tl.dot` (tensor cores in bf16/fp16,
fp32 accumulation), an online softmax, and the query heads that share a KV head computed
together, so each K/V tile is read once for its whole group instead of once a query head.

A program takes BLOCK_Q query tokens of one sequence times the GROUP query heads of one KV head
(BLOCK_M rows), and walks the keys those rows see in tiles of BLOCK_N through the block table.
Decode steps split a long context over NUM_SPLITS programs (few sequences would otherwise leave
most of a GPU idle); their partial sums meet in `_merge_splits_kernel`. Windows and soft-capped
scores as the reference has them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction


@triton.jit
def _tiled_attention_kernel(
    out_ptr,  # [T, q_heads, head_dim], or the splits' fp32 partial sums
    max_ptr,  # [NUM_SPLITS, T, q_heads] fp32 (NUM_SPLITS > 1 only)
    sum_ptr,
    query_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    scale,
    window,  # keys a row sees back from its position, itself included; 0: all
    softcap,
    stride_q_token,
    stride_q_head,
    stride_o_split,
    stride_o_token,
    stride_o_head,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    stride_table_seq,
    num_tokens,
    q_heads,
    GROUP: tl.constexpr,  # query heads a KV head serves
    GROUP_P2: tl.constexpr,  # GROUP rounded up to a power of two (rows are token x head)
    BLOCK_Q: tl.constexpr,  # query tokens a program takes: BLOCK_M = BLOCK_Q * GROUP_P2 rows
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SOFTCAP: tl.constexpr,
    UPCAST: tl.constexpr,  # fp32 dots: fp32 inputs (exact), or Triton's interpreter
):
    seq = tl.program_id(0)
    q_block = tl.program_id(1)
    kv_head = tl.program_id(2) // NUM_SPLITS
    split = tl.program_id(2) % NUM_SPLITS
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if q_block * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)

    rows = tl.arange(0, BLOCK_Q * GROUP_P2)
    token_in_seq = q_block * BLOCK_Q + rows // GROUP_P2
    head = kv_head * GROUP + rows % GROUP_P2
    active = (token_in_seq < q_len) & (rows % GROUP_P2 < GROUP)
    position = seq_len - q_len + token_in_seq
    token = (q_start + token_in_seq).to(tl.int64)
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < HEAD_DIM
    q = tl.load(
        query_ptr + token[:, None] * stride_q_token + head[:, None] * stride_q_head + dims[None, :],
        mask=active[:, None] & dim_mask[None, :],
        other=0.0,
    )
    if UPCAST:
        q = q.to(tl.float32)

    # The keys these rows see: up to the last active row's position, from the first row's
    # window start; this split's share of them.
    last = tl.minimum(q_block * BLOCK_Q + BLOCK_Q, q_len) - 1
    keys_end = seq_len - q_len + last + 1
    keys_start = tl.where(
        window > 0, tl.maximum(seq_len - q_len + q_block * BLOCK_Q - window + 1, 0), 0
    )
    span = tl.cdiv(tl.cdiv(keys_end - keys_start, NUM_SPLITS), BLOCK_N) * BLOCK_N
    split_start = keys_start + split * span
    split_end = tl.minimum(split_start + span, keys_end)

    running_max = tl.full((BLOCK_Q * GROUP_P2,), float("-inf"), tl.float32)
    running_sum = tl.zeros((BLOCK_Q * GROUP_P2,), tl.float32)
    acc = tl.zeros((BLOCK_Q * GROUP_P2, BLOCK_D), tl.float32)
    table_row = block_tables_ptr + seq.to(tl.int64) * stride_table_seq
    for tile in range(split_start, split_end, BLOCK_N):
        key_index = tile + tl.arange(0, BLOCK_N)
        key_mask = key_index < split_end
        block = tl.load(table_row + key_index // BLOCK_SIZE, mask=key_mask, other=0).to(tl.int64)
        offsets = (
            block * stride_cache_block
            + (key_index % BLOCK_SIZE).to(tl.int64) * stride_cache_slot
            + kv_head * stride_cache_head
        )
        tile_mask = key_mask[:, None] & dim_mask[None, :]
        k = tl.load(k_cache_ptr + offsets[:, None] + dims[None, :], mask=tile_mask, other=0.0)
        v = tl.load(v_cache_ptr + offsets[:, None] + dims[None, :], mask=tile_mask, other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
            scores = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
        else:
            scores = tl.dot(q, tl.trans(k)) * scale
        if SOFTCAP:  # softcap * tanh(score / softcap), tanh(x) = 2 sigmoid(2x) - 1
            scores = softcap * (2.0 * tl.sigmoid(2.0 * (scores / softcap)) - 1.0)
        visible = key_mask[None, :] & (key_index[None, :] <= position[:, None]) & active[:, None]
        in_window = (key_index[None, :] > position[:, None] - window) | (window <= 0)
        visible = visible & in_window
        scores = tl.where(visible, scores, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(scores, axis=1))
        # A row with no visible key yet keeps -inf: subtract 0 instead (no inf - inf).
        safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)
        weights = tl.exp(scores - safe_max[:, None])
        correction = tl.exp(running_max - safe_max)
        running_sum = running_sum * correction + tl.sum(weights, axis=1)
        if UPCAST:
            update = tl.dot(weights, v, input_precision="ieee")
        else:
            update = tl.dot(weights.to(v.dtype), v)
        acc = acc * correction[:, None] + update
        running_max = new_max

    store_mask = active[:, None] & dim_mask[None, :]
    if NUM_SPLITS == 1:
        out = acc / tl.where(running_sum > 0, running_sum, 1.0)[:, None]
        target = out_ptr + token[:, None] * stride_o_token + head[:, None] * stride_o_head
        tl.store(target + dims[None, :], out.to(out_ptr.dtype.element_ty), mask=store_mask)
    else:
        base = split.to(tl.int64) * stride_o_split
        target = out_ptr + base + token[:, None] * stride_o_token + head[:, None] * stride_o_head
        tl.store(target + dims[None, :], acc, mask=store_mask)
        stat = (split.to(tl.int64) * num_tokens + token) * q_heads + head
        tl.store(max_ptr + stat, running_max, mask=active)
        tl.store(sum_ptr + stat, running_sum, mask=active)


@triton.jit
def _merge_splits_kernel(
    out_ptr,
    partial_ptr,  # [NUM_SPLITS, T, q_heads, head_dim] fp32
    max_ptr,  # [NUM_SPLITS, T, q_heads]
    sum_ptr,
    num_tokens,
    q_heads,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    splits = tl.arange(0, NUM_SPLITS)
    stat = (splits.to(tl.int64) * num_tokens + token) * q_heads + head
    maxes = tl.load(max_ptr + stat)
    sums = tl.load(sum_ptr + stat)
    best = tl.max(maxes, axis=0)
    weights = tl.exp(maxes - best)  # a split that saw no key holds -inf: weight 0
    total = tl.sum(sums * weights, axis=0)
    dims = tl.arange(0, BLOCK_D)
    partials = tl.load(
        partial_ptr + stat[:, None] * HEAD_DIM + dims[None, :],
        mask=dims[None, :] < HEAD_DIM,
        other=0.0,
    )
    out = tl.sum(partials * weights[:, None], axis=0) / tl.where(total > 0, total, 1.0)
    target = out_ptr + (token * q_heads + head) * HEAD_DIM + dims
    tl.store(target, out.to(out_ptr.dtype.element_ty), mask=dims < HEAD_DIM)


def paged_attention_tiled(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    max_query_len: int,
    max_seq_len: int,
    window: int | None = None,
    softcap: float | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:
    """`num_splits`: programs a decode's context is split over (None: enough to fill the
    device; prompt steps take 1)."""
    num_tokens, q_heads, head_dim = query.shape
    num_seqs = seq_lens.shape[0]
    kv_heads = k_cache.shape[2]
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(3) == 1
    assert query.stride(2) == 1
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)  # contiguous
    if num_tokens == 0:
        return out
    group = q_heads // kv_heads
    group_p2 = triton.next_power_of_2(group)
    decode = max_query_len == 1
    # tl.dot needs 16 rows at least; a decode has one token, a prompt fills 64 rows.
    block_q = max(1, 16 // group_p2) if decode else max(1, 64 // group_p2)
    block_n = 64 if head_dim <= 128 else 32
    if num_splits is None:
        num_splits = _decode_splits(query.device, num_seqs * kv_heads, max_seq_len, block_n)
    num_splits = triton.next_power_of_2(num_splits) if decode else 1
    upcast = query.dtype == torch.float32 or isinstance(
        _tiled_attention_kernel, InterpretedFunction
    )
    if num_splits == 1:
        partial, maxes, sums = out, out, out  # unused: the kernel stores its answer itself
        stride_split = 0
    else:
        partial = torch.empty((num_splits, num_tokens, q_heads, head_dim), dtype=torch.float32,
                              device=query.device)  # fmt: skip
        maxes = torch.empty((num_splits, num_tokens, q_heads), dtype=torch.float32,
                            device=query.device)  # fmt: skip
        sums = torch.empty_like(maxes)
        stride_split = partial.stride(0)
    grid = (num_seqs, triton.cdiv(max_query_len, block_q), kv_heads * num_splits)
    _tiled_attention_kernel[grid](
        partial,
        maxes,
        sums,
        query,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        query_start_loc,
        scale,
        window or 0,
        softcap or 0.0,
        query.stride(0),
        query.stride(1),
        stride_split,
        partial.stride(-3),
        partial.stride(-2),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        num_tokens,
        q_heads,
        GROUP=group,
        GROUP_P2=group_p2,
        BLOCK_Q=block_q,
        BLOCK_SIZE=k_cache.shape[1],
        HEAD_DIM=head_dim,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_N=block_n,
        NUM_SPLITS=num_splits,
        SOFTCAP=softcap is not None,
        UPCAST=upcast,
    )
    if num_splits > 1:
        _merge_splits_kernel[(num_tokens, q_heads)](
            out,
            partial,
            maxes,
            sums,
            num_tokens,
            q_heads,
            HEAD_DIM=head_dim,
            BLOCK_D=triton.next_power_of_2(head_dim),
            NUM_SPLITS=num_splits,
        )
    return out


def _decode_splits(device: torch.device, programs: int, max_seq_len: int, block_n: int) -> int:
    """Enough splits that a decode step's programs cover the device's multiprocessors twice,
    none shorter than four key tiles."""
    if device.type != "cuda":
        return 1
    processors = torch.cuda.get_device_properties(device).multi_processor_count
    wanted = -(-2 * processors // programs)
    return max(1, min(wanted, max_seq_len // (4 * block_n), 16))
