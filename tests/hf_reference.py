"""HF transformers' own greedy generation, the reference every engine is held to, and the
comparison that tolerates a divergence only at a checked near-tie."""

from __future__ import annotations

import torch

NEAR_TIE = 1e-4

# Varied prompts for greedy comparisons: prose, code, lists, a chat turn, a one-letter prompt.
VARIED_PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea.",
    "def fibonacci(n):",
    "Once upon a time, in a land far away, there lived a",
    "The three primary colors are",
    "Translate to French: I like cheese.",
    "Q: What is 12 times 7?\nA:",
    "List the planets of the solar system in order from the sun:",
    "import numpy as np\n\n# compute the mean of a list\n",
    "Dear hiring manager,",
    "The mitochondria is",
    "1, 1, 2, 3, 5, 8,",
    "<|im_start|>user\nWhat is the tallest mountain?<|im_end|>\n<|im_start|>assistant\n",
    "In 1492,",
    "Water boils at",
    "A",
]


def hf_greedy_alone(model, prompt_ids: list[int], max_new_tokens: int):
    """(generated ids, raw logits of each step) for one prompt run alone, fp32, on the
    model's device."""
    input_ids = torch.tensor([prompt_ids], device=model.device)
    with torch.inference_mode():
        out = model.generate(
            input_ids=input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
    return out.sequences[0, input_ids.shape[1] :].tolist(), [s[0] for s in out.logits]


def assert_same_or_near_tie(
    served: list[int],
    expected: list[int],
    logits: list[torch.Tensor],
    eos_ids=(2,),
    near_tie: float = NEAR_TIE,
) -> bool:
    """Equal token for token (True), or equal up to a step where HF's top-2 logits were within
    `near_tie` (False; anything after may differ)."""
    for step, (got, want) in enumerate(zip(served, expected)):
        if got != want:
            top2 = torch.topk(logits[step].float(), 2).values
            gap = (top2[0] - top2[1]).item()
            assert gap < near_tie, f"diverged at step {step} ({got} != {want}), top-2 gap {gap}"
            return False
    assert served == expected[: len(served)]
    assert len(served) == len(expected) or served[-1] in eos_ids  # only EOS ends early
    return True
