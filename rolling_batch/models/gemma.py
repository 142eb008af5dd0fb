"""Gemma (the first): the Llama block with a GELU-tanh gated MLP (GeGLU), embeddings scaled by
sqrt(hidden_size), RMSNorm weights stored as offsets from one (`x * (1 + w)`, added as they
load), a head_dim of its own (256) and tied embeddings."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from .llama import BlockVariant, LlamaForCausalLM


class GemmaForCausalLM(LlamaForCausalLM):
    variant = BlockVariant(activation="gelu_tanh", scaled_embedding=True)

    def checkpoint_tensors(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterable[tuple[str, torch.Tensor]]:
        for name, tensor in weights:
            # HF computes (1 + w) in fp32: exact in fp32; bf16 rounds the sum once here.
            yield name, (tensor.float() + 1.0 if name.endswith("norm.weight") else tensor)
