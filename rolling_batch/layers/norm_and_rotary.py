"""RMSNorm and rotary position embeddings, computed exactly as HF transformers' Llama does
(so fp32 logits match): RMSNorm in fp32 then cast; cos/sin from fp32 frequencies."""

from __future__ import annotations

import torch
from torch import nn

RopeTables = tuple[torch.Tensor, torch.Tensor]  # cos, sin_signed: [T, 1, head_dim] each

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
    """cos/sin tables for positions [0, max_positions), built once.

    HF rotates with `x * cos + rotate_half(x) * sin`, rotate_half(x) = (-x2, x1). Here the
    sign sits in the table instead, `sin_signed` = (-sin1, sin2), so the rotation is
    `x * cos + roll(x, half) * sin_signed`: the same products (a sign flip is exact), one op
    instead of four per layer."""

    def __init__(self, config, head_dim: int, max_positions: int):
        super().__init__()
        inv_freq, scaling = rope_frequencies(config, head_dim)
        freqs = torch.arange(max_positions, dtype=torch.float)[:, None] * inv_freq[None, :]
        cos, sin = freqs.cos() * scaling, freqs.sin() * scaling
        self.register_buffer("cos", torch.cat((cos, cos), dim=-1), persistent=False)
        self.register_buffer("sin_signed", torch.cat((-sin, sin), dim=-1), persistent=False)

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> RopeTables:
        """cos/sin rows for a step's positions [T], looked up once and shared by every layer."""
        cos = self.cos[positions][:, None, :].to(dtype)
        return cos, self.sin_signed[positions][:, None, :].to(dtype)

    @staticmethod
    def apply(tables: RopeTables, heads: torch.Tensor) -> torch.Tensor:
        """heads: [T, n, head_dim], query and key heads alike."""
        cos, sin_signed = tables
        return heads * cos + heads.roll(heads.shape[-1] // 2, dims=-1) * sin_signed
