"""Causal attention of a packed batch over a paged KV cache.

One call serves every kind of sequence in a step: a whole prompt, a chunk of a prompt whose
earlier part is already cached, or one decode token. Sequence `s` owns query rows
`query_start_loc[s]:query_start_loc[s+1]` (its newest `q_len` tokens) and has `seq_lens[s]`
tokens in the cache, its K/V already stored; query row `i` sits at absolute position
`seq_lens[s] - q_len + i` and attends to keys `0..position`. Grouped-query attention: query
head `h` reads KV head `h // (q_heads // kv_heads)`.

The torch reference (CPU) pads sequences to the longest query and context so one batched
matmul serves many (a Python loop per sequence costs more than the math at decode sizes).
Everything that depends only on the step's layout (which cache slots each sequence reads,
the causal mask, where query rows go) is a `ReferencePlan`, built once per step and shared by
every layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_BUCKET = 16


@dataclass(frozen=True)
class _Group:
    """Sequences padded together: all decodes, or all prompt chunks."""

    rows: torch.Tensor | None  # query rows of these sequences; None: every row, in order
    slots: torch.Tensor  # [S * L] cache slot of each (sequence, key position), padding -> 0
    num_seqs: int
    context: int  # L, the longest context
    query_len: int  # Q, the longest query
    token_seq: torch.Tensor | None  # per query row: its sequence and row within it
    token_row: torch.Tensor | None  # (None for decodes: one row each, in order)
    bias: torch.Tensor  # [S, 1, Q, L] fp32: 0 where the key is visible, -inf where not


@dataclass(frozen=True)
class ReferencePlan:
    groups: tuple[_Group, ...]

    @classmethod
    def build(
        cls,
        block_tables: torch.Tensor,  # [S, max_blocks] int, unused entries any valid block id
        seq_lens: torch.Tensor,  # [S] int: cached tokens, the new ones included
        query_start_loc: torch.Tensor,  # [S + 1] int
        block_size: int,
    ) -> ReferencePlan:
        """Decodes and prompt chunks are padded separately: one 256-token chunk beside 31
        decodes would otherwise pad every decode to 256 query rows."""
        q_lens = (query_start_loc[1:] - query_start_loc[:-1]).long()
        decoding = q_lens == 1
        if bool(decoding.all()) or not bool(decoding.any()):
            everyone = torch.arange(len(q_lens), device=q_lens.device)
            return cls((_group(everyone, None, block_tables, seq_lens, q_lens, block_size),))
        groups = []
        for members in (decoding, ~decoding):
            seqs = members.nonzero().flatten()
            starts = query_start_loc[:-1][seqs].long()
            rows = torch.repeat_interleave(starts, q_lens[seqs]) + _offsets_within(q_lens[seqs])
            groups.append(_group(seqs, rows, block_tables, seq_lens, q_lens, block_size))
        return cls(tuple(groups))


def _group(seqs, rows, block_tables, seq_lens, q_lens, block_size) -> _Group:
    device = block_tables.device
    lens, seq_len = q_lens[seqs], seq_lens[seqs].long()
    tables = block_tables[seqs].long()
    # Lengths rounded up to a multiple of _BUCKET (within the blocks the table names): oneDNN
    # builds a new matmul for every new shape, ~0.6 ms each here, and a context that grows by
    # one token every step would otherwise be a new shape every step. The extra keys are
    # masked out, the extra query rows dropped.
    context = min(_round_up(int(seq_len.max())), tables.shape[1] * block_size)
    query_len = _round_up(int(lens.max())) if int(lens.max()) > 1 else 1
    key_index = torch.arange(context, device=device)
    slots = tables[:, key_index // block_size] * block_size + key_index % block_size
    positions = (seq_len - lens)[:, None] + torch.arange(query_len, device=device)
    # Keys up to each row's position (so also < seq_len). Every real row sees at least key 0;
    # padding rows are dropped afterwards.
    visible = key_index[None, None, :] <= positions[:, :, None]
    bias = torch.zeros(visible.shape, device=device).masked_fill_(~visible, float("-inf"))
    token_seq = token_row = None
    if query_len > 1:
        token_seq = torch.repeat_interleave(torch.arange(len(seqs), device=device), lens)
        token_row = _offsets_within(lens)
    return _Group(
        rows, slots.flatten(), len(seqs), context, query_len, token_seq, token_row, bias[:, None]
    )


def _round_up(length: int) -> int:
    return -(-length // _BUCKET) * _BUCKET


def _offsets_within(lens: torch.Tensor) -> torch.Tensor:
    """[0..l0-1, 0..l1-1, ...] for lengths l0, l1, ..."""
    total = int(lens.sum())
    starts = torch.repeat_interleave(lens.cumsum(0) - lens, lens)
    return torch.arange(total, device=lens.device) - starts


def attend(
    query: torch.Tensor,  # [T, q_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    v_cache: torch.Tensor,
    plan: ReferencePlan,
    scale: float,
) -> torch.Tensor:
    if len(plan.groups) == 1 and plan.groups[0].rows is None:
        return _attend_group(query, k_cache, v_cache, plan.groups[0], scale)
    out = torch.empty_like(query)
    for group in plan.groups:
        out[group.rows] = _attend_group(query[group.rows], k_cache, v_cache, group, scale)
    return out


def _attend_group(query, k_cache, v_cache, group: _Group, scale: float) -> torch.Tensor:
    num_tokens, q_heads, head_dim = query.shape
    kv_heads = k_cache.shape[2]
    shape = (group.num_seqs, group.context, kv_heads, head_dim)
    # index_select: several times faster than advanced indexing for this gather on CPU.
    keys = k_cache.view(-1, kv_heads, head_dim).index_select(0, group.slots).view(shape)
    values = v_cache.view(-1, kv_heads, head_dim).index_select(0, group.slots).view(shape)
    if group.token_seq is None:
        padded = query.view(group.num_seqs, 1, q_heads, head_dim)
    else:
        padded = query.new_zeros(group.num_seqs, group.query_len, q_heads, head_dim)
        padded[group.token_seq, group.token_row] = query
    if query.dtype == torch.float32:
        # SDPA's fused softmax: half the time of einsum + mask + softmax in fp32 here.
        out = torch.nn.functional.scaled_dot_product_attention(
            padded.transpose(1, 2),
            keys.transpose(1, 2),
            values.transpose(1, 2),
            attn_mask=group.bias,
            scale=scale,
            enable_gqa=True,  # query head h reads KV head h // (q_heads // kv_heads)
        ).transpose(1, 2)
    else:
        out = _attend_low_precision(padded, keys, values, group.bias, scale)
    if group.token_seq is None:
        return out.reshape(num_tokens, q_heads, head_dim)
    return out[group.token_seq, group.token_row]


def _attend_low_precision(query, keys, values, bias, scale) -> torch.Tensor:
    """bf16/fp16 as HF's eager attention computes it: scores and values in the model dtype,
    softmax in fp32. CPU SDPA in bf16 measured 3-4x slower than this here."""
    num_seqs, query_len, q_heads, head_dim = query.shape
    kv_heads = keys.shape[2]
    group = q_heads // kv_heads
    # [S, kv, group * Q, d]: the query heads that share a KV head are stacked as rows.
    stacked = query.view(num_seqs, query_len, kv_heads, group, head_dim).permute(0, 2, 3, 1, 4)
    stacked = stacked.reshape(num_seqs, kv_heads, group * query_len, head_dim)
    scores = torch.matmul(stacked, keys.permute(0, 2, 3, 1)).float().mul_(scale)
    scores = scores.view(num_seqs, kv_heads, group, query_len, -1).add_(bias[:, :, None])
    probs = torch.softmax(scores, dim=-1).to(query.dtype)
    probs = probs.view(num_seqs, kv_heads, group * query_len, -1)
    out = torch.matmul(probs, values.transpose(1, 2))  # [S, kv, group * Q, d]
    out = out.view(num_seqs, kv_heads, group, query_len, head_dim).permute(0, 3, 1, 2, 4)
    return out.reshape(num_seqs, query_len, q_heads, head_dim)


def paged_attention_reference(
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
    """The whole computation for one layer; a model builds the plan once per step instead."""
    plan = ReferencePlan.build(block_tables, seq_lens, query_start_loc, k_cache.shape[1])
    return attend(query, k_cache, v_cache, plan, scale)


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
    plan: ReferencePlan | None = None,
) -> torch.Tensor:
    """`plan`: the step's `ReferencePlan` on CPU (built here when not given); unused on CUDA."""
    if query.is_cuda:
        from .paged_attention_triton import paged_attention_triton

        args = (query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale)
        return paged_attention_triton(*args, max_query_len, max_seq_len)
    if plan is None:
        plan = ReferencePlan.build(block_tables, seq_lens, query_start_loc, k_cache.shape[1])
    return attend(query, k_cache, v_cache, plan, scale)
