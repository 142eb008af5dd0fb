"""The native model's logits equal HF transformers' (same weights, fp32) within 1e-4 relative,
on packed steps that mix whole prompts, chunked prompts and decode tokens, for block sizes 1,
16 and max_model_len (paged attention off); with the C++ CPU kernels and with the torch
references that stand in for them where no compiler is found."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from lmserve.kernels import cpu_native
from lmserve.rolling_batch.core.step import SequenceChunk
from lmserve.rolling_batch.model.layers.parallel import TensorParallelGroup
from lmserve.rolling_batch.model.runner_setup import RuntimeOptions, build_runner

MAX_MODEL_LEN = 64
PROMPTS = {
    "a": [1, 504, 3575, 282, 4649, 314, 30],
    "b": [28120, 30, 339, 5248, 253, 1114, 519, 28, 284, 339, 2606, 288],
    "c": [7042, 2988, 314],
}
# Each step: (sequence, number of new tokens). "b" is prefilled in two chunks while "a" and
# "c" already decode; decode tokens are arbitrary ids appended to the sequence.
STEPS = [
    [("a", 7), ("b", 5), ("c", 3)],
    [("a", 1), ("b", 7), ("c", 1)],
    [("a", 1), ("b", 1), ("c", 1)],
    [("c", 1), ("a", 1)],
]
DECODE_TOKENS = [42, 198, 7042, 30, 216]


def run_steps(runner, block_size, vocab_size=None):
    """(each sequence's tokens so far, its logits) for every row of every step; `vocab_size`
    folds the token ids into a smaller vocabulary."""
    fold = (lambda token: token % vocab_size) if vocab_size else (lambda token: token)
    tokens = {name: [fold(t) for t in prompt] for name, prompt in PROMPTS.items()}
    computed = dict.fromkeys(PROMPTS, 0)
    blocks_per_seq = -(-MAX_MODEL_LEN // block_size)
    free = list(range(runner.num_blocks))[::-1]  # reversed: tables are not the identity
    blocks = {name: tuple(free.pop() for _ in range(blocks_per_seq)) for name in PROMPTS}
    results = []
    for step_number, step in enumerate(STEPS):
        chunks = []
        for name, count in step:
            if computed[name] >= len(PROMPTS[name]):  # decoding: append the next token
                tokens[name].append(fold(DECODE_TOKENS[step_number]))
            new = tokens[name][computed[name] : computed[name] + count]
            chunks.append(SequenceChunk(tuple(new), computed[name], blocks[name], True))
            computed[name] += count
        logits = runner.execute(chunks)
        for (name, _), row in zip(step, logits):
            results.append((list(tokens[name][: computed[name]]), row))
    return results


@pytest.fixture(scope="module", params=["tiny", "smollm2"])
def model_dir(request, tiny_model_dir, smollm2_dir):
    return tiny_model_dir if request.param == "tiny" else smollm2_dir


@pytest.fixture(scope="module")
def hf_model(model_dir):
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(params=["native", "reference"])
def kernels(request, monkeypatch):
    if request.param == "reference":
        monkeypatch.setattr(cpu_native, "native_ops", lambda: None)
    elif cpu_native.native_ops() is None:
        pytest.skip("no C++ CPU kernels on this machine")
    return request.param


# (block_size, paged_attention); None: one block of max_model_len a sequence.
LAYOUTS = [(1, True), (16, True), (None, False)]


def layout_runner(model_dir, block_size, paged):
    """A runner (on the GPU where there is one) with the KV layout LAYOUTS names."""
    options = RuntimeOptions(
        dtype="fp32",
        max_model_len=MAX_MODEL_LEN,
        paged_attention=paged,
        block_size=block_size or MAX_MODEL_LEN,
        max_rolling_batch_size=len(PROMPTS),
    )
    runner, _, _ = build_runner(model_dir, options, TensorParallelGroup())
    assert runner.block_size == (block_size if paged else MAX_MODEL_LEN)
    return runner


def assert_steps_match_hf_logits(runner, hf_model, tolerance: float = 1e-4) -> None:
    """Every row of run_steps' packed steps within `tolerance` (relative) of HF's logits for
    the same tokens, on the HF model's device."""
    for sequence, logits in run_steps(runner, runner.block_size):
        assert logits.device == hf_model.device
        with torch.inference_mode():
            expected = hf_model(torch.tensor([sequence], device=hf_model.device)).logits[0, -1]
        error = (logits.float() - expected).abs().max() / expected.abs().max()
        assert error < tolerance, f"relative error {error:.2e} after {len(sequence)} tokens"


@pytest.mark.parametrize(("block_size", "paged"), LAYOUTS)
def test_packed_steps_match_hf_logits(model_dir, hf_model, block_size, paged, kernels):
    assert_steps_match_hf_logits(layout_runner(model_dir, block_size, paged), hf_model)


def test_prompt_scores_equal_hf_log_probs_across_chunks(model_dir, hf_model):
    """A prompt scored as it is prefilled in two chunks beside a decode: each prompt token's
    log-prob given the tokens before it, and the top 3 at each position, as HF's logits say."""
    options = RuntimeOptions(
        dtype="fp32", max_model_len=MAX_MODEL_LEN, paged_attention=True, block_size=4
    )
    runner, _, _ = build_runner(model_dir, options, TensorParallelGroup())
    prompt, other = PROMPTS["b"], PROMPTS["c"]
    blocks = (tuple(range(0, 8)), tuple(range(8, 16)))
    scores = []
    for start, end in ((0, 5), (5, len(prompt))):
        targets = tuple(prompt[start + 1 : min(end, len(prompt) - 1) + 1])
        chunk = SequenceChunk(tuple(prompt[start:end]), start, blocks[0], True, 0, targets, 3)
        decoy = SequenceChunk(tuple(other), 0, blocks[1], True) if start == 0 else None
        step = runner.execute_step([c for c in (decoy, chunk) if c is not None])
        scores.append(step.prompt_scores[1 if decoy else 0])
    log_probs = [value for score in scores for value in score.log_probs]
    tops = [top for score in scores for top in score.top_logprobs]
    with torch.inference_mode():
        expected = torch.log_softmax(hf_model(torch.tensor([prompt])).logits[0, :-1], dim=-1)
    wanted = expected.gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(log_probs), wanted, atol=1e-4, rtol=1e-4)
    for top, row in zip(tops, expected, strict=True):
        values, tokens = torch.topk(row, 3)
        assert [token for token, _ in top] == tokens.tolist()
        torch.testing.assert_close(torch.tensor([v for _, v in top]), values, atol=1e-4, rtol=0)
