"""RMSNorm and rotary position embeddings, computed exactly as HF transformers' Llama does
(so fp32 logits match): RMSNorm in fp32 then cast; cos/sin from fp32 frequencies."""

from __future__ import annotations

import torch
from torch import nn

# Static frequency schemes. "dynamic" and "longrope" change with the sequence length.
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "proportional")


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(hidden_size), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_frequencies(config, head_dim: int) -> tuple[torch.Tensor, float]:
    """(inverse frequencies, attention scaling) for the config's rope parameters."""
    parameters = getattr(config, "rope_parameters", None) or {}
    rope_type = parameters.get("rope_type", "default")
    if rope_type not in SUPPORTED_ROPE_TYPES:
        supported = ", ".join(SUPPORTED_ROPE_TYPES)
        raise ValueError(f"rope_type={rope_type!r} is not supported; supported: {supported}")
    if rope_type == "default":
        base = parameters.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        exponents = torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim
        return 1.0 / (base**exponents), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    return ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"))


class RotaryEmbedding(nn.Module):
    """cos/sin tables for positions [0, max_positions), built once."""

    def __init__(self, config, head_dim: int, max_positions: int):
        super().__init__()
        inv_freq, scaling = rope_frequencies(config, head_dim)
        freqs = torch.arange(max_positions, dtype=torch.float)[:, None] * inv_freq[None, :]
        angles = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", angles.cos() * scaling, persistent=False)
        self.register_buffer("sin", angles.sin() * scaling, persistent=False)

    def forward(self, positions, query, key) -> tuple[torch.Tensor, torch.Tensor]:
        """query/key: [T, heads, head_dim]; positions: [T]."""
        cos = self.cos[positions][:, None, :].to(query.dtype)
        sin = self.sin[positions][:, None, :].to(query.dtype)
        return query * cos + _rotate_half(query) * sin, key * cos + _rotate_half(key) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
