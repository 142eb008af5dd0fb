"""The engine on a GPU: the ModelRunner that build_runner makes on CUDA (the Triton K/V store
and paged attention) gives HF transformers' logits and greedy tokens on the same device, fp32,
with a paged and a contiguous KV cache. Skipped without a GPU (tests/kernels runs the kernels
in Triton's interpreter there)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from lmserve.rolling_batch.offline_generation import generate_greedy

from ..conftest import save_tiny_llama
from ..hf_reference import assert_same_or_near_tie, hf_greedy_alone
from .test_model_logits import (
    LAYOUTS,
    MAX_MODEL_LEN,
    PROMPTS,
    assert_steps_match_hf_logits,
    layout_runner,
)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

MAX_NEW_TOKENS = 40  # the longest prompt (12 tokens) then crosses two 16-token blocks


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    # No tokenizer (the engine takes token ids): no embedded GGUF needed on the GPU machine.
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama-cuda"), None)


@pytest.fixture(scope="module")
def hf_model(model_dir):
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return model.to("cuda").eval()


def cuda_runner(model_dir, block_size, paged):
    runner = layout_runner(model_dir, block_size, paged)
    assert runner.device.type == "cuda" and runner.kv_caches[0][0].is_cuda
    return runner


@pytest.mark.parametrize(("block_size", "paged"), LAYOUTS)
def test_packed_steps_match_hf_logits(model_dir, hf_model, block_size, paged):
    assert_steps_match_hf_logits(cuda_runner(model_dir, block_size, paged), hf_model)


@pytest.mark.parametrize(("block_size", "paged"), LAYOUTS)
def test_greedy_tokens_equal_hf_generate(model_dir, hf_model, block_size, paged):
    """All prompts at once through the rolling scheduler, prompts prefilled in chunks of at
    most 8 tokens beside the others' decodes."""
    runner = cuda_runner(model_dir, block_size, paged)
    prompts = list(PROMPTS.values())
    served = generate_greedy(
        runner.execute,
        runner.num_blocks,
        runner.block_size,
        MAX_MODEL_LEN,
        len(prompts),
        prompts,
        MAX_NEW_TOKENS,
        eos_token_ids={hf_model.config.eos_token_id},
        prefill_token_budget=8,
    )
    for prompt, tokens in zip(prompts, served, strict=True):
        expected, logits = hf_greedy_alone(hf_model, prompt, MAX_NEW_TOKENS)
        assert_same_or_near_tie(tokens, expected, logits)
