"""Falcon: LayerNorm with bias, a plain GELU MLP, rotary positions, and one of three attention
layouts in its fused `query_key_value` matrix:

- Falcon-7B (`multi_query`): all query heads, then one K head and one V head;
- Falcon-40B/180B and Falcon2 (`new_decoder_architecture`): per KV group, its query heads, then
  its K head and V head;
- neither: per head, its query, key and value rows.

The matrix is split into Llama's q/k/v projections as it loads (query heads in KV-group order,
as HF's attention uses them), so the attention layer and its sharding are Llama's. Attention and
MLP read the same normed input and add to the stream together (`parallel_attn`; with the new
architecture each has a LayerNorm of its own, `ln_attn` and `ln_mlp`), or one after the other
as Llama's. ALiBi checkpoints (Falcon-RW) are refused by name: no rotary to apply.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch
from torch import nn
from transformers.activations import ACT2FN

from ..layers.attention import Attention
from ..layers.embedding import VocabParallelEmbedding
from ..layers.linear import MergedColumnLinear, RowLinear
from ..layers.norm_and_rotary import LayerNorm, RotaryEmbedding
from ..layers.parallel import TensorParallelGroup, balanced_split, shard_heads
from .llama import LlamaForCausalLM, LlamaModel

_RENAMED = (  # Falcon's checkpoint names -> the native model's
    (re.compile(r"^transformer\.word_embeddings\."), "model.embed_tokens."),
    (re.compile(r"^transformer\.ln_f\."), "model.norm."),
    (re.compile(r"^transformer\.h\."), "model.layers."),
    (re.compile(r"\.self_attention\.dense\."), ".self_attn.o_proj."),
)


def _head_dim(config) -> int:
    return config.hidden_size // config.num_attention_heads


def _num_kv_heads(config) -> int:
    if config.new_decoder_architecture:
        return config.num_kv_heads
    return 1 if config.multi_query else config.num_attention_heads


class FalconMLP(nn.Module):
    def __init__(self, config, group: TensorParallelGroup):
        super().__init__()
        size = config.ffn_hidden_size
        self.dense_h_to_4h = MergedColumnLinear(config.hidden_size, [size], group, config.bias)
        start, local = balanced_split(size, group.world_size, group.rank)
        self.dense_4h_to_h = RowLinear(start, local, config.hidden_size, group, config.bias)
        self.act = ACT2FN[config.activation]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dense_4h_to_h(self.act(self.dense_h_to_4h(x)))


class FalconDecoderLayer(nn.Module):
    def __init__(self, config, group: TensorParallelGroup):
        super().__init__()
        heads = shard_heads(
            config.num_attention_heads, _num_kv_heads(config), group.world_size, group.rank
        )
        hidden, eps = config.hidden_size, config.layer_norm_epsilon
        bias = config.bias
        self.self_attn = Attention(hidden, _head_dim(config), heads, group, bias, bias)
        self.mlp = FalconMLP(config, group)
        self.parallel = config.new_decoder_architecture or config.parallel_attn
        num_norms = config.num_ln_in_parallel_attn or 2  # HF's default for the new architecture
        self.two_norms = config.new_decoder_architecture and num_norms == 2
        if self.two_norms:
            self.ln_attn, self.ln_mlp = LayerNorm(hidden, eps), LayerNorm(hidden, eps)
        else:
            self.input_layernorm = LayerNorm(hidden, eps)
        if not self.parallel:
            self.post_attention_layernorm = LayerNorm(hidden, eps)

    def forward(self, rope, hidden, residual, kv_cache, meta):
        """(what this layer adds to the stream, the stream before it), as Llama's layers."""
        first_norm = self.ln_attn if self.two_norms else self.input_layernorm
        if residual is None:
            residual, normed = hidden, first_norm(hidden)
        else:
            normed, residual = first_norm(hidden, residual)
        attention = self.self_attn(rope, normed, kv_cache, meta)
        if not self.parallel:
            normed, residual = self.post_attention_layernorm(attention, residual)
            return self.mlp(normed), residual
        mlp_input = self.ln_mlp(residual) if self.two_norms else normed
        return self.mlp(mlp_input) + attention, residual  # HF: mlp_output += attention_output


class FalconModel(LlamaModel):
    native_stack_layers = False

    def __init__(self, config, group, max_positions: int, variant=None):
        nn.Module.__init__(self)
        self.rotary = RotaryEmbedding(config, _head_dim(config), max_positions)
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, group)
        self.layers = nn.ModuleList(
            FalconDecoderLayer(config, group) for _ in range(config.num_hidden_layers)
        )
        self.norm = LayerNorm(config.hidden_size, config.layer_norm_epsilon)
        self.native_stack = None
        self.lora_step = None
        self.embed_scale = None


class FalconForCausalLM(LlamaForCausalLM):
    model_class = FalconModel
    renamed_tensors = _RENAMED

    def __init__(self, config, group: TensorParallelGroup, max_positions: int):
        if getattr(config, "alibi", False):
            raise ValueError("Falcon with ALiBi position biases (Falcon-RW) is not served")
        super().__init__(config, group, max_positions)

    def enable_lora(self, num_slots: int, max_rank: int, step) -> dict:
        raise ValueError("LoRA adapters are served on Llama-family models, not on Falcon")

    def checkpoint_tensors(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterable[tuple[str, torch.Tensor]]:
        for name, tensor in weights:
            name = self.checkpoint_name(name)
            if ".self_attention.query_key_value." not in name:
                yield name, tensor
                continue
            prefix = name.replace(".self_attention.query_key_value.", ".self_attn.{}_proj.")
            for projection, part in zip("qkv", self._split_qkv(tensor)):
                yield prefix.format(projection), part

    def _split_qkv(self, fused: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(q, k, v) rows of the fused matrix (or bias) in each layout."""
        config, d = self.config, _head_dim(self.config)
        num_q, num_kv = config.num_attention_heads, _num_kv_heads(config)
        rest = fused.shape[1:]
        if config.new_decoder_architecture:
            grouped = fused.view(num_kv, num_q // num_kv + 2, d, *rest)
            q, k, v = grouped[:, :-2], grouped[:, -2], grouped[:, -1]
        elif config.multi_query:
            q, k, v = fused.split([num_q * d, d, d])
        else:
            q, k, v = fused.view(num_q, 3, d, *rest).unbind(1)
        return tuple(part.reshape(-1, *rest) for part in (q, k, v))
