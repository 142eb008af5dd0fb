"""A mixture-of-experts MLP (Mixtral, Qwen2-MoE, Qwen3-MoE): a router picks each token's top-k
experts, each expert a gated MLP (layers/mlp.py), and the token's output is their outputs
weighted by the router's probabilities (renormalised over the k or not, as the family does),
plus a shared expert scaled by its own sigmoid gate where the family has one (Qwen2-MoE).

The step's tokens are grouped by expert (one sort, no loop over tokens), so each expert the
step uses runs once on all its tokens and its weights are read once a step; experts no token
chose are not touched. With tensor parallelism every expert is split as a dense MLP is (its
intermediate columns across the ranks, as vLLM shards experts without expert parallelism): each
rank routes alike (the router is whole on every rank) and sums its partial outputs of every
expert and the shared one before the layer's one all-reduce.
"""

from __future__ import annotations

import torch
from torch import nn

from .mlp import GatedMLP
from .parallel import TensorParallelGroup


class Router(nn.Module):
    """The [experts, hidden] router matrix (whole on every rank: it is small)."""

    def __init__(self, hidden_size: int, num_experts: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size), requires_grad=False)


class SparseMoE(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        expert_size: int,
        num_experts: int,
        top_k: int,
        group: TensorParallelGroup,
        *,
        renormalize: bool,
        fp32_weights: bool,
        shared_expert_size: int | None = None,
        activation: str = "silu",
    ):
        """`renormalize`: the top-k probabilities divided by their sum (Mixtral always;
        Qwen's `norm_topk_prob`). `fp32_weights`: they scale the expert outputs in fp32
        (Mixtral), else rounded to the model's dtype first (Qwen), as HF does each."""
        super().__init__()
        self.group = group
        self.top_k = top_k
        self.renormalize = renormalize
        self.fp32_weights = fp32_weights
        self.gate = Router(hidden_size, num_experts)
        self.experts = nn.ModuleList(
            GatedMLP(hidden_size, expert_size, group, activation) for _ in range(num_experts)
        )
        self.shared_expert = None
        if shared_expert_size:
            self.shared_expert = GatedMLP(hidden_size, shared_expert_size, group, activation)
            self.shared_expert_gate = Router(hidden_size, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probabilities = nn.functional.linear(x, self.gate.weight).softmax(-1, dtype=torch.float)
        weights, chosen = probabilities.topk(self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(-1, keepdim=True)
        if not self.fp32_weights:
            weights = weights.to(x.dtype)
        # Token-expert pairs sorted by expert (stable: tokens in order within each expert).
        expert_of_pair = chosen.flatten()
        order = expert_of_pair.argsort(stable=True)
        token_of_pair = order // self.top_k
        pair_weights = weights.flatten()[order, None]
        grouped = x[token_of_pair]
        counts = torch.bincount(expert_of_pair, minlength=len(self.experts)).tolist()
        out = torch.zeros_like(x)
        start = 0
        for expert, count in zip(self.experts, counts):
            if count:
                rows = slice(start, start + count)
                part = expert.partial(grouped[rows]) * pair_weights[rows]
                out.index_add_(0, token_of_pair[rows], part.to(x.dtype))
                start += count
        if self.shared_expert is not None:
            gate = nn.functional.linear(x, self.shared_expert_gate.weight).sigmoid()
            out = out + gate * self.shared_expert.partial(x)
        return self.group.all_reduce(out)
