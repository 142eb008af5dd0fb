"""The Gemma family: the Llama block with a GELU-tanh gated MLP (GeGLU), embeddings scaled by
sqrt(hidden_size), RMSNorm weights stored as offsets from one (`x * (1 + w)`, added as they
load), a head_dim of its own (256) and tied embeddings.

- Gemma: that block.
- Gemma 2: a norm after each sublayer as well as before it (the output of attention and of the
  MLP normed before it joins the stream), attention scaled by `query_pre_attn_scalar` ** -0.5
  rather than head_dim's, scores and final logits soft-capped (`cap * tanh(x / cap)`), and
  sliding-window (local) layers alternating with global ones (`layer_types`).
- Gemma 3 (text): Gemma 2's layer without the soft-capping, per-head q/k norms, and two rotary
  tables: the local layers' base (`rope_parameters["sliding_attention"]`) and the global
  layers' (with their scaling, "linear" in the larger checkpoints).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from ..layers.norm_and_rotary import RMSNorm, RotaryEmbedding, StepRope
from .llama import BlockVariant, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel


class GemmaForCausalLM(LlamaForCausalLM):
    variant = BlockVariant(activation="gelu_tanh", scaled_embedding=True)

    def checkpoint_tensors(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterable[tuple[str, torch.Tensor]]:
        for name, tensor in weights:
            # HF computes (1 + w) in fp32: exact in fp32; bf16 rounds the sum once here. Every
            # norm of the family (q_norm and k_norm too) is such an offset.
            yield name, (tensor.float() + 1.0 if name.endswith("norm.weight") else tensor)


class SandwichDecoderLayer(LlamaDecoderLayer):
    """Gemma 2/3's layer: attention and MLP each between two norms. `post_attention_layernorm`
    is, as its checkpoint name says, the norm of attention's output (Llama's is the MLP's
    input norm, here `pre_feedforward_layernorm`)."""

    def __init__(self, config, *args):
        super().__init__(config, *args)
        self.pre_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, rope, hidden, residual, kv_cache, meta):
        """(this layer's normed MLP output, the stream before it), as Llama's layers."""
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        attended = self.post_attention_layernorm(self.self_attn(rope, hidden, kv_cache, meta))
        hidden, residual = self.pre_feedforward_layernorm(attended, residual)
        return self.post_feedforward_layernorm(self.mlp(hidden)), residual


class Gemma2Model(LlamaModel):
    native_stack_layers = False  # the C++ stack has Llama's layer: one norm a sublayer
    layer_class = SandwichDecoderLayer

    def __init__(self, config, group, max_positions: int, variant: BlockVariant):
        super().__init__(config, group, max_positions, variant)
        scale = config.query_pre_attn_scalar**-0.5
        for layer in self.layers:
            layer.self_attn.scale = scale
            layer.self_attn.softcap = getattr(config, "attn_logit_softcapping", None)


class Gemma3Model(Gemma2Model):
    def __init__(self, config, group, max_positions: int, variant: BlockVariant):
        super().__init__(config, group, max_positions, variant)
        # Which layers rotate by the local table: those that slide, as HF's layer_types say
        # (even where this context is no longer than the window, so no window is applied).
        self.local_layers = [kind == "sliding_attention" for kind in config.layer_types]

    def make_rotary(self, config, head_dim: int, max_positions: int) -> RotaryEmbedding:
        """The global layers' table; the local layers' one beside it."""
        self.local_rotary = RotaryEmbedding(config, head_dim, max_positions, "sliding_attention")
        return RotaryEmbedding(config, head_dim, max_positions, "full_attention")

    def step_ropes(self, positions: torch.Tensor, dtype: torch.dtype) -> list[StepRope]:
        local = self.local_rotary.for_step(positions, dtype)
        full = self.rotary.for_step(positions, dtype)
        return [local if is_local else full for is_local in self.local_layers]


class Gemma2ForCausalLM(GemmaForCausalLM):
    model_class = Gemma2Model

    def __init__(self, config, group, max_positions: int):
        super().__init__(config, group, max_positions)
        self.final_softcap = getattr(config, "final_logit_softcapping", None)


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    model_class = Gemma3Model
    variant = BlockVariant(activation="gelu_tanh", scaled_embedding=True, qk_norm=True)
