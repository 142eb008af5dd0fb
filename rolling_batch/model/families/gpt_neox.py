"""GPT-NeoX and Pythia: the LayerNorm block (models/layernorm_block.py) with attention and MLP
in parallel, each through a norm of its own (`use_parallel_residual`, every Pythia), or in
sequence; a rotation of the leading `partial_rotary_factor` of each head (Pythia's 0.25); a
plain GELU MLP; Q/K/V fused head by head in `query_key_value`, split into Llama's projections
as it loads; an untied output embedding (`embed_out`). The attention-mask buffers older
checkpoints saved (`attention.bias`, `attention.masked_bias`) are no weights and are skipped."""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch

from ..layers.mlp import PlainMLP
from .layernorm_block import LayerNormDecoderLayer, LayerNormModel, split_per_head_qkv
from .llama import LlamaForCausalLM

_RENAMED = (  # GPT-NeoX's checkpoint names -> the native model's
    (re.compile(r"^gpt_neox\.embed_in\."), "model.embed_tokens."),
    (re.compile(r"^gpt_neox\.final_layer_norm\."), "model.norm."),
    (re.compile(r"^gpt_neox\.layers\."), "model.layers."),
    (re.compile(r"\.attention\.dense\."), ".self_attn.o_proj."),
    (re.compile(r"^embed_out\."), "lm_head."),
)
_MASK_BUFFERS = re.compile(r"\.attention\.(bias|masked_bias)$")


class GPTNeoXModel(LayerNormModel):
    @staticmethod
    def norm_eps(config) -> float:
        return config.layer_norm_eps

    def make_layer(self, config, group) -> LayerNormDecoderLayer:
        bias = getattr(config, "attention_bias", True)
        return LayerNormDecoderLayer(
            config.hidden_size,
            config.layer_norm_eps,
            self.attention(config, group, config.num_attention_heads, bias),
            PlainMLP(config.hidden_size, config.intermediate_size, group, config.hidden_act, True),
            parallel=config.use_parallel_residual,
            mlp_norm=True,
        )


class GPTNeoXForCausalLM(LlamaForCausalLM):
    model_class = GPTNeoXModel
    renamed_tensors = _RENAMED

    def enable_lora(self, num_slots: int, max_rank: int, step) -> dict:
        raise ValueError("LoRA adapters are served on Llama-family models, not on GPT-NeoX")

    def checkpoint_tensors(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterable[tuple[str, torch.Tensor]]:
        config = self.config
        head_dim = GPTNeoXModel.head_dim(config)
        for name, tensor in weights:
            if _MASK_BUFFERS.search(name):
                continue
            name = self.checkpoint_name(name)
            if ".attention.query_key_value." not in name:
                yield name, tensor
                continue
            prefix = name.replace(".attention.query_key_value.", ".self_attn.{}_proj.")
            parts = split_per_head_qkv(tensor, config.num_attention_heads, head_dim)
            for projection, part in zip("qkv", parts):
                yield prefix.format(projection), part
