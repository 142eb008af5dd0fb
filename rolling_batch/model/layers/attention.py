"""Self-attention over the paged KV cache for a packed batch."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from lmserve.kernels import paged_attention, store_kv
from lmserve.kernels.paged_attention import ReferencePlan

from .linear import QKVLinear, RowLinear
from .norm_and_rotary import RMSNorm, StepRope
from .parallel import HeadShard, TensorParallelGroup


@dataclass
class AttentionMetadata:
    """Where a packed step's tokens come from and where their K/V go (built by the runner)."""

    slot_mapping: torch.Tensor  # [T] cache slot of each new token
    block_tables: torch.Tensor  # [S, max_blocks]
    seq_lens: torch.Tensor  # [S] tokens in cache after this step
    query_start_loc: torch.Tensor  # [S + 1]
    max_query_len: int
    max_seq_len: int
    reference_plan: ReferencePlan | None = None  # CPU without native kernels: the layout
    # The tokens whose outputs the step reads (int64, ascending), None for all: the model
    # returns only theirs, and may skip the last layer's work past attention for the others.
    output_rows: torch.Tensor | None = None

    def store_and_attend(
        self,
        query: torch.Tensor,  # [T, q_heads, head_dim], rotated
        key: torch.Tensor,  # [T, kv_heads, head_dim], rotated
        value: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        scale: float,
        window: int | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        """One layer's attention for the step: its new K/V into the cache, then every query
        row over its sequence's keys (kernels/paged_attention.py); [T, q_heads, head_dim]."""
        k_cache, v_cache = kv_cache
        store_kv(key, value, k_cache, v_cache, self.slot_mapping)
        return paged_attention(
            query,
            k_cache,
            v_cache,
            self.block_tables,
            self.seq_lens,
            self.query_start_loc,
            scale,
            self.max_query_len,
            self.max_seq_len,
            self.reference_plan,
            window=window,
            softcap=softcap,
        )


class Attention(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        heads: HeadShard,
        group: TensorParallelGroup,
        qkv_bias: bool,
        o_bias: bool,
        qk_norm_eps: float | None = None,
    ):
        super().__init__()
        self.heads = heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5
        # Keys this layer sees back from each token (its own included), None for all: set by
        # a family whose layers slide (Mistral, Qwen2's upper layers, Phi-3-mini, Gemma 2/3).
        self.sliding_window: int | None = None
        # Scores squashed into (-softcap, softcap) before the softmax (Gemma 2), None: not.
        self.softcap: float | None = None
        self.qkv_proj = QKVLinear(hidden_size, head_dim, heads, qkv_bias)
        self.o_proj = RowLinear(
            heads.q_start * head_dim, heads.num_q * head_dim, hidden_size, group, o_bias
        )
        # Qwen3's and others': each query and key head RMS-normed over head_dim before the
        # rotation, one weight for all heads (so every rank holds it whole).
        self.q_norm = self.k_norm = None
        if qk_norm_eps is not None:
            self.q_norm = RMSNorm(head_dim, qk_norm_eps)
            self.k_norm = RMSNorm(head_dim, qk_norm_eps)

    def forward(
        self,
        rope: StepRope,
        hidden: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        num_q, num_kv = self.heads.num_q, self.heads.num_kv
        q_size, kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        qkv = self.qkv_proj(hidden)
        # Query and key heads sit side by side in qkv: one rotation serves both.
        if self.q_norm is None:
            query_key = qkv[:, : q_size + kv_size].view(num_tokens, num_q + num_kv, self.head_dim)
        else:
            query_key = self._normed_query_key(qkv)
        query, key = rope.rotate(query_key).split([num_q, num_kv], dim=1)
        value = qkv[:, q_size + kv_size :].view(num_tokens, num_kv, self.head_dim)
        out = meta.store_and_attend(
            query, key, value, kv_cache, self.scale, self.sliding_window, self.softcap
        )
        return self.o_proj(out.reshape(num_tokens, q_size))

    def _normed_query_key(self, qkv: torch.Tensor) -> torch.Tensor:
        """[T, num_q + num_kv, head_dim]: the query heads through q_norm, the key heads
        through k_norm, side by side again for the one rotation."""
        num_tokens, d = qkv.shape[0], self.head_dim
        q_size, kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        # contiguous(): a slice of one head a token reshapes to a strided view, not a copy.
        query = self.q_norm(qkv[:, :q_size].reshape(-1, d).contiguous()).view(num_tokens, -1, d)
        key = self.k_norm(qkv[:, q_size : q_size + kv_size].reshape(-1, d).contiguous())
        return torch.cat((query, key.view(num_tokens, -1, d)), dim=1)
