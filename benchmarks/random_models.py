"""Random-weight models with a family's real proportions, saved as a user's checkpoint is
(config.json, safetensors, a tokenizer): the folders the speed benchmarks compare on where no
hub is reachable. Speed depends on the shapes, not on the weights' values.

    .venv/bin/python -m lmserve.benchmarks.random_models mixtral-0.4b OUT_DIR

Each entry scales one published model down to ~0.5B parameters, keeping its head_dim, its
KV-head grouping, its MLP (or expert) width relative to hidden_size, its expert count and
top-k, and its vocabulary: Mixtral-8x7B (hidden 4096, MLP 14336, 32/8 heads, 8 experts top 2,
vocab 32000) and Qwen3-30B-A3B (hidden 2048, experts of 768, 32/4 heads of 128, 128 experts top
8, vocab 151936, halved to 64 experts with the hidden size).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import transformers

from lmserve.properties.config import default_cache_dir
from lmserve.rolling_batch.model_source import local_model_path

SHAPES = {
    "mixtral-0.4b": (
        "MixtralConfig",
        "MixtralForCausalLM",
        dict(
            vocab_size=32000,
            hidden_size=1024,
            intermediate_size=3584,
            num_hidden_layers=4,
            num_attention_heads=8,
            num_key_value_heads=2,
            num_local_experts=8,
            num_experts_per_tok=2,
            max_position_embeddings=4096,
            tie_word_embeddings=False,
        ),
    ),
    "qwen3-moe-0.6b": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        dict(
            vocab_size=151936,
            hidden_size=1024,
            moe_intermediate_size=384,
            intermediate_size=3072,
            num_hidden_layers=4,
            num_attention_heads=16,
            num_key_value_heads=2,
            head_dim=128,
            num_experts=64,
            num_experts_per_tok=8,
            norm_topk_prob=True,
            max_position_embeddings=4096,
            tie_word_embeddings=False,
        ),
    ),
}


def save_random_model(name: str, out: Path) -> Path:
    """SHAPES[name] with random weights (seeded) in `out`, with SmolLM2's tokenizer files (a
    tokenizer is part of a servable folder; token ids past its vocabulary are never sent)."""
    config_name, model_name, fields = SHAPES[name]
    config = getattr(transformers, config_name)(**fields, architectures=[model_name])
    torch.manual_seed(0)
    model = getattr(transformers, model_name)(config)
    parameters = sum(p.numel() for p in model.parameters())
    model.save_pretrained(out)
    tokenizer = local_model_path(None, default_cache_dir())
    transformers.AutoTokenizer.from_pretrained(tokenizer).save_pretrained(out)
    print(f"{name}: {parameters / 1e9:.2f}B parameters in {out}")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("name", choices=sorted(SHAPES))
    parser.add_argument("out", type=Path)
    args = parser.parse_args()
    save_random_model(args.name, args.out)


if __name__ == "__main__":
    main()
