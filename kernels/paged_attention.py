"""Causal attention of a packed batch over a paged KV cache.

One call serves every kind of sequence in a step: a whole prompt, a chunk of a prompt whose
earlier part is already cached, or one decode token. Sequence `s` owns query rows
`query_start_loc[s]:query_start_loc[s+1]` (its newest `q_len` tokens) and has `seq_lens[s]`
tokens in the cache, its K/V already stored; query row `i` sits at absolute position
`seq_lens[s] - q_len + i` and attends to keys `0..position`. Grouped-query attention: query
head `h` reads KV head `h // (q_heads // kv_heads)`.
"""

from __future__ import annotations

import torch


def paged_attention_reference(
    query: torch.Tensor,  # [T, q_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [S, max_blocks] int, unused entries any valid block id
    seq_lens: torch.Tensor,  # [S] int: cached tokens, the new ones included
    query_start_loc: torch.Tensor,  # [S + 1] int
    scale: float,
    max_query_len: int,
    max_seq_len: int,
) -> torch.Tensor:
    """Pads sequences to the longest query and context so one batched einsum serves many
    (a Python loop per sequence costs more than the math at decode sizes). Decodes and prompt
    chunks are padded separately: one 256-token chunk beside 31 decodes would otherwise pad
    every decode to 256 query rows."""
    q_lens = query_start_loc[1:] - query_start_loc[:-1]
    decoding = q_lens == 1
    if bool(decoding.all()) or not bool(decoding.any()):
        return _padded_attention(
            query,
            k_cache,
            v_cache,
            block_tables,
            seq_lens,
            query_start_loc,
            scale,
            max_query_len,
            max_seq_len,
        )
    out = torch.empty_like(query)
    for group in (decoding, ~decoding):
        seqs = group.nonzero().flatten()
        starts = query_start_loc[:-1][seqs].long()
        lens = q_lens[seqs].long()
        rows = torch.repeat_interleave(starts, lens) + _offsets_within(lens)
        group_start_loc = torch.zeros(len(seqs) + 1, dtype=query_start_loc.dtype)
        group_start_loc[1:] = lens.cumsum(0)
        out[rows] = _padded_attention(
            query[rows],
            k_cache,
            v_cache,
            block_tables[seqs],
            seq_lens[seqs],
            group_start_loc.to(query.device),
            scale,
            int(lens.max()),
            int(seq_lens[seqs].max()),
        )
    return out


def _offsets_within(lens: torch.Tensor) -> torch.Tensor:
    """[0..l0-1, 0..l1-1, ...] for lengths l0, l1, ..."""
    total = int(lens.sum())
    starts = torch.repeat_interleave(lens.cumsum(0) - lens, lens)
    return torch.arange(total, device=lens.device) - starts


def _padded_attention(
    query,
    k_cache,
    v_cache,
    block_tables,
    seq_lens,
    query_start_loc,
    scale,
    max_query_len,
    max_seq_len,
) -> torch.Tensor:
    num_seqs = seq_lens.shape[0]
    num_tokens, q_heads, head_dim = query.shape
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    num_blocks = -(-max_seq_len // block_size)
    tables = block_tables[:, :num_blocks].long()
    if num_blocks == 1:  # contiguous slots: gather only the filled part of each block
        k_cache, v_cache = k_cache[:, :max_seq_len], v_cache[:, :max_seq_len]
    keys = k_cache[tables].reshape(num_seqs, -1, kv_heads, head_dim)
    values = v_cache[tables].reshape(num_seqs, -1, kv_heads, head_dim)
    keys, values = keys[:, :max_seq_len].float(), values[:, :max_seq_len].float()

    q_lens = (query_start_loc[1:] - query_start_loc[:-1]).long()
    token_seq = torch.repeat_interleave(torch.arange(num_seqs, device=query.device), q_lens)
    token_row = torch.arange(num_tokens, device=query.device) - query_start_loc[token_seq].long()
    padded = query.new_zeros(num_seqs, max_query_len, q_heads, head_dim, dtype=torch.float32)
    padded[token_seq, token_row] = query.float()
    positions = (seq_lens.long() - q_lens)[:, None] + torch.arange(
        max_query_len, device=query.device
    )
    key_index = torch.arange(max_seq_len, device=query.device)
    # [S, 1, q, L]; also < seq_len. Every real row sees at least key 0; padding rows are dropped.
    allowed = (key_index[None, None, :] <= positions[:, :, None])[:, None]
    # SDPA's fused softmax: half the time of einsum + mask + softmax for decode batches here.
    out = torch.nn.functional.scaled_dot_product_attention(
        padded.transpose(1, 2),
        keys.transpose(1, 2),
        values.transpose(1, 2),
        attn_mask=allowed,
        scale=scale,
        enable_gqa=True,  # query head h reads KV head h // (q_heads // kv_heads)
    ).transpose(1, 2)
    return out[token_seq, token_row].to(query.dtype)


def paged_attention(
    query,
    k_cache,
    v_cache,
    block_tables,
    seq_lens,
    query_start_loc,
    scale,
    max_query_len,
    max_seq_len,
) -> torch.Tensor:
    args = (query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale)
    if query.is_cuda:
        from .paged_attention_triton import paged_attention_triton

        return paged_attention_triton(*args, max_query_len, max_seq_len)
    return paged_attention_reference(*args, max_query_len, max_seq_len)
