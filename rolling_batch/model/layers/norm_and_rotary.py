"""RMSNorm and rotary position embeddings, computed exactly as HF transformers' Llama does
(so fp32 logits match): RMSNorm in fp32 then cast; cos/sin from fp32 frequencies. On CPU the
C++ kernels (`lmserve.kernels.cpu_native`) compute both, the norm fused with the residual add;
the torch code here is their reference and the fallback."""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch
from torch import nn

from lmserve.kernels import cpu_native

from ..architectures import STATIC_ROPE_TYPES

# Frequency schemes fixed for a served model ("dynamic" changes with the sequence's length).
SUPPORTED_ROPE_TYPES = STATIC_ROPE_TYPES


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(hidden_size), requires_grad=False)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """norm(x); with `residual`: (norm(residual + x), residual + x), HF's residual add
        fused in. The native op updates `x` and `residual` in place: callers pass tensors
        they own (a sublayer's output and the residual stream)."""
        native = cpu_native.ops_for(x)
        if residual is None:
            return (
                self.reference(x) if native is None else native.rms_norm(x, self.weight, self.eps)
            )
        if native is None:
            residual = residual + x
            return self.reference(residual), residual
        native.add_rms_norm_(x, residual, self.weight, self.eps)
        return x, residual

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class LayerNorm(nn.Module):
    """LayerNorm with its bias (Falcon, GPT-NeoX, StableLM), as torch's, with RMSNorm's
    contract: norm(x), or with `residual` (norm(residual + x), residual + x). Torch's op on every
    device: no C++ op of its own yet."""

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(hidden_size), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(hidden_size), requires_grad=False)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return self._norm(x)
        residual = residual + x
        return self._norm(residual), residual

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.layer_norm(x, self.weight.shape, self.weight, self.bias, self.eps)


def rotary_dim(config, head_dim: int) -> int:
    """How many of a head's leading dims rotate: all, or `partial_rotary_factor` of them
    (Phi-3/Phi-4, GPT-NeoX, StableLM), the rest passed through, as HF computes it."""
    parameters = getattr(config, "rope_parameters", None) or {}
    factor = parameters.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0))
    return int(head_dim * (factor or 1.0))


def rope_frequencies(
    config, head_dim: int, layer_type: str | None = None, max_positions: int | None = None
) -> tuple[torch.Tensor, float]:
    """(inverse frequencies, attention scaling) for the config's rope parameters; `head_dim`:
    the rotated dims (rotary_dim). `layer_type`: the kind of layer whose parameters to take
    where the config keeps them per kind (Gemma 3's sliding and full attention).
    `max_positions`: the served context, which picks LongRoPE's factors (the long ones
    beyond the original context: architectures.STATIC_ROPE_TYPES)."""
    parameters = getattr(config, "rope_parameters", None) or {}
    if layer_type is not None:
        parameters = parameters[layer_type]
    rope_type = parameters.get("rope_type", "default")
    if rope_type not in SUPPORTED_ROPE_TYPES:
        supported = ", ".join(SUPPORTED_ROPE_TYPES)
        raise ValueError(f"rope_type={rope_type!r} is not supported; supported: {supported}")
    if rope_type == "default":
        base = parameters.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        exponents = torch.arange(0, head_dim, 2, dtype=torch.float, device="cpu") / head_dim
        return 1.0 / (base**exponents), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    seq_len = max_positions if rope_type == "longrope" else None
    with torch.device("cpu"):  # HF makes some of its tensors on the default device
        return ROPE_INIT_FUNCTIONS[rope_type](
            config, torch.device("cpu"), seq_len=seq_len, layer_type=layer_type
        )


@dataclass(frozen=True)
class StepRope:
    """One step's rotation, shared by every layer. Native: the positions and the whole fp32
    tables (the kernel looks rows up itself); reference: the step's rows, [T, 1, head_dim],
    in the model dtype."""

    cos: torch.Tensor
    sin_signed: torch.Tensor
    positions: torch.Tensor
    native: ModuleType | None
    rotary_dim: int | None = None  # a partial rotation's dims; None: the whole head

    def rotate(self, heads: torch.Tensor) -> torch.Tensor:
        """heads: [T, n, head_dim], query and key heads alike; the native op rotates in place
        and returns `heads` itself. A partial rotation turns the leading rotary_dim dims of
        each head (a copy: the op takes whole rows) and leaves the rest as they are."""
        if self.rotary_dim is not None:
            part = self._rotate_whole(heads[..., : self.rotary_dim].contiguous())
            heads = heads.clone() if self.native is None else heads
            heads[..., : self.rotary_dim] = part
            return heads
        return self._rotate_whole(heads)

    def _rotate_whole(self, heads: torch.Tensor) -> torch.Tensor:
        if self.native is not None:
            self.native.rotary_(heads, self.positions, self.cos, self.sin_signed)
            return heads
        return heads * self.cos + heads.roll(heads.shape[-1] // 2, dims=-1) * self.sin_signed


class RotaryEmbedding(nn.Module):
    """cos/sin tables for positions [0, max_positions), built once.

    HF rotates with `x * cos + rotate_half(x) * sin`, rotate_half(x) = (-x2, x1). Here the
    sign sits in the table instead, `sin_signed` = (-sin1, sin2), so the rotation is
    `x * cos + roll(x, half) * sin_signed`: the same products (a sign flip is exact), one op
    instead of four per layer."""

    def __init__(self, config, head_dim: int, max_positions: int, layer_type: str | None = None):
        super().__init__()
        self.rotary_dim = rotary_dim(config, head_dim)
        self.partial = self.rotary_dim < head_dim  # tables of rotary_dim columns then
        inv_freq, scaling = rope_frequencies(config, self.rotary_dim, layer_type, max_positions)
        # On the CPU whatever torch's default device (a dummy model is built on its GPU): HF's
        # scaled frequencies come from there, and the tables match a checkpoint load's bits.
        positions = torch.arange(max_positions, dtype=torch.float, device="cpu")
        freqs = positions[:, None] * inv_freq[None, :]
        cos, sin = freqs.cos() * scaling, freqs.sin() * scaling
        self.register_buffer("cos", torch.cat((cos, cos), dim=-1), persistent=False)
        self.register_buffer("sin_signed", torch.cat((-sin, sin), dim=-1), persistent=False)

    def for_step(self, positions: torch.Tensor, dtype: torch.dtype) -> StepRope:
        """The rotation of a step's positions [T] (int64), built once for every layer."""
        native = cpu_native.ops_for(positions)
        partial = self.rotary_dim if self.partial else None
        if native is not None:
            return StepRope(self.cos, self.sin_signed, positions, native, partial)
        cos = self.cos[positions][:, None, :].to(dtype)
        sin_signed = self.sin_signed[positions][:, None, :].to(dtype)
        return StepRope(cos, sin_signed, positions, None, partial)
