"""Weight-only quantized weights on a GPU, multiplied by the Triton kernel
(kernels/weight_only_matmul_triton.py), which widens the codes tile by tile: no dense copy of a
weight is ever made. The same codes, scales and zeros as the CPU weights (layers/quantized.py)
come in, so AWQ, GPTQ, GGUF and option.quantize load alike on both; here scales and zeros
stay fp32 (the CPU int4 kernel rounds them to bf16) and the weight is rounded to the
activations' dtype inside the kernel, as a dense fp16/bf16 model's weight would be.
"""

from __future__ import annotations

import torch

from lmserve.kernels.weight_only_matmul_triton import weight_only_matmul

from .quantized import GROUP_SIZE, Int8Weight


class GpuInt4Weight:
    """A [out, in] weight as int4 codes, two a byte; called like `linear(x, weight, bias)`."""

    bits = 4

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size):
        """codes [out, in] in 0..15; scales and zeros [out, in / group_size]."""
        self.out_features, self.in_features = codes.shape
        self.group_size = group_size
        codes = codes.to(torch.uint8)
        self.codes = (codes[:, 0::2] | (codes[:, 1::2] << 4)).contiguous()
        self.scales = scales.float().contiguous()
        self.zeros = zeros.float().contiguous()

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + self.scales.nbytes + self.zeros.nbytes

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return weight_only_matmul(x, self.codes, self.scales, self.zeros, self.group_size, bias)


class GpuInt8Weight(Int8Weight):
    """An `Int8Weight` (same codes and scales, same embedding lookup) multiplied by the
    Triton kernel."""

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return weight_only_matmul(x, self.codes, self.scales, None, GROUP_SIZE, bias)
