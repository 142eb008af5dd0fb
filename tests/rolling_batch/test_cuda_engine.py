"""The engine on a GPU: the ModelRunner that build_runner makes on CUDA (the Triton K/V store
and paged attention) gives HF transformers' logits and greedy tokens on the same device, fp32,
with a paged and a contiguous KV cache. Skipped without a GPU (tests/kernels runs the kernels
in Triton's interpreter there)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from lmserve.rolling_batch.engine_setup import RuntimeOptions, build_runner
from lmserve.rolling_batch.layers.parallel import TensorParallelGroup
from lmserve.rolling_batch.offline_generation import generate_greedy

from ..conftest import save_tiny_llama
from ..hf_reference import assert_same_or_near_tie, hf_greedy_alone
from .test_model_logits import MAX_MODEL_LEN, PROMPTS, run_steps

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

MAX_NEW_TOKENS = 40  # the longest prompt (12 tokens) then crosses two 16-token blocks
# (block_size, paged_attention); None: one block of max_model_len a sequence.
LAYOUTS = [(1, True), (16, True), (None, False)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    # No tokenizer (the engine takes token ids): no embedded GGUF needed on the GPU machine.
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama-cuda"), None)


@pytest.fixture(scope="module")
def hf_model(model_dir):
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return model.to("cuda").eval()


def cuda_runner(model_dir, block_size, paged):
    options = RuntimeOptions(
        dtype="fp32",
        max_model_len=MAX_MODEL_LEN,
        paged_attention=paged,
        block_size=block_size or MAX_MODEL_LEN,
        max_num_seqs=len(PROMPTS),
    )
    runner, _, _ = build_runner(model_dir, options, TensorParallelGroup())
    assert runner.device.type == "cuda" and runner.kv_caches[0][0].is_cuda
    assert runner.block_size == (block_size if paged else MAX_MODEL_LEN)
    return runner


@pytest.mark.parametrize(("block_size", "paged"), LAYOUTS)
def test_packed_steps_match_hf_logits(model_dir, hf_model, block_size, paged):
    runner = cuda_runner(model_dir, block_size, paged)
    for sequence, logits in run_steps(runner, runner.block_size):
        assert logits.is_cuda
        with torch.inference_mode():
            expected = hf_model(torch.tensor([sequence], device="cuda")).logits[0, -1]
        error = (logits - expected).abs().max() / expected.abs().max()
        assert error < 1e-4, f"relative error {error:.2e} after {len(sequence)} tokens"


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
