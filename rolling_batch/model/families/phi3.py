"""Phi-3: the Llama block with Q, K and V in one checkpoint matrix (`qkv_proj`) and gate and up
in another (`gate_up_proj`), and a rotation of the leading `partial_rotary_factor` of each head
where the config sets one (Phi-4-mini's 0.75), and LongRoPE scaling in the long-context
checkpoints (Phi-3-128k, Phi-3.5, Phi-4-mini): layers/norm_and_rotary.py takes the long or
short factors by the served context (architectures.STATIC_ROPE_TYPES). The fused matrices
are split back into Llama's projections as they load, so each linear's loader shards them as
it shards Llama's (query and KV heads by rank, gate and up by columns)."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from .llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    def checkpoint_tensors(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterable[tuple[str, torch.Tensor]]:
        config = self.config
        head_dim = getattr(config, "head_dim", None) or (
            config.hidden_size // config.num_attention_heads
        )
        q_size = config.num_attention_heads * head_dim
        kv_size = config.num_key_value_heads * head_dim
        for name, tensor in weights:
            if ".qkv_proj." in name:
                q, k, v = tensor.split([q_size, kv_size, kv_size])
                for part, projection in ((q, "q_proj"), (k, "k_proj"), (v, "v_proj")):
                    yield name.replace("qkv_proj", projection), part
            elif ".gate_up_proj." in name:
                gate, up = tensor.chunk(2)
                yield name.replace("gate_up_proj", "gate_proj"), gate
                yield name.replace("gate_up_proj", "up_proj"), up
            else:
                yield name, tensor
