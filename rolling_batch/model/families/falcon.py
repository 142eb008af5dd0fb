"""Falcon: the LayerNorm block (models/layernorm_block.py) with a plain GELU MLP and one of
three attention layouts in its fused `query_key_value` matrix:

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

from ..layers.mlp import PlainMLP
from .layernorm_block import LayerNormDecoderLayer, LayerNormModel, split_per_head_qkv
from .llama import LlamaForCausalLM

_RENAMED = (  # Falcon's checkpoint names -> the native model's
    (re.compile(r"^transformer\.word_embeddings\."), "model.embed_tokens."),
    (re.compile(r"^transformer\.ln_f\."), "model.norm."),
    (re.compile(r"^transformer\.h\."), "model.layers."),
    (re.compile(r"\.self_attention\.dense\."), ".self_attn.o_proj."),
    (re.compile(r"\.ln_attn\."), ".input_layernorm."),
    (re.compile(r"\.ln_mlp\."), ".post_attention_layernorm."),
)


def _num_kv_heads(config) -> int:
    if config.new_decoder_architecture:
        return config.num_kv_heads
    return 1 if config.multi_query else config.num_attention_heads


class FalconModel(LayerNormModel):
    @staticmethod
    def norm_eps(config) -> float:
        return config.layer_norm_epsilon

    def make_layer(self, config, group) -> LayerNormDecoderLayer:
        parallel = config.new_decoder_architecture or config.parallel_attn
        num_norms = config.num_ln_in_parallel_attn or 2  # HF's default for the new architecture
        two_norms = config.new_decoder_architecture and num_norms == 2
        return LayerNormDecoderLayer(
            config.hidden_size,
            config.layer_norm_epsilon,
            self.attention(config, group, _num_kv_heads(config), config.bias),
            PlainMLP(
                config.hidden_size, config.ffn_hidden_size, group, config.activation, config.bias
            ),
            parallel=parallel,
            mlp_norm=two_norms or not parallel,
        )


class FalconForCausalLM(LlamaForCausalLM):
    model_class = FalconModel
    renamed_tensors = _RENAMED

    def __init__(self, config, group, max_positions: int):
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
        config, d = self.config, FalconModel.head_dim(self.config)
        num_q, num_kv = config.num_attention_heads, _num_kv_heads(config)
        rest = fused.shape[1:]
        if config.new_decoder_architecture:
            grouped = fused.view(num_kv, num_q // num_kv + 2, d, *rest)
            q, k, v = grouped[:, :-2], grouped[:, -2], grouped[:, -1]
        elif config.multi_query:
            q, k, v = fused.split([num_q * d, d, d])
        else:
            return split_per_head_qkv(fused, num_q, d)
        return tuple(part.reshape(-1, *rest) for part in (q, k, v))
