"""Random-weight models with a family's real proportions, saved as a user's checkpoint is
(config.json, safetensors, a tokenizer): the folders the speed benchmarks compare on where no
hub is reachable. Speed depends on the shapes, not on the weights' values.

    .venv/bin/python -m lmserve.benchmarks.random_models mixtral-0.4b OUT_DIR

Each entry is a published model of ~0.5B parameters with its exact shapes (Qwen3-0.6B,
Pythia-410M, Gemma-3-270M), or one scaled down to about that size, keeping its head_dim, its
KV-head grouping, its MLP (or expert) width relative to hidden_size, its expert count and
top-k, and its vocabulary: Mixtral-8x7B (hidden 4096, MLP 14336, 32/8 heads, 8 experts top 2,
vocab 32000), Qwen3-30B-A3B (hidden 2048, experts of 768, 32/4 heads of 128, 128 experts top
8, vocab 151936, halved to 64 experts with the hidden size) and Falcon-7B (multi-query heads
of 64, a 4x GELU MLP, parallel attention and MLP, vocab 65024; hidden 4544 -> 1024).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import transformers

from lmserve.properties.config import default_cache_dir
from lmserve.rolling_batch.model.source import local_model_path

SHAPES = {
    "qwen3-0.6b": (
        "Qwen3Config",
        "Qwen3ForCausalLM",
        dict(
            vocab_size=151936,
            hidden_size=1024,
            intermediate_size=3072,
            num_hidden_layers=28,
            num_attention_heads=16,
            num_key_value_heads=8,
            head_dim=128,
            max_position_embeddings=40960,
            tie_word_embeddings=True,
        ),
    ),
    "pythia-0.4b": (
        "GPTNeoXConfig",
        "GPTNeoXForCausalLM",
        dict(
            vocab_size=50304,
            hidden_size=1024,
            intermediate_size=4096,
            num_hidden_layers=24,
            num_attention_heads=16,
            rotary_pct=0.25,
            use_parallel_residual=True,
            max_position_embeddings=2048,
            tie_word_embeddings=False,
        ),
    ),
    "gemma3-0.3b": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        dict(
            vocab_size=262144,
            hidden_size=640,
            intermediate_size=2048,
            num_hidden_layers=18,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=256,
            query_pre_attn_scalar=256,
            sliding_window=512,
            max_position_embeddings=32768,
        ),
    ),
    "falcon-0.4b": (
        "FalconConfig",
        "FalconForCausalLM",
        dict(
            vocab_size=65024,
            hidden_size=1024,
            num_hidden_layers=32,
            num_attention_heads=16,
            multi_query=True,
            parallel_attn=True,
            bias=False,
            max_position_embeddings=2048,
        ),
    ),
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
    """SHAPES[name] with random weights (seeded) in `out`, with SmolLM2's tokenizer (a
    tokenizer is part of a servable folder), grown by placeholder tokens to the model's
    vocabulary: random weights pick any id, and a server detokenizing one its tokenizer lacks
    (vLLM's stream decoder) fails the request."""
    config_name, model_name, fields = SHAPES[name]
    config = getattr(transformers, config_name)(**fields, architectures=[model_name])
    torch.manual_seed(0)
    model = getattr(transformers, model_name)(config)
    parameters = sum(p.numel() for p in model.parameters())
    model.save_pretrained(out)
    tokenizer = local_model_path(None, default_cache_dir())
    tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer)
    tokenizer.add_tokens([f"<placeholder_{i}>" for i in range(len(tokenizer), config.vocab_size)])
    tokenizer.save_pretrained(out)
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
