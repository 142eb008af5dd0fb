"""Qwen3: the Llama block with each query and key head RMS-normed over head_dim before the
rotation (`q_norm`, `k_norm`), no Q/K/V biases, and an explicit `head_dim` that need not be
hidden_size / heads."""

from __future__ import annotations

from .llama import BlockVariant, LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    variant = BlockVariant(qk_norm=True)
