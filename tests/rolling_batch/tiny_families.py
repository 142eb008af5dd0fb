"""Tiny random-weight models of any family transformers ships, saved as a user's checkpoint
is, and the check every family test makes against HF: a prompt in two chunks and decode tokens
through the runner, each step's last logits HF's."""

from __future__ import annotations

import torch
import transformers

from lmserve.rolling_batch.core.step import SequenceChunk

# Sizes every family takes (KV heads, head_dim and the family's own switches come with it).
COMMON = dict(
    vocab_size=300,
    hidden_size=48,
    intermediate_size=80,
    num_hidden_layers=2,
    num_attention_heads=6,
    max_position_embeddings=128,
)
PROMPT = [5, 17, 250, 3, 99, 42, 7, 8, 9, 10, 11]


def save_tiny(folder, config_name: str, model_name: str, extra: dict, **sizes):
    """transformers' `model_name` on COMMON (with `sizes` over it) and the family's `extra`,
    saved in `folder`; the HF model returned, fp32, eval."""
    config = getattr(transformers, config_name)(**{**COMMON, **sizes}, **extra)
    config.architectures = [model_name]
    torch.manual_seed(1)
    model = getattr(transformers, model_name)(config).eval()
    with torch.no_grad():  # random biases and norms: zeros and ones would hide a missing one
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(0, 0.5)
            elif "norm" in name and name.endswith("weight"):
                param.normal_(1, 0.2)
    model.save_pretrained(folder)
    return model


def assert_steps_match_hf(
    runner, hf_model, label: str, decodes: int = 1, prompt: list[int] = PROMPT, split: int = 6
):
    """`prompt` in two chunks (at `split`; one where it is the prompt's length), then `decodes`
    decode tokens, on the runner's first half of blocks: each step's last logits within 1e-4
    (relative) of HF's on the whole sequence. Returns (the last step's logits, the whole
    sequence)."""
    blocks = tuple(range(runner.num_blocks // 2))
    steps = [(prompt[:split], 0)] + ([(prompt[split:], split)] if split < len(prompt) else [])
    steps += [([123 + i], len(prompt) + i) for i in range(decodes)]
    sequence: list[int] = []
    for new, computed in steps:
        sequence += new
        (logits,) = runner.execute([SequenceChunk(tuple(new), computed, blocks, True)])
        with torch.inference_mode():
            expected = hf_model(torch.tensor([sequence])).logits[0, -1]
        error = (logits - expected).abs().max() / expected.abs().max()
        assert error < 1e-4, f"{label}: relative error {error:.2e} after {len(sequence)} tokens"
    return logits, sequence
