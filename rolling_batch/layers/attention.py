"""Self-attention over the paged KV cache for a packed batch."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from lmserve.kernels import paged_attention, store_kv
from lmserve.kernels.paged_attention import ReferencePlan

from .linear import QKVLinear, RowLinear
from .norm_and_rotary import StepRope
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


class Attention(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        heads: HeadShard,
        group: TensorParallelGroup,
        qkv_bias: bool,
        o_bias: bool,
    ):
        super().__init__()
        self.heads = heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5
        self.qkv_proj = QKVLinear(hidden_size, head_dim, heads, qkv_bias)
        self.o_proj = RowLinear(
            heads.q_start * head_dim, heads.num_q * head_dim, hidden_size, group, o_bias
        )

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
        query_key = qkv[:, : q_size + kv_size].view(num_tokens, num_q + num_kv, self.head_dim)
        query, key = rope.rotate(query_key).split([num_q, num_kv], dim=1)
        value = qkv[:, q_size + kv_size :].view(num_tokens, num_kv, self.head_dim)
        k_cache, v_cache = kv_cache
        store_kv(key, value, k_cache, v_cache, meta.slot_mapping)
        out = paged_attention(
            query,
            k_cache,
            v_cache,
            meta.block_tables,
            meta.seq_lens,
            meta.query_start_loc,
            self.scale,
            meta.max_query_len,
            meta.max_seq_len,
            meta.reference_plan,
        )
        return self.o_proj(out.reshape(num_tokens, q_size))
