"""The greedy token of an fp32 LM head at about half its cost, where the CPU multiplies bf16
pairs (AVX512-BF16): the logits are computed in bf16 on the C++ panels, each within a bound of
its fp32 value that the hidden state's and the weight row's norms give, and only the tokens
that could still be the largest (a few a row for a trained model's peaked logits) are computed
in fp32, exactly as the fp32 panels compute them (`greedy_head_pick` in
kernels/csrc/greedy.h). The token is the one the fp32 logits' argmax gives, bit for bit the
same comparison; the log-prob is not known, so only requests that report none take it.

A step of greedy decodes alone picks its tokens inside the C++ decoder stack's call
(`DecoderStack.forward_greedy`, the same approximations and pick): where the step runs as one
run of sequences a thread, each thread goes on from its run to the head's work instead of
waiting for the slower run.

The LM head is ~21% of a decode token's multiply-adds for SmolLM2-135M (its 49k x 576 tied
embedding against 106M parameters in the layers), and at 32-64 rows the fp32 panels run at the
CPU's multiply-add peak: halving its arithmetic is what is left to take there.
"""

from __future__ import annotations

import torch

from lmserve.kernels import cpu_native

from .cpu_matmul import NativeLinearWeight


class GreedyHead:
    """`weight` [vocab, in] fp32: the LM head's (the tied embedding's) rows; kept by reference
    for the exact logits, plus a bf16 copy in the panels (half the fp32 panels' bytes)."""

    def __init__(self, weight: torch.Tensor, native):
        self.native = native
        self.weight = weight.contiguous()
        norms = self.weight.double().norm(dim=1).float()
        # rounded up: a bound computed from them may only grow
        self.norms = torch.nextafter(norms, torch.full_like(norms, float("inf")))
        self.approx = NativeLinearWeight(self.weight.to(torch.bfloat16), native)

    @classmethod
    def try_build(cls, weight: torch.Tensor) -> GreedyHead | None:
        """A GreedyHead for an fp32 CPU LM head where the C++ panels take bf16 and every weight
        row is finite; None elsewhere (the fp32 logits are then the only way)."""
        if weight.device.type != "cpu" or weight.dtype != torch.float32:
            return None
        native = cpu_native.native_ops()
        if native is None or not native.bf16_panels() or weight.shape[1] % 2:
            return None
        if not bool(torch.isfinite(weight).all()):
            return None
        return cls(weight, native)

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        """int64 [rows]: each row's greedy token, -1 where the row's fp32 logits are needed
        (a hidden state or approximation that is not finite)."""
        hidden = hidden.float().contiguous()
        approx = self.approx(hidden.to(torch.bfloat16))
        return self.native.greedy_head_pick(hidden, approx, self.weight, self.norms)
