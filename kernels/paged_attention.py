"""Causal attention of a packed batch over a paged KV cache.

One call serves every kind of sequence in a step: a whole prompt, a chunk of a prompt whose
earlier part is already cached, or one decode token. Sequence `s` owns query rows
`query_start_loc[s]:query_start_loc[s+1]` (its newest `q_len` tokens) and has `seq_lens[s]`
tokens in the cache, its K/V already stored; query row `i` sits at absolute position
`seq_lens[s] - q_len + i` and attends to keys `0..position`, or with a sliding `window` to the
`window` keys up to its position (`position - window < key <= position`, as HF masks it).
Grouped-query attention: query head `h` reads KV head `h // (q_heads // kv_heads)`. A `softcap`
(Gemma 2's) squashes each scaled score into (-softcap, softcap) with tanh before the softmax.

On CPU the C++ kernel (`cpu_native`) serves, on CUDA the Triton one, windows and soft-capping
included; the torch reference here is what they are tested against and the fallback without a
compiler. The reference pads sequences to the longest query and context so one batched matmul
serves many (a Python loop per sequence costs more than the math at decode sizes). Everything
that depends only on the step's layout (which cache slots each sequence reads, the causal
mask, where query rows go) is a `ReferencePlan`, built once per step and shared by every
layer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from . import cpu_native

_BUCKET = 16


@dataclass(frozen=True)
class _Group:
    """Sequences padded together: decodes of similar context length, or the prompt chunks."""

    rows: torch.Tensor | None  # query rows of these sequences; None: every row, in order
    slots: torch.Tensor  # [S * L] cache slot of each (sequence, key position), padding -> 0
    num_seqs: int
    context: int  # L, the longest context
    query_len: int  # Q, the longest query
    token_seq: torch.Tensor | None  # per query row: its sequence and row within it
    token_row: torch.Tensor | None  # (None for decodes: one row each, in order)
    bias: torch.Tensor  # [S, 1, Q, L] fp32: 0 where the key is visible, -inf where not
    positions: torch.Tensor  # [S, Q] each query row's position (padding rows continue)
    _head_rows: dict = field(default_factory=dict, compare=False)
    _window_bias: dict = field(default_factory=dict, compare=False)

    def bias_for(self, window: int | None) -> torch.Tensor:
        """`bias`, with the keys at or before `position - window` hidden too where a window is
        given; built by the first layer with that window, reused by the rest."""
        if window is None or window >= self.context:
            return self.bias
        bias = self._window_bias.get(window)
        if bias is None:
            key_index = torch.arange(self.context, device=self.bias.device)
            gone = key_index[None, None, :] <= self.positions[:, :, None] - window
            bias = self.bias.masked_fill(gone[:, None], float("-inf"))
            self._window_bias[window] = bias
        return bias

    def head_major_rows(self, kv_heads: int) -> torch.Tensor:
        """Rows of a cache seen as [slots * kv_heads, head_dim], ordered (head, sequence,
        key position); built by the first layer, reused by the rest."""
        rows = self._head_rows.get(kv_heads)
        if rows is None:
            heads = torch.arange(kv_heads, device=self.slots.device)[:, None]
            rows = (self.slots[None, :] * kv_heads + heads).flatten()
            self._head_rows[kv_heads] = rows
        return rows


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
        decodes would otherwise pad every decode to 256 query rows. Decodes of very different
        context lengths are split further (see `_split_by_context`)."""
        q_lens = (query_start_loc[1:] - query_start_loc[:-1]).long()
        decoding = q_lens == 1
        decodes = _split_by_context(decoding.nonzero().flatten(), seq_lens)
        if len(decodes) <= 1 and (bool(decoding.all()) or not bool(decoding.any())):
            everyone = torch.arange(len(q_lens), device=q_lens.device)
            return cls((_group(everyone, None, block_tables, seq_lens, q_lens, block_size),))
        members = [*decodes, (~decoding).nonzero().flatten()]
        groups = []
        for seqs in members:
            if len(seqs) == 0:
                continue
            starts = query_start_loc[:-1][seqs].long()
            rows = torch.repeat_interleave(starts, q_lens[seqs]) + _offsets_within(q_lens[seqs])
            groups.append(_group(seqs, rows, block_tables, seq_lens, q_lens, block_size))
        return cls(tuple(groups))


# A group's fixed cost (its own gathers, matmuls, softmax: ~20 more ops per layer) in padded
# keys' worth of work, measured on the 2-core CPU; and at most this many decode groups.
_GROUP_COST_KEYS = 2048
_MAX_DECODE_GROUPS = 4


