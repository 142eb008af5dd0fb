"""The engine on a GPU: the ModelRunner that build_runner makes on CUDA (the Triton K/V store
and paged attention) gives HF transformers' logits and greedy tokens on the same device, fp32,
with a paged and a contiguous KV cache. Skipped without a GPU (tests/kernels runs the kernels
in Triton's interpreter there)."""

from __future__ import annotations

import importlib

import pytest
import torch
from transformers import AutoModelForCausalLM

from lmserve.rolling_batch.ipc import protocol
from lmserve.rolling_batch.llm import LocalEngine, engine_config
from lmserve.rolling_batch.model.layers.parallel import TensorParallelGroup
from lmserve.rolling_batch.model.runner_setup import RuntimeOptions, build_runner

from ..conftest import save_tiny_llama
from ..hf_reference import assert_same_or_near_tie, hf_greedy_alone
from .test_model_logits import (
    LAYOUTS,
    MAX_MODEL_LEN,
    PROMPTS,
    assert_steps_match_hf_logits,
    layout_runner,
)

# The module (the package's `paged_attention` is the dispatching function of the same name).
paged_attention = importlib.import_module("lmserve.kernels.paged_attention")
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


@pytest.mark.parametrize("kernel", paged_attention.CUDA_KERNELS)
@pytest.mark.parametrize(("block_size", "paged"), LAYOUTS)
def test_packed_steps_match_hf_logits(model_dir, hf_model, block_size, paged, kernel, monkeypatch):
    monkeypatch.setattr(paged_attention, "cuda_kernel", kernel)
    assert_steps_match_hf_logits(cuda_runner(model_dir, block_size, paged), hf_model)


@pytest.mark.parametrize("kernel", paged_attention.CUDA_KERNELS)
def test_bf16_steps_stay_within_bf16_of_hf_fp32(model_dir, hf_model, kernel, monkeypatch):
    """bf16 end to end on the GPU (the tiled kernel's tensor-core dots): every packed step's
    logits within a few bf16 roundings of HF's fp32 logits."""
    monkeypatch.setattr(paged_attention, "cuda_kernel", kernel)
    options = RuntimeOptions(dtype="bf16", max_model_len=MAX_MODEL_LEN, block_size=4,
                             max_rolling_batch_size=len(PROMPTS))  # fmt: skip
    runner, _, _ = build_runner(model_dir, options, TensorParallelGroup())
    assert next(runner.model.parameters()).dtype == torch.bfloat16
    assert_steps_match_hf_logits(runner, hf_model, tolerance=5e-2)


@pytest.mark.parametrize("kernel", paged_attention.CUDA_KERNELS)
@pytest.mark.parametrize(("block_size", "paged"), LAYOUTS)
def test_greedy_tokens_equal_hf_generate(
    model_dir, hf_model, block_size, paged, kernel, monkeypatch
):
    """All prompts at once through the rolling scheduler, prompts prefilled in chunks of at
    most 8 tokens beside the others' decodes; with each CUDA attention kernel."""
    monkeypatch.setattr(paged_attention, "cuda_kernel", kernel)
    runner = cuda_runner(model_dir, block_size, paged)
    prompts = list(PROMPTS.values())
    config = engine_config(
        {
            "max_model_len": MAX_MODEL_LEN,
            "paged_attention": paged,
            "max_rolling_batch_size": len(prompts),
            "max_rolling_batch_prefill_tokens": 8,
        }
    )
    eos = {hf_model.config.eos_token_id}
    engine = LocalEngine.for_runner(config, model_dir, runner, MAX_MODEL_LEN, eos)
    params = protocol.GenerationParams(max_new_tokens=MAX_NEW_TOKENS)
    answers = engine.run(
        [protocol.GenerateRequest(str(i), p, params, stream=False) for i, p in enumerate(prompts)]
    )
    served = [answers[str(i)].token_ids for i in range(len(prompts))]
    for prompt, tokens in zip(prompts, served, strict=True):
        expected, logits = hf_greedy_alone(hf_model, prompt, MAX_NEW_TOKENS)
        assert_same_or_near_tie(tokens, expected, logits)
