"""Decode steps through the CUDA graphs' static buffers (rolling_batch/model/cuda_graphs.py):
a decode batch pads to its bucket with rows that store nothing, and its tokens stay HF's
greedy tokens. On a CPU the buffers' path runs without capture (what the padding does to the
real rows); on a GPU (tests/gpu_check.sh) the graphs are captured and replayed, and give the
tokens eager steps give."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from lmserve.rolling_batch.ipc import protocol
from lmserve.rolling_batch.llm import LocalEngine, engine_config
from lmserve.rolling_batch.model.cuda_graphs import (
    DecodeGraphs,
    batch_buckets,
    capture_decode_graphs,
)
from lmserve.rolling_batch.model.layers.attention import AttentionMetadata

from ..conftest import save_tiny_llama
from ..hf_reference import assert_same_or_near_tie, hf_greedy_alone
from .test_model_logits import LAYOUTS, MAX_MODEL_LEN, PROMPTS, layout_runner

MAX_NEW_TOKENS = 40  # the longest prompt (12 tokens) then crosses two 16-token blocks
CUDA = torch.cuda.is_available()


def test_buckets_cover_every_batch_up_to_the_largest():
    assert batch_buckets(32) == [1, 2, 4, 8, 16, 24, 32]
    assert batch_buckets(5) == [1, 2, 4, 5]
    large = batch_buckets(256)
    assert large[-4:] == [208, 224, 240, 256] and 64 in large and 56 in large
    # No batch past 8 pads by more than a quarter of its rows.
    for batch in range(9, 257):
        bucket = next(b for b in large if b >= batch)
        assert bucket - batch <= max(7, batch // 4)


def test_a_smaller_batch_pads_over_the_rows_a_larger_one_left():
    """Rows past the batch store nothing (slot -1) and read one key, whatever ran before."""
    graphs = DecodeGraphs(None, torch.device("cpu"), max_batch=8, max_blocks=3, max_model_len=48)

    def load(count: int) -> None:
        rows = torch.arange(count)
        tables = (rows[:, None] * 3 + torch.arange(3)).to(torch.int32)
        meta = AttentionMetadata(rows * 16 + 5, tables, (rows + 6).to(torch.int32),
                                 torch.arange(count + 1, dtype=torch.int32), 1, 11)  # fmt: skip
        graphs.load(rows + 100, rows + 5, meta, next(b for b in graphs.buckets if b >= count))

    load(4)
    load(3)
    assert graphs.input_ids[:3].tolist() == [100, 101, 102]
    assert graphs.slots[:4].tolist() == [5, 21, 37, -1]
    assert graphs.seq_lens[:4].tolist() == [6, 7, 8, 1]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama-graphs"), None)


@pytest.fixture(scope="module")
def hf_model(model_dir):
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return model.to("cuda" if CUDA else "cpu").eval()


def serve(runner, model_dir, eos) -> list[list[int]]:
    prompts = list(PROMPTS.values())
    config = engine_config({"max_model_len": MAX_MODEL_LEN, "max_rolling_batch_size": len(prompts)})
    engine = LocalEngine.for_runner(config, model_dir, runner, MAX_MODEL_LEN, eos)
    params = protocol.GenerationParams(max_new_tokens=MAX_NEW_TOKENS)
    answers = engine.run(
        [protocol.GenerateRequest(str(i), p, params, stream=False) for i, p in enumerate(prompts)]
    )
    return [answers[str(i)].token_ids for i in range(len(prompts))]


def with_graphs(runner, max_batch: int) -> DecodeGraphs:
    """Captured on a GPU; on a CPU the same buffers, run without capture."""
    if CUDA:
        graphs = capture_decode_graphs(runner, max_batch, MAX_MODEL_LEN)
        assert graphs is not None and set(graphs.graphs) == set(graphs.buckets)
        return graphs

    def forward(input_ids, positions, meta):
        return runner.model(input_ids, positions, runner.kv_caches, meta)

    max_blocks = -(-MAX_MODEL_LEN // runner.block_size)
    return DecodeGraphs(forward, runner.device, max_batch, max_blocks, MAX_MODEL_LEN)


# On a CPU one layout shows what padding does (the buffers do not depend on it); a GPU
# captures each.
@pytest.mark.parametrize(("block_size", "paged"), LAYOUTS if CUDA else LAYOUTS[1:2])
def test_padded_decode_steps_give_hf_greedy_tokens(model_dir, hf_model, block_size, paged):
    """Three prompts decode as a batch of 3 in the bucket of 4; a prompt chunk beside decodes
    runs eagerly."""
    eos = {hf_model.config.eos_token_id}
    runner = layout_runner(model_dir, block_size, paged)
    runner.graphs = graphs = with_graphs(runner, max_batch=8)
    replayed = []
    replay = graphs.replay
    graphs.replay = lambda ids, *rest: replayed.append(len(ids)) or replay(ids, *rest)
    served = serve(runner, model_dir, eos)
    assert replayed and set(replayed) <= {1, 2, 3}
    # The eager steps' tokens are HF's too (test_cuda_engine.py): graphs on and off give the
    # same tokens up to near-ties (a padded bucket may take another matmul algorithm).
    for prompt, tokens in zip(PROMPTS.values(), served, strict=True):
        expected, logits = hf_greedy_alone(hf_model, prompt, MAX_NEW_TOKENS)
        assert_same_or_near_tie(tokens, expected, logits)