def _split_by_context(seqs: torch.Tensor, seq_lens: torch.Tensor) -> list[torch.Tensor]:
    """Decoding sequences in groups of similar context length. Every member of a group is
    padded to the group's longest context, so a few long sequences beside many short ones
    would make the short ones cost as much as the long. Sorted longest first; a group is cut
    where the keys saved (sequences after the cut x the drop in length) beat a group's cost."""
    if len(seqs) == 0:
        return []
    lengths, order = seq_lens[seqs].long().sort(descending=True)
    seqs = seqs[order]
    groups, start = [], 0
    while len(groups) < _MAX_DECODE_GROUPS - 1:
        tail = lengths[start:]
        saved = (len(tail) - torch.arange(len(tail))) * (tail[0] - tail)
        cut = int(saved.argmax())
        if cut == 0 or int(saved[cut]) < _GROUP_COST_KEYS:
            break
        groups.append(seqs[start : start + cut])
        start += cut
    groups.append(seqs[start:])
    return groups


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
        rows,
        slots.flatten(),
        len(seqs),
        context,
        query_len,
        token_seq,
        token_row,
        bias[:, None],
        positions,
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
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    limits = (window, softcap)
    if len(plan.groups) == 1 and plan.groups[0].rows is None:
        return _attend_group(query, k_cache, v_cache, plan.groups[0], scale, *limits)
    out = torch.empty_like(query)
    for group in plan.groups:
        out[group.rows] = _attend_group(query[group.rows], k_cache, v_cache, group, scale, *limits)
    return out


def _attend_group(
    query, k_cache, v_cache, group: _Group, scale: float, window=None, softcap=None
) -> torch.Tensor:
    """Scores and values in the model dtype, softmax in fp32 (HF's eager attention: exact in
    fp32; torch's SDPA in bf16 measured 3-4x slower on this CPU)."""
    num_tokens, q_heads, head_dim = query.shape
    num_seqs, query_len, context = group.num_seqs, group.query_len, group.context
    kv_heads = k_cache.shape[2]
    heads_per_kv = q_heads // kv_heads  # query head h reads KV head h // heads_per_kv
    # Head-major K/V, [kv, S, L, d], gathered in one index_select over the cache's
    # (slot, head) rows: 4x faster here than gathering slots and transposing.
    rows = group.head_major_rows(kv_heads)
    shape = (kv_heads, num_seqs, context, head_dim)
    keys = k_cache.view(-1, head_dim).index_select(0, rows).view(shape)
    values = v_cache.view(-1, head_dim).index_select(0, rows).view(shape)
    if group.token_seq is None:
        padded = query.view(num_seqs, 1, q_heads, head_dim)
    else:
        padded = query.new_zeros(num_seqs, query_len, q_heads, head_dim)
        padded[group.token_seq, group.token_row] = query
    # [kv, S, heads_per_kv * Q, d]: the query heads that share a KV head are stacked as rows.
    stacked = padded.view(num_seqs, query_len, kv_heads, heads_per_kv, head_dim)
    stacked = stacked.permute(2, 0, 3, 1, 4).reshape(kv_heads, num_seqs, -1, head_dim)
    scores = torch.matmul(stacked, keys.transpose(-1, -2)).float().mul_(scale)
    if softcap is not None:
        scores = torch.tanh(scores.div_(softcap)).mul_(softcap)
    scores = scores.view(kv_heads, num_seqs, heads_per_kv, query_len, context)
    scores.add_(group.bias_for(window).view(1, num_seqs, 1, query_len, context))
    probs = torch.softmax(scores, dim=-1).to(query.dtype)
    out = torch.matmul(probs.view(kv_heads, num_seqs, -1, context), values)
    out = out.view(kv_heads, num_seqs, heads_per_kv, query_len, head_dim)
    out = out.permute(1, 3, 0, 2, 4).reshape(num_seqs, query_len, q_heads, head_dim)
    if group.token_seq is None:
        return out.view(num_tokens, q_heads, head_dim)
    return out[group.token_seq, group.token_row]


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
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """The whole computation for one layer; a model builds the plan once per step instead."""
    plan = ReferencePlan.build(block_tables, seq_lens, query_start_loc, k_cache.shape[1])
    return attend(query, k_cache, v_cache, plan, scale, window, softcap)


# The CUDA kernel: "per_row" (paged_attention_triton.py: one program a query row and head,
# checked on an H100) until "tiled" (paged_attention_tiled.py: FlashAttention-style, K/V read
# once a head group, decodes split over long contexts; so far checked in Triton's interpreter
# only) has been checked and timed on a GPU: benchmarks/gpu_bench.py times steps with each.
CUDA_KERNELS = ("per_row", "tiled")
cuda_kernel = "per_row"


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
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """CUDA: the Triton kernel `cuda_kernel` names. CPU: the C++ kernel, which reads the
    cache in place; without it the torch reference with `plan`, the step's `ReferencePlan`
    (built here if not given). A `window` no sequence's context outgrows is no window."""
    if window is not None and max_seq_len <= window:
        window = None
    args = (query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale)
    if query.is_cuda:
        if cuda_kernel == "tiled":
            from .paged_attention_tiled import paged_attention_tiled as kernel
        else:
            from .paged_attention_triton import paged_attention_triton as kernel
        return kernel(*args, max_query_len, max_seq_len, window, softcap)
    native = cpu_native.native_ops()
    if native is not None:
        return native.paged_attention(*args, window or 0, softcap or 0.0)
    if plan is None:
        plan = ReferencePlan.build(block_tables, seq_lens, query_start_loc, k_cache.shape[1])
    return attend(query, k_cache, v_cache, plan, scale, window, softcap)
