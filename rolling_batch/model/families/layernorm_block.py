"""The LayerNorm decoder block shared by Falcon and GPT-NeoX (Pythia): LayerNorms with bias, a
plain MLP (models' `dense_h_to_4h`, `dense_4h_to_h`), rotary positions, Q/K/V fused in one
checkpoint matrix, and attention and MLP either in sequence (as Llama's) or in parallel, both
reading the stream before the layer and adding to it together: through one norm (Falcon-7B) or
a norm each (Falcon-40B's `ln_attn`/`ln_mlp`, GPT-NeoX's `use_parallel_residual`). Each
family's module maps its config and checkpoint names onto this one."""

from __future__ import annotations

import torch
from torch import nn

from ..layers.attention import Attention
from ..layers.embedding import VocabParallelEmbedding
from ..layers.norm_and_rotary import LayerNorm
from ..layers.parallel import TensorParallelGroup, shard_heads
from .llama import LlamaModel


class LayerNormDecoderLayer(nn.Module):
    """`input_layernorm` norms attention's input; `post_attention_layernorm` the MLP's: on the
    stream after attention (sequential), on the stream before the layer (parallel with a norm
    each), or absent (parallel, the MLP reading attention's normed input)."""

    def __init__(
        self,
        hidden_size: int,
        eps: float,
        attention: Attention,
        mlp: nn.Module,
        parallel: bool,
        mlp_norm: bool,
    ):
        super().__init__()
        self.self_attn, self.mlp, self.parallel = attention, mlp, parallel
        self.input_layernorm = LayerNorm(hidden_size, eps)
        self.post_attention_layernorm = LayerNorm(hidden_size, eps) if mlp_norm else None

    def forward(self, rope, hidden, residual, kv_cache, meta):
        """(what this layer adds to the stream, the stream before it), as Llama's layers."""
        if residual is None:
            residual, normed = hidden, self.input_layernorm(hidden)
        else:
            normed, residual = self.input_layernorm(hidden, residual)
        attention = self.self_attn(rope, normed, kv_cache, meta)
        if not self.parallel:
            normed, residual = self.post_attention_layernorm(attention, residual)
            return self.mlp(normed), residual
        if self.post_attention_layernorm is not None:
            normed = self.post_attention_layernorm(residual)
        return self.mlp(normed) + attention, residual  # HF: (mlp + attention) + stream


class LayerNormModel(LlamaModel):
    """The stack of LayerNormDecoderLayers with a final LayerNorm; the family's subclass
    builds the layers (`make_layer`) from its config."""

    native_stack_layers = False  # the C++ stack runs RMSNorm blocks

    def __init__(self, config, group, max_positions: int, variant=None):
        nn.Module.__init__(self)
        self.rotary = self.make_rotary(config, self.head_dim(config), max_positions)
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, group)
        self.layers = nn.ModuleList(
            self.make_layer(config, group) for _ in range(config.num_hidden_layers)
        )
        self.norm = LayerNorm(config.hidden_size, self.norm_eps(config))
        self.native_stack = None
        self.lora_step = None
        self.embed_scale = None

    @staticmethod
    def head_dim(config) -> int:
        return config.hidden_size // config.num_attention_heads

    @staticmethod
    def norm_eps(config) -> float:
        raise NotImplementedError

    def make_layer(self, config, group: TensorParallelGroup) -> LayerNormDecoderLayer:
        raise NotImplementedError

    def attention(self, config, group, num_kv_heads: int, bias: bool) -> Attention:
        heads = shard_heads(config.num_attention_heads, num_kv_heads, group.world_size, group.rank)
        return Attention(config.hidden_size, self.head_dim(config), heads, group, bias, bias)


def split_per_head_qkv(fused: torch.Tensor, num_heads: int, head_dim: int) -> tuple:
    """(q, k, v) rows of a fused Q/K/V matrix (or bias) laid out head by head, each head's
    query, key and value rows together (GPT-NeoX's, and Falcon's without multi-query)."""
    rest = fused.shape[1:]
    q, k, v = fused.view(num_heads, 3, head_dim, *rest).unbind(1)
    return tuple(part.reshape(-1, *rest) for part in (q, k, v))
