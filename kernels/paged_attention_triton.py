"""Triton kernel for `paged_attention.paged_attention_reference` (same signature).

One program per (sequence, query row, query head): it walks the keys the row sees (`0..position`,
or the `window` up to it) in tiles of BLOCK_N through the block table with an online softmax, in
fp32, each score soft-capped first where the model caps them (Gemma 2).
Programs for rows beyond a sequence's query length do no work (a decode sequence next to a
long prefill costs almost nothing).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _paged_attention_kernel(
    out_ptr,
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
    stride_o_token,
    stride_o_head,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    stride_table_seq,
    GROUP: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SOFTCAP: tl.constexpr,  # whether scores are capped
):
    seq = tl.program_id(0)
    row = tl.program_id(1)
    head = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + seq)
    active = row < q_len
    position = seq_len - q_len + row
    num_keys = tl.where(active, position + 1, 0)
    first_key = tl.where(window > 0, tl.maximum(position - window + 1, 0), 0)
    kv_head = head // GROUP

    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < HEAD_DIM
    token = (q_start + row).to(tl.int64)
    q = tl.load(
        query_ptr + token * stride_q_token + head * stride_q_head + dims,
        mask=dim_mask & active,
        other=0.0,
    ).to(tl.float32)
    q = q * scale

    running_max = tl.full((), float("-inf"), tl.float32)
    running_sum = tl.zeros((), tl.float32)
    acc = tl.zeros((BLOCK_D,), tl.float32)
    table_row = block_tables_ptr + seq.to(tl.int64) * stride_table_seq
    for tile in range(first_key, num_keys, BLOCK_N):
        key_index = tile + tl.arange(0, BLOCK_N)
        key_mask = key_index < num_keys
        block = tl.load(table_row + key_index // BLOCK_SIZE, mask=key_mask, other=0).to(tl.int64)
        offsets = (
            block * stride_cache_block
            + (key_index % BLOCK_SIZE).to(tl.int64) * stride_cache_slot
            + kv_head * stride_cache_head
        )
        tile_mask = key_mask[:, None] & dim_mask[None, :]
        k = tl.load(k_cache_ptr + offsets[:, None] + dims[None, :], mask=tile_mask, other=0.0)
        v = tl.load(v_cache_ptr + offsets[:, None] + dims[None, :], mask=tile_mask, other=0.0)
        scores = tl.sum(q[None, :] * k.to(tl.float32), axis=1)
        if SOFTCAP:  # softcap * tanh(score / softcap), tanh(x) = 2 sigmoid(2x) - 1
            scores = softcap * (2.0 * tl.sigmoid(2.0 * (scores / softcap)) - 1.0)
        scores = tl.where(key_mask, scores, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(scores, axis=0))
        weights = tl.exp(scores - new_max)
        correction = tl.exp(running_max - new_max)
        running_sum = running_sum * correction + tl.sum(weights, axis=0)
        acc = acc * correction + tl.sum(weights[:, None] * v.to(tl.float32), axis=0)
        running_max = new_max

    out = acc / tl.where(running_sum > 0, running_sum, 1.0)  # inactive rows: no keys, 0/0
    tl.store(
        out_ptr + token * stride_o_token + head * stride_o_head + dims,
        out.to(out_ptr.dtype.element_ty),
        mask=dim_mask & active,
    )


def paged_attention_triton(
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
) -> torch.Tensor:
    num_tokens, q_heads, head_dim = query.shape
    num_seqs = seq_lens.shape[0]
    kv_heads = k_cache.shape[2]
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(3) == 1
    assert query.stride(2) == 1
    out = torch.empty_like(query)
    if num_tokens == 0:
        return out
    _paged_attention_kernel[(num_seqs, max_query_len, q_heads)](
        out,
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
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        GROUP=q_heads // kv_heads,
        BLOCK_SIZE=k_cache.shape[1],
        HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_N=32,
        SOFTCAP=softcap is not None,
    )
    return out
