"""Linear layers that hold one rank's shard of a weight.

- `QKVLinear`: column-parallel fused Q/K/V over this rank's heads.
- `MergedColumnLinear`: column-parallel fused gate/up projections.
- `RowLinear`: row-parallel (input split), partial sums all-reduced.
With one rank every shard is the whole weight and the layers are plain linears.
"""

from __future__ import annotations

import torch
from torch import nn

from .cpu_matmul import PackableLinear
from .parallel import HeadShard, TensorParallelGroup, balanced_split


def _empty(*shape: int) -> nn.Parameter:
    # Weights come from the checkpoint: skip the random initialisation.
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


class QKVLinear(PackableLinear):
    def __init__(self, hidden_size: int, head_dim: int, heads: HeadShard, bias: bool):
        super().__init__()
        self.head_dim = head_dim
        self.heads = heads
        self.q_size = heads.num_q * head_dim
        self.kv_size = heads.num_kv * head_dim
        self.in_features, self.out_features = hidden_size, self.q_size + 2 * self.kv_size
        self.weight = _empty(self.q_size + 2 * self.kv_size, hidden_size)
        self.bias = _empty(self.q_size + 2 * self.kv_size) if bias else None

    @property
    def projection_sizes(self) -> list[int]:
        return [self.q_size, self.kv_size, self.kv_size]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.bias)

    def weight_loader(self, param: nn.Parameter, full: torch.Tensor, shard: str) -> None:
        """`shard` is "q", "k" or "v"; `full` is that projection's whole weight (or bias)."""
        d = self.head_dim
        if shard == "q":
            rows, target = (self.heads.q_start * d, self.q_size), 0
        else:
            rows = (self.heads.kv_start * d, self.kv_size)
            target = self.q_size + (0 if shard == "k" else self.kv_size)
        param.data[target : target + rows[1]].copy_(full[rows[0] : rows[0] + rows[1]])


class MergedColumnLinear(PackableLinear):
    """Several column-parallel projections of the same input in one matmul (gate and up)."""

    def __init__(
        self,
        in_features: int,
        out_features: list[int],
        group: TensorParallelGroup,
        bias,
        gated: bool = False,
    ):
        super().__init__()
        self.gated = gated  # [gate, up]: packed for the fused silu(gate) * up
        self.splits = [balanced_split(n, group.world_size, group.rank) for n in out_features]
        self.offsets = [sum(size for _, size in self.splits[:i]) for i in range(len(self.splits))]
        local = sum(size for _, size in self.splits)
        self.in_features, self.out_features = in_features, local
        self.weight = _empty(local, in_features)
        self.bias = _empty(local) if bias else None

    @property
    def projection_sizes(self) -> list[int]:
        return [size for _, size in self.splits]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.bias)

    def weight_loader(self, param: nn.Parameter, full: torch.Tensor, shard: int | None) -> None:
        """`shard`: which projection `full` is; None for a linear of one (Falcon's MLP)."""
        shard = shard or 0
        start, size = self.splits[shard]
        offset = self.offsets[shard]
        param.data[offset : offset + size].copy_(full[start : start + size])


class RowLinear(PackableLinear):
    """Input features [in_start, in_start + in_size) of the full layer live here; the partial
    outputs of all ranks are summed (the bias is added once, after the sum)."""

    shards_input = True

    def __init__(self, in_start: int, in_size: int, out_features: int, group, bias: bool):
        super().__init__()
        self.group = group
        self.in_start = in_start
        self.in_size = in_size
        self.in_features, self.out_features = in_size, out_features
        self.weight = _empty(out_features, in_size)
        self.bias = _empty(out_features) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.group.all_reduce(self.matmul(x))
        return out if self.bias is None else out + self.bias

    def weight_loader(self, param: nn.Parameter, full: torch.Tensor, shard=None) -> None:
        if param is self.bias:
            param.data.copy_(full)
            return
        # Weights and int4 codes hold a column an input, int4 scales and zeros one a group.
        inputs_per_column = self.in_size // param.shape[1]
        start = self.in_start // inputs_per_column
        param.data.copy_(full[:, start : start + param.shape[1]])
