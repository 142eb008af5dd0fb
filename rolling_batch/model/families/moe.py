"""The mixture-of-experts families: the Llama block (attention, norms, rotary; Qwen2-MoE's Q/K/V
biases, Qwen3-MoE's per-head q/k norms) with a sparse MLP (layers/moe.py) in its layers.

- Mixtral: every layer sparse, top-k renormalised, the checkpoint's experts named
  `block_sparse_moe.experts.N.w1` (gate), `w3` (up), `w2` (down), read under Qwen's names.
- Qwen2-MoE: a shared expert beside the routed ones, scaled by a sigmoid gate; layers listed in
  `mlp_only_layers`, or off the `decoder_sparse_step`, have a dense MLP.
- Qwen3-MoE: no shared expert, q/k norms, an explicit head_dim.
"""

from __future__ import annotations

import re

from torch import nn

from ..layers.mlp import ACTIVATIONS
from ..layers.moe import SparseMoE
from .llama import BlockVariant, LlamaForCausalLM, LlamaModel

_MIXTRAL_NAMES = (  # Mixtral's checkpoint names -> Qwen's, which the native model takes
    (re.compile(r"\.block_sparse_moe\."), ".mlp."),
    (re.compile(r"(\.experts\.\d+)\.w1\."), r"\1.gate_proj."),
    (re.compile(r"(\.experts\.\d+)\.w3\."), r"\1.up_proj."),
    (re.compile(r"(\.experts\.\d+)\.w2\."), r"\1.down_proj."),
)


class MoeModel(LlamaModel):
    fp32_router_weights = False  # set by the family: see SparseMoE

    def make_mlp(self, config, group, variant: BlockVariant, layer_index: int) -> nn.Module:
        sparse_step = getattr(config, "decoder_sparse_step", 1) or 1
        dense = layer_index in (getattr(config, "mlp_only_layers", None) or [])
        if dense or (layer_index + 1) % sparse_step:
            return super().make_mlp(config, group, variant, layer_index)
        activation = ACTIVATIONS.get(config.hidden_act)
        if activation is None:
            raise ValueError(f"hidden_act={config.hidden_act!r} in a mixture of experts")
        return SparseMoE(
            config.hidden_size,
            getattr(config, "moe_intermediate_size", None) or config.intermediate_size,
            getattr(config, "num_local_experts", None) or config.num_experts,
            config.num_experts_per_tok,
            group,
            renormalize=getattr(config, "norm_topk_prob", True),
            fp32_weights=self.fp32_router_weights,
            shared_expert_size=getattr(config, "shared_expert_intermediate_size", None),
            activation=activation,
        )


class MixtralModel(MoeModel):
    fp32_router_weights = True


class MoeForCausalLM(LlamaForCausalLM):
    model_class = MoeModel
    renamed_tensors = _MIXTRAL_NAMES  # Qwen's names need none

    def enable_lora(self, num_slots: int, max_rank: int, step) -> dict:
        raise ValueError("LoRA adapters are not served on mixture-of-experts models")


class MixtralForCausalLM(MoeForCausalLM):
    model_class = MixtralModel


class Qwen2MoeForCausalLM(MoeForCausalLM):
    pass


class Qwen3MoeForCausalLM(MoeForCausalLM):
    variant = BlockVariant(qk_norm=True)
