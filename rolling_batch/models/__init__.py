"""Native model implementations, chosen by the HF config's `architectures`."""

from __future__ import annotations

from .llama import LlamaForCausalLM
from .qwen3 import Qwen3ForCausalLM

MODEL_CLASSES = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
}


def model_class_for(config):
    architectures = getattr(config, "architectures", None) or []
    for name in architectures:
        if name in MODEL_CLASSES:
            return MODEL_CLASSES[name]
    raise ValueError(
        f"unsupported architecture {architectures or getattr(config, 'model_type', '?')}:"
        f" lmserve's native runtime supports {', '.join(sorted(MODEL_CLASSES))}"
    )
