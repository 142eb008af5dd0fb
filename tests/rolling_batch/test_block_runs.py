"""Each request's KV blocks come as one run of consecutive ids where the pool allows
(block_manager.py): a burst whose requests grow a block at a time still gets one span each,
a reservation gives way when the pool runs short, and a finished request's reservation is free
again at once (test_scheduler.py runs tight pools through them). Every test ends with
check_invariants()."""

from __future__ import annotations

from lmserve.rolling_batch.core.block_manager import BlockManager
from lmserve.rolling_batch.core.request import Request
from lmserve.rolling_batch.ipc.protocol import GenerationParams

BLOCK = 4


def request(name: str, prompt_len: int, max_new_tokens: int) -> Request:
    return Request(name, [5] * prompt_len, GenerationParams(max_new_tokens=max_new_tokens), 0.0)


def grow_by_one_token(blocks: BlockManager, requests: list[Request]) -> None:
    """One decode step: every request's cache grows by a token, in turn."""
    for r in requests:
        r.num_computed_tokens += 1
        blocks.grow(r, r.num_computed_tokens)


def is_one_run(block_ids: list[int]) -> bool:
    return block_ids == list(range(block_ids[0], block_ids[0] + len(block_ids)))


def test_requests_growing_in_turn_each_keep_one_run():
    blocks = BlockManager(100, BLOCK)
    burst = [request(f"r{i}", 6, 10) for i in range(4)]
    for r in burst:  # the prompts: two blocks each, one request after another
        r.num_computed_tokens = 6
        blocks.grow(r, 6)
    for _ in range(10):
        grow_by_one_token(blocks, burst)
    for r in burst:
        assert len(r.block_ids) == 4 and is_one_run(r.block_ids), r.block_ids
    assert sorted(b for r in burst for b in r.block_ids) == list(range(16))  # packed from 0
    blocks.check_invariants(burst)


def test_a_short_pool_breaks_reservations_instead_of_refusing_a_block():
    blocks = BlockManager(6, BLOCK)
    first = request("first", 4, 16)  # wants 5 blocks: takes 1, reserves 4
    first.num_computed_tokens = 4
    blocks.grow(first, 4)
    assert blocks.num_free == 5  # reserved blocks are free blocks
    second = request("second", 16, 4)  # 4 blocks now, where 5 are free and 4 of them reserved
    assert blocks.can_hold(second, 16)
    blocks.grow(second, 16)
    second.num_computed_tokens = 16
    assert blocks.num_free == 1 and len(second.block_ids) == 4
    grow_by_one_token(blocks, [first])  # its own run was cut: any free block will do
    assert len(first.block_ids) == 2 and blocks.num_free == 0
    blocks.check_invariants([first, second])


def test_a_finished_request_frees_its_reservation():
    blocks = BlockManager(10, BLOCK)
    long = request("long", 4, 32)  # reserves up to the pool's end
    long.num_computed_tokens = 4
    blocks.grow(long, 4)
    blocks.free(long)
    again = request("again", 4, 32)
    for tokens in range(4, 37, 4):
        blocks.grow(again, tokens)
    assert again.block_ids == list(range(9))  # the same run was there to take, whole
    blocks.check_invariants([again])
