"""The offline LLM API on SmolLM2: greedy generation equals HF's token for token (near-ties
checked), with paged attention on or off, and with two tensor-parallel MPI ranks."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from lmserve.rolling_batch import LLM

from ..conftest import TEST_CACHE_DIR
from ..hf_reference import VARIED_PROMPTS, assert_same_or_near_tie, hf_greedy_alone

PROMPTS = VARIED_PROMPTS
MAX_NEW_TOKENS = 64
MAX_MODEL_LEN = 256


@pytest.fixture(scope="module")
def tp1_results():
    with LLM(max_model_len=MAX_MODEL_LEN, dtype="fp32", cache_dir=TEST_CACHE_DIR) as llm:
        results = llm.generate(PROMPTS, max_new_tokens=MAX_NEW_TOKENS)
        return results, [llm.tokenizer(p)["input_ids"] for p in PROMPTS]


def test_greedy_generation_equals_hf(tp1_results, smollm2_dir):
    results, prompt_ids = tp1_results
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    for prompt, ids, result in zip(PROMPTS, prompt_ids, results):
        assert result.prompt == prompt
        expected, logits = hf_greedy_alone(model, ids, MAX_NEW_TOKENS)
        assert_same_or_near_tie(result.token_ids, expected, logits)
    assert any(len(r.token_ids) == MAX_NEW_TOKENS for r in results)
    assert "Paris" in results[0].text


def test_paged_attention_off_gives_the_same_tokens(tp1_results):
    results, _ = tp1_results
    with LLM(
        max_model_len=MAX_MODEL_LEN, dtype="fp32", paged_attention=False, cache_dir=TEST_CACHE_DIR
    ) as llm:
        assert llm._engine.runner.block_size == MAX_MODEL_LEN
        contiguous = llm.generate(PROMPTS, max_new_tokens=MAX_NEW_TOKENS)
    assert [r.token_ids for r in contiguous] == [r.token_ids for r in results]


def test_two_mpi_ranks_give_the_same_tokens(tp1_results):
    results, _ = tp1_results
    with LLM(
        max_model_len=MAX_MODEL_LEN,
        dtype="fp32",
        tensor_parallel_degree=2,
        cache_dir=TEST_CACHE_DIR,
    ) as llm:
        sharded = llm.generate(PROMPTS, max_new_tokens=MAX_NEW_TOKENS)
        process = llm._engine._process
    assert [r.token_ids for r in sharded] == [r.token_ids for r in results]
    assert process.poll() is not None, "the MPI ranks outlived close()"


def test_speculative_decoding_gives_the_same_tokens_in_fewer_steps(tp1_results):
    """Fewer steps a sequence (the batch's step count is set by its slowest sequence, which
    may keep no draft)."""
    results, _ = tp1_results
    sequence_steps = {}
    for drafts in (None, "[ngram]"):
        with LLM(
            max_model_len=MAX_MODEL_LEN,
            dtype="fp32",
            cache_dir=TEST_CACHE_DIR,
            speculative_draft_model=drafts,
        ) as llm:
            core, calls = llm._engine.shell.core, []
            core.execute = _counting(core.execute, calls)
            speculated = llm.generate(PROMPTS, max_new_tokens=MAX_NEW_TOKENS)
            sequence_steps[drafts] = sum(calls)
        assert [r.token_ids for r in speculated] == [r.token_ids for r in results]
    assert sequence_steps["[ngram]"] < sequence_steps[None]


def _counting(execute, calls: list):
    """`execute`, each call's number of sequences recorded in `calls`."""

    def counted(chunks):
        calls.append(len(chunks))
        return execute(chunks)

    return counted


def test_token_id_prompts_and_a_cache_smaller_than_the_batch(tp1_results):
    results, prompt_ids = tp1_results
    # 16 blocks of 16 tokens for five sequences that grow to 5-6 blocks each: they run one at
    # a time (max_rolling_batch_size=1), and the tokens must not change.
    with LLM(
        max_model_len=MAX_MODEL_LEN,
        dtype="fp32",
        max_rolling_batch_size=1,
        cache_dir=TEST_CACHE_DIR,
    ) as llm:
        assert llm._engine.runner.num_blocks == MAX_MODEL_LEN // 16
        again = llm.generate(prompt_ids[:5], max_new_tokens=MAX_NEW_TOKENS)
    assert [r.token_ids for r in again] == [r.token_ids for r in results[:5]]
    assert again[0].prompt is None


def test_bf16_serves_sensible_text():
    with LLM(max_model_len=MAX_MODEL_LEN, dtype="bf16", cache_dir=TEST_CACHE_DIR) as llm:
        (result,) = llm.generate(["The capital of France is"], max_new_tokens=8)
        assert next(llm._engine.runner.model.parameters()).dtype == torch.bfloat16
    assert "Paris" in result.text
