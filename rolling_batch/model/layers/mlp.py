"""The gated MLP (SwiGLU, or GeGLU with GELU-tanh) of the Llama-style families, also each
expert and shared expert of a mixture of experts (layers/moe.py): gate and up in one
column-parallel matmul, down row-parallel. `partial` stops before the all-reduce, so a layer
that sums several MLPs (the experts a token chose) reduces once. And the plain MLP (one
up-projection, an activation, down) of Falcon and GPT-NeoX, under their checkpoints' names."""

from __future__ import annotations

import torch
from torch import nn
from transformers.activations import ACT2FN

from lmserve.kernels import cpu_native

from .cpu_matmul import NativeGatedWeight
from .linear import MergedColumnLinear, RowLinear
from .parallel import TensorParallelGroup, balanced_split

# HF's `hidden_act` names -> the activations the gated MLP computes.
ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh"}


class GatedMLP(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        group: TensorParallelGroup,
        activation: str = "silu",
        bias: bool = False,
    ):
        super().__init__()
        self.activation = activation
        self.gate_up_proj = MergedColumnLinear(
            hidden_size, [intermediate_size, intermediate_size], group, bias, gated=True
        )
        start, local = balanced_split(intermediate_size, group.world_size, group.rank)
        self.down_proj = RowLinear(start, local, hidden_size, group, bias)
        self.local = local

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self._activated(x))

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's share of the output before the all-reduce (and the down bias)."""
        return self.down_proj.matmul(self._activated(x))

    def _activated(self, x: torch.Tensor) -> torch.Tensor:
        if self.activation == "gelu_tanh":  # the C++ ops fuse SiLU only
            gate, up = self.gate_up_proj(x).split(self.local, dim=-1)
            return nn.functional.gelu(gate, approximate="tanh") * up
        packed = self.gate_up_proj.packed
        if isinstance(packed, NativeGatedWeight) and not self.gate_up_proj.adapters_active:
            return packed.silu_and_mul(x, self.gate_up_proj.bias)
        gate_up = self.gate_up_proj(x)
        native = cpu_native.ops_for(gate_up)
        if native is not None:
            return native.silu_and_mul(gate_up)
        gate, up = gate_up.split(self.local, dim=-1)
        return nn.functional.silu(gate) * up


class PlainMLP(nn.Module):
    """dense_4h_to_h(act(dense_h_to_4h(x))), column- then row-parallel; `activation`: HF's
    name (its ACT2FN gives the same function HF's module applies)."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        group: TensorParallelGroup,
        activation: str,
        bias: bool,
    ):
        super().__init__()
        self.dense_h_to_4h = MergedColumnLinear(hidden_size, [intermediate_size], group, bias)
        start, local = balanced_split(intermediate_size, group.world_size, group.rank)
        self.dense_4h_to_h = RowLinear(start, local, hidden_size, group, bias)
        self.act = ACT2FN[activation]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dense_4h_to_h(self.act(self.dense_h_to_4h(x)))
