"""The engine=Python model on a tiny random Llama: a batch of prompts with different lengths
and different max_new_tokens gives each row what it would get alone."""

from __future__ import annotations

import pytest
import torch

from lmserve.handlers.hf_engine import HFEngine
from lmserve.rolling_batch.model_loader import resolve_dtype
from lmserve.rolling_batch.protocol import GenerationParams


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return HFEngine.load(str(tiny_model_dir), "fp32")


def test_batched_rows_equal_their_runs_alone(engine):
    prompts = [[1, 504, 3575], [28120, 30, 339, 5248, 253, 1114, 519], [7042]]
    params = [GenerationParams(max_new_tokens=n, ignore_eos=True) for n in (5, 9, 2)]
    batched = engine.generate(prompts, params)
    for prompt, row_params, row in zip(prompts, params, batched):
        (alone,) = engine.generate([prompt], [row_params])
        assert row.token_ids == alone.token_ids
        assert len(row.token_ids) == row_params.max_new_tokens
        assert row.finish_reason == "length"
        assert all(lp <= 0 for lp in row.log_probs)
        assert row.log_probs == pytest.approx(alone.log_probs, abs=1e-4)


def test_eos_ends_a_row_unless_ignored(engine):
    # Find a prompt whose greedy continuation hits EOS, by forcing EOS to be the argmax.
    bias = torch.zeros(engine.model.config.vocab_size)
    bias[2] = 1e4
    head = engine.model.lm_head
    original = head.bias
    head.bias = torch.nn.Parameter(bias)
    try:
        (stopped,) = engine.generate([[1, 2, 3]], [GenerationParams(max_new_tokens=5)])
        (ignored,) = engine.generate(
            [[1, 2, 3]], [GenerationParams(max_new_tokens=5, ignore_eos=True)]
        )
    finally:
        head.bias = original
    assert stopped.token_ids == [2] and stopped.finish_reason == "eos_token"
    assert ignored.token_ids == [2] * 5 and ignored.finish_reason == "length"


def test_seeded_sampling_repeats(engine):
    params = [GenerationParams(max_new_tokens=6, do_sample=True, temperature=1.5, seed=7)]
    first = engine.generate([[1, 2, 3]], params)
    again = engine.generate([[1, 2, 3]], params)
    assert first[0].token_ids == again[0].token_ids


def test_auto_dtype_follows_the_cpu_and_the_checkpoint_on_gpu(monkeypatch):
    from lmserve.rolling_batch import model_loader

    monkeypatch.setattr(model_loader, "cpu_has_native_bf16", lambda: False)
    assert resolve_dtype("auto", torch.bfloat16, "cpu") == torch.float32
    monkeypatch.setattr(model_loader, "cpu_has_native_bf16", lambda: True)
    assert resolve_dtype("auto", torch.float32, "cpu") == torch.bfloat16
    assert resolve_dtype("auto", torch.float16, "cuda") == torch.float16
    assert resolve_dtype("bf16", torch.float32, "cpu") == torch.bfloat16
