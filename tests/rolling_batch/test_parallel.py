"""How dimensions are split across tensor-parallel ranks, and a three-rank run whose uneven
splits and replicated KV heads still give the single-process tokens."""

from __future__ import annotations

import pytest
import torch

from lmserve.rolling_batch import LLM
from lmserve.rolling_batch.engine.ranks import rendezvous_address
from lmserve.rolling_batch.model.kv_cache import CacheShape, plan_num_blocks
from lmserve.rolling_batch.model.layers.parallel import HeadShard, balanced_split, shard_heads

from ..conftest import TEST_CACHE_DIR


def test_balanced_split_covers_everything_once():
    for total, parts in [(9, 2), (49152, 3), (1536, 2), (3, 3), (7, 4)]:
        splits = [balanced_split(total, parts, r) for r in range(parts)]
        assert sum(size for _, size in splits) == total
        assert [start for start, _ in splits] == [
            sum(size for _, size in splits[:r]) for r in range(parts)
        ]
        assert max(s for _, s in splits) - min(s for _, s in splits) <= 1


def test_smollm2_heads_over_two_ranks_follow_their_kv_heads():
    # 9 query heads, 3 KV heads (3 query heads each): rank 0 takes 2 KV heads, rank 1 one.
    assert shard_heads(9, 3, 2, 0) == HeadShard(q_start=0, num_q=6, kv_start=0, num_kv=2)
    assert shard_heads(9, 3, 2, 1) == HeadShard(q_start=6, num_q=3, kv_start=2, num_kv=1)


def test_more_ranks_than_kv_heads_replicate_kv_heads():
    shards = [shard_heads(9, 3, 6, r) for r in range(6)]
    assert [s.kv_start for s in shards] == [0, 0, 1, 1, 2, 2]
    assert all(s.num_kv == 1 for s in shards)
    assert sum(s.num_q for s in shards) == 9
    for s in shards:  # every query head stays with its own KV head
        assert s.q_start // 3 == s.kv_start == (s.q_start + s.num_q - 1) // 3


def test_impossible_degree_is_refused_with_the_reason():
    with pytest.raises(ValueError, match="tensor_parallel_degree=16 cannot shard 9 query heads"):
        shard_heads(9, 3, 16, 0)


def test_kv_cache_blocks_follow_the_budget_and_the_useful_maximum():
    shape = CacheShape(
        num_layers=2, num_kv_heads=3, head_dim=64, block_size=16, dtype=torch.float32
    )
    assert shape.bytes_per_block == 2 * 2 * 16 * 3 * 64 * 4
    assert plan_num_blocks(shape, 10 * shape.bytes_per_block + 5, 1000) == 10
    assert plan_num_blocks(shape, 10**12, 64) == 64
    with pytest.raises(MemoryError, match="holds no block"):
        plan_num_blocks(shape, shape.bytes_per_block - 1, 64)


def test_three_ranks_with_replicated_kv_heads_match_one_process(tiny_model_dir):
    # Tiny model: 4 query / 2 KV heads, MLP 64 wide, hidden 32: three ranks split all of them
    # unevenly and two ranks share KV head 0.
    prompts = [[1, 2, 3, 4, 5], [7042, 30], list(range(100, 140))]
    settings = dict(model=tiny_model_dir, dtype="fp32", max_model_len=128, cache_dir=TEST_CACHE_DIR)
    with LLM(**settings) as llm:
        single = llm.generate(prompts, max_new_tokens=12, ignore_eos=True)
    with LLM(tensor_parallel_degree=3, **settings) as llm:
        sharded = llm.generate(prompts, max_new_tokens=12, ignore_eos=True)
    assert [r.token_ids for r in sharded] == [r.token_ids for r in single]
    assert all(len(r.token_ids) == 12 for r in single)


def test_a_prompt_too_long_for_the_cache_is_refused_and_the_ranks_keep_serving(tiny_model_dir):
    settings = dict(model=tiny_model_dir, dtype="fp32", max_model_len=64, cache_dir=TEST_CACHE_DIR)
    with LLM(tensor_parallel_degree=2, **settings) as llm:
        with pytest.raises(ValueError, match="exceed the 64 tokens"):
            llm.generate([list(range(5, 65))], max_new_tokens=10)
        (result,) = llm.generate([[5, 6, 7]], max_new_tokens=3, ignore_eos=True)
    assert len(result.token_ids) == 3


def test_nccl_ranks_meet_rank_0_at_the_leaders_address():
    """On GPUs across hosts every rank must reach rank 0's rendezvous: the leader's address as
    the host list names it (an IPv6 one bracketed), loopback when all ranks share a host."""
    assert rendezvous_address(None, 29500) == "tcp://127.0.0.1:29500"
    assert rendezvous_address("leader.lws.default", 41000) == "tcp://leader.lws.default:41000"
    assert rendezvous_address("fd00::2", 41000) == "tcp://[fd00::2]:41000"
