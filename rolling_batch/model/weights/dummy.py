"""option.load_format=dummy: a model's weights drawn at random from its config alone, so its
speed can be measured without its checkpoint (vLLM's `load_format=dummy`)."""

from __future__ import annotations

import torch
from torch import nn

SEED = 0


@torch.no_grad()
def fill_random(model: nn.Module, std: float) -> None:
    """Every floating parameter drawn in place, the same on every rank and every run: biases 0,
    other one-dimensional parameters (norm scales) 1, matrices normal(0, std), HF's
    initializer_range. Norm scales stay 1 because random ones would shrink or grow the
    activations layer after layer into zeros or infinities, which no benchmark should time."""
    for name, param in model.named_parameters():
        if not param.is_floating_point():
            continue
        if name.endswith("bias"):
            param.zero_()
        elif param.dim() == 1:
            param.fill_(1.0)
        else:
            # One generator per tensor, seeded from its name: a rank's shard and the draw do
            # not depend on which other parameters were filled first.
            generator = torch.Generator(device=param.device)
            generator.manual_seed(SEED + _stable_hash(name))
            param.normal_(0.0, std, generator=generator)


def _stable_hash(name: str) -> int:
    # Python's hash() of a str changes between processes; ranks must agree.
    value = 0
    for byte in name.encode():
        value = (value * 131 + byte) % (2**31 - 1)
    return value
