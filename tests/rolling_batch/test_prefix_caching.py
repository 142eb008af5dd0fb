"""Prefix caching in the scheduler and block manager, torch-free: a simulated KV cache records
which token each step wrote to each slot, and every chunk is checked to attend over exactly
its sequence's tokens, whether computed or taken from cached blocks. Randomized workloads
with shared prefixes, a pool small enough to preempt and evict, and aborts mid-prefill; the
invariants after every step; outputs equal to the cache off."""

from __future__ import annotations

import random

import pytest

from lmserve.rolling_batch.core import prefix_cache
from lmserve.rolling_batch.core.block_manager import BlockManager
from lmserve.rolling_batch.core.request import Request
from lmserve.rolling_batch.core.scheduler import Scheduler
from lmserve.rolling_batch.core.step import Sample
from lmserve.rolling_batch.ipc.protocol import GenerationParams

from .test_scheduler import EOS, expected_outputs, fake_next_token, fresh

BLOCK = 4


class SimulatedCache:
    """What the KV cache would hold: the token written to each slot by the steps so far."""

    def __init__(self):
        self.slots: dict[tuple[int, int], int] = {}

    def step(self, chunks) -> None:
        for chunk in chunks:
            tokens_before = self.context(chunk.block_ids, chunk.num_computed)
            assert None not in tokens_before, "a chunk attends over a slot never written"
            for offset, token in enumerate(chunk.token_ids):
                position = chunk.num_computed + offset
                self.slots[chunk.block_ids[position // BLOCK], position % BLOCK] = token

    def context(self, block_ids, num_tokens: int) -> list[int | None]:
        return [self.slots.get((block_ids[p // BLOCK], p % BLOCK)) for p in range(num_tokens)]


def run_with_cache(scheduler: Scheduler, requests, rng=None, abort_rate: float = 0.0):
    """Runs `requests` (a few arriving per step); checks each chunk's context against its
    sequence and the invariants after every step. Returns outputs and the aborted ids."""
    cache = SimulatedCache()
    pending, aborted, steps = list(requests), set(), 0
    while pending or scheduler.has_work():
        for _ in range(2):
            if pending:
                scheduler.add(pending.pop(0))
        out = scheduler.schedule()
        for request, chunk in zip(out.requests, out.chunks):
            expected = request.all_token_ids[: chunk.num_computed]
            assert cache.context(chunk.block_ids, chunk.num_computed) == expected
        cache.step(out.chunks)
        sampled = {r: Sample(fake_next_token(r.all_token_ids), -0.5) for r in out.sampling}
        scheduler.update(out, sampled, {EOS})
        if rng is not None and rng.random() < abort_rate:
            prefilling = [r for r in scheduler.running if r.is_prefilling]
            if prefilling:
                victim = rng.choice(prefilling)
                scheduler.abort(victim.request_id)
                aborted.add(victim.request_id)
        scheduler.check_invariants()
        steps += 1
        assert steps < 20_000, "the scheduler stopped making progress"
    return {r.request_id: list(r.output_ids) for r in requests}, aborted


def shared_prefix_requests(count: int, seed: int) -> list[Request]:
    """Requests that share system prompts of several lengths, some whole prompts repeated,
    some continuing an earlier request's prompt (a conversation's next turn)."""
    rng = random.Random(seed)
    systems = [[rng.randrange(3, 1000) for _ in range(n)] for n in (5, 12, 23)]
    requests = []
    for index in range(count):
        kind = rng.random()
        if kind < 0.2 and requests:  # the same prompt again
            prompt = list(rng.choice(requests).prompt_ids)
        elif kind < 0.4 and requests:  # a next turn: an earlier prompt plus more
            prompt = list(rng.choice(requests).prompt_ids) + [rng.randrange(3, 1000)] * 3
        else:
            prompt = rng.choice(systems) + [
                rng.randrange(3, 1000) for _ in range(rng.randrange(1, 9))
            ]
        params = GenerationParams(max_new_tokens=rng.randrange(1, 12), ignore_eos=True)
        requests.append(Request(f"r{index}", prompt[:60], params, float(index)))
    return requests


def scheduler(num_blocks: int, caching: bool, max_rolling_batch_size: int = 4, budget: int = 16):
    return Scheduler(BlockManager(num_blocks, BLOCK, caching), max_rolling_batch_size, budget, 96)


@pytest.mark.parametrize("seed", range(6))
def test_shared_prefixes_reuse_blocks_and_change_no_output(seed):
    requests = shared_prefix_requests(40, seed)
    cached = scheduler(120, caching=True)
    outputs, _ = run_with_cache(cached, fresh(requests))
    assert outputs == expected_outputs(requests)
    assert cached.num_prefix_hit_tokens > 0  # the shared prefixes were found
    assert cached.num_prefix_hit_tokens % BLOCK == 0
    assert cached.blocks.num_free == 120  # all free again, the cached ones among them


@pytest.mark.parametrize("seed", range(6))
def test_a_tight_pool_preempts_and_evicts_and_changes_no_output(seed):
    requests = shared_prefix_requests(40, seed)
    tight = scheduler(20, caching=True)  # the longest request needs 18 blocks
    outputs, _ = run_with_cache(tight, fresh(requests))
    assert outputs == expected_outputs(requests)
    assert tight.num_preemptions > 0 and tight.num_prefix_hit_tokens > 0


@pytest.mark.parametrize("seed", range(4))
def test_aborts_mid_prefill_leave_the_cache_consistent(seed):
    requests = shared_prefix_requests(40, seed)
    rng = random.Random(seed)
    # A budget of 6 tokens a step: most prompts take several steps to prefill.
    tight_budget = scheduler(40, caching=True, budget=6)
    outputs, aborted = run_with_cache(tight_budget, fresh(requests), rng, 0.3)
    assert aborted
    expected = expected_outputs(requests)
    for request_id, output in outputs.items():
        if request_id not in aborted:
            assert output == expected[request_id]


def test_a_repeated_prompt_computes_only_its_last_block_again():
    prompt = list(range(10, 10 + 4 * BLOCK + 2))  # four full blocks and two tokens
    first = Request("a", prompt, GenerationParams(max_new_tokens=1), 0.0)
    again = Request("b", prompt, GenerationParams(max_new_tokens=1), 1.0)
    sched = scheduler(64, caching=True)
    run_with_cache(sched, [first])
    out = None
    sched.add(again)
    out = sched.schedule()
    (chunk,) = out.chunks
    assert chunk.num_computed == 4 * BLOCK and chunk.token_ids == tuple(prompt[4 * BLOCK :])
    assert chunk.block_ids[:4] == tuple(first_blocks(sched, prompt))


def first_blocks(sched: Scheduler, prompt: list[int]) -> list[int]:
    probe = Request("probe", prompt, GenerationParams(), 0.0)
    sched.blocks.reuse_cached_prefix(probe)
    blocks = list(probe.block_ids)
    sched.blocks.free(probe)
    return blocks


def test_a_prompt_of_whole_blocks_still_computes_its_last_token():
    prompt = list(range(100, 100 + 3 * BLOCK))
    sched = scheduler(64, caching=True)
    run_with_cache(sched, [Request("a", prompt, GenerationParams(max_new_tokens=1), 0.0)])
    sched.add(Request("b", prompt, GenerationParams(max_new_tokens=1), 1.0))
    (chunk,) = sched.schedule().chunks
    # Two blocks reused; the third is computed again for its last token's logits.
    assert chunk.num_computed == 2 * BLOCK and len(chunk.token_ids) == BLOCK


def test_prompt_log_probs_and_the_cache_off_compute_everything():
    prompt = list(range(200, 200 + 3 * BLOCK + 1))
    for caching, params in (
        (True, GenerationParams(prompt_logprobs=True)),
        (False, GenerationParams()),
    ):
        sched = scheduler(64, caching=caching)
        run_with_cache(sched, [Request("a", prompt, GenerationParams(max_new_tokens=1), 0.0)])
        sched.add(Request("b", prompt, params, 1.0))
        (chunk,) = sched.schedule().chunks
        assert chunk.num_computed == 0
        assert sched.num_prefix_hit_tokens == 0


def test_cached_blocks_are_evicted_least_recently_used_first():
    blocks = BlockManager(6, BLOCK, enable_prefix_caching=True)
    sequences = []
    for index in range(3):  # three finished requests, one full block each, cached
        request = Request(f"r{index}", [index] * (BLOCK + 1), GenerationParams(), 0.0)
        blocks.grow(request, BLOCK + 1)
        request.num_computed_tokens = BLOCK + 1
        blocks.cache_full_blocks(request)
        blocks.free(request)
        sequences.append(request)
    assert blocks.num_cached == 3 and blocks.num_free == 6
    # r0's prefix is used again: it becomes the most recently used.
    reuse = Request("again", [0] * (BLOCK + 1), GenerationParams(), 0.0)
    blocks.reuse_cached_prefix(reuse)
    blocks.free(reuse)
    # Five blocks taken: the three never cached, then r1's (least recently used), then r2's.
    taker = Request("taker", [7] * (5 * BLOCK), GenerationParams(), 0.0)
    blocks.grow(taker, 5 * BLOCK)
    blocks.check_invariants([taker])
    still_cached = Request("probe", [0] * (BLOCK + 1), GenerationParams(), 0.0)
    blocks.reuse_cached_prefix(still_cached)
    assert still_cached.num_computed_tokens == BLOCK and blocks.num_cached == 1
    for evicted in ([1] * (BLOCK + 1), [2] * (BLOCK + 1)):
        probe = Request("probe2", evicted, GenerationParams(), 0.0)
        blocks.reuse_cached_prefix(probe)
        assert probe.num_computed_tokens == 0


@pytest.mark.parametrize(
    ("field", "first", "cases"),
    [
        ("adapter", "sql", (("base", None, 0), ("other", "chat", 0), ("same", "sql", 4))),
        (
            "cache_salt",
            "tenant-a",
            (("unsalted", None, 0), ("other", "tenant-b", 0), ("same", "tenant-a", 4)),
        ),
    ],
)
def test_blocks_are_shared_only_under_the_same_adapter_and_salt(field, first, cases):
    """The same tokens through another LoRA adapter (or none) have other K/V, and a
    cache_salt keeps tenants apart: reuse only within one adapter and one salt."""
    prompt = list(range(10, 10 + 4 * BLOCK + 2))
    sched = scheduler(64, caching=True)
    run_with_cache(sched, [Request("a", prompt, GenerationParams(1, **{field: first}), 0.0)])
    for request_id, value, reused in cases:
        params = GenerationParams(max_new_tokens=1, **{field: value})
        sched.add(Request(request_id, prompt, params, 1.0))
        (chunk,) = sched.schedule().chunks
        assert chunk.num_computed == reused * BLOCK, value
        sched.abort(request_id)


def test_a_digest_collision_shares_no_block(monkeypatch):
    """Every chain gets the same digest: a hit still needs the same tokens under the same
    parent, so a different prompt computes all its blocks itself; the same prompt still hits."""
    monkeypatch.setattr(prefix_cache, "chain_digest", lambda parent, tokens: 0)
    sched = scheduler(64, caching=True)
    victim = list(range(10, 10 + 3 * BLOCK + 1))
    run_with_cache(sched, [Request("victim", victim, GenerationParams(max_new_tokens=1), 0.0)])
    assert sched.blocks.num_cached == 1  # its first block; the next ones collide with it
    attacker = list(range(500, 500 + 3 * BLOCK + 1))
    sched.add(Request("attacker", attacker, GenerationParams(max_new_tokens=1), 1.0))
    (chunk,) = sched.schedule().chunks
    assert chunk.num_computed == 0 and chunk.token_ids == tuple(attacker)
    assert not set(chunk.block_ids) & set(first_blocks(sched, victim))
    sched.abort("attacker")
    sched.add(Request("again", victim, GenerationParams(max_new_tokens=1), 2.0))
    (chunk,) = sched.schedule().chunks
    assert chunk.num_computed == BLOCK
    sched.check_invariants()


def test_a_collision_in_the_parent_chain_is_no_hit(monkeypatch):
    """A digest of a block's own tokens alone (its parent left out): two chains that differ in
    their first block and agree in the second get one digest there; the second chain takes its
    own first block from the cache, but not the first chain's second one (its K/V follow other
    tokens)."""
    monkeypatch.setattr(prefix_cache, "chain_digest", lambda parent, tokens: hash(tokens))
    blocks = BlockManager(8, BLOCK, enable_prefix_caching=True)
    tail = [7] * BLOCK
    for request_id, head in (("a", [1] * BLOCK), ("b", [2] * BLOCK)):
        request = Request(request_id, head + tail + [0], GenerationParams(), 0.0)
        blocks.grow(request, request.num_tokens)
        request.num_computed_tokens = request.num_tokens
        blocks.cache_full_blocks(request)
        blocks.free(request)
    probe = Request("c", [2] * BLOCK + tail + [0], GenerationParams(), 0.0)
    blocks.reuse_cached_prefix(probe)
    assert probe.num_computed_tokens == BLOCK  # "b"'s first block, and no more
    blocks.check_invariants([probe])


def test_an_adapters_blocks_follow_its_weights_and_leave_with_it():
    """Blocks computed through one set of an adapter's weights are not reused through
    another set under the same name; an adapter whose weights are not loaded neither takes
    nor gives blocks; forgetting an adapter drops its cached blocks only."""
    prompt = list(range(10, 10 + 4 * BLOCK + 2))
    digests: dict[str, str | None] = {"sql": "weights-1"}
    sched = Scheduler(BlockManager(64, BLOCK, True), 4, 16, 96, adapter_weights=digests.get)

    def computed_from_cache(request_id: str, adapter: str | None) -> int:
        params = GenerationParams(max_new_tokens=1, adapter=adapter)
        sched.add(Request(request_id, prompt, params, 1.0))
        (chunk,) = sched.schedule().chunks
        sched.abort(request_id)
        return chunk.num_computed // BLOCK

    run_with_cache(sched, [Request("a", prompt, GenerationParams(1, adapter="sql"), 0.0)])
    run_with_cache(sched, [Request("base", prompt, GenerationParams(max_new_tokens=1), 0.0)])
    assert computed_from_cache("same", "sql") == 4
    digests["sql"] = "weights-2"  # registered again with other weights, or read again changed
    assert computed_from_cache("changed", "sql") == 0
    digests["sql"] = None  # to be read in the step: what it will hold is unknown
    assert computed_from_cache("unknown", "sql") == 0
    before = sched.blocks.num_cached
    run_with_cache(sched, [Request("c", prompt, GenerationParams(1, adapter="sql"), 2.0)])
    assert sched.blocks.num_cached == before  # gave nothing either
    digests["sql"] = "weights-1"
    sched.blocks.forget_adapter("sql")
    assert computed_from_cache("after", "sql") == 0
    assert computed_from_cache("base-after", None) == 4  # the base model's blocks stay
    assert sched.blocks.num_free == 64
    sched.check_invariants()


def test_blocks_left_under_an_evicted_parent_give_their_place_up():
    """B prefills beside A and hangs its later blocks under A's equal ones; A's are evicted
    while B runs. B's later entries are then unreachable, and must not keep the next request
    with B's prompt from caching its own: a third request finds all of them."""
    blocks = BlockManager(10, 2, enable_prefix_caching=True)

    def computed(request_id: str, tokens: list[int], reuse: bool = True) -> Request:
        request = Request(request_id, tokens, GenerationParams(), 0.0)
        if reuse:
            blocks.reuse_cached_prefix(request)
        blocks.grow(request, request.num_tokens)
        request.num_computed_tokens = request.num_tokens
        blocks.cache_full_blocks(request)
        return request

    a = computed("a", [1, 2, 3, 4, 9])
    b = computed("b", [1, 2, 3, 4, 5, 6, 7, 8, 11], reuse=False)  # they prefilled together
    blocks.free(a)
    taker = Request("taker", [0] * 10, GenerationParams(), 0.0)
    blocks.grow(taker, 10)  # every free block: A's cached ones evicted
    blocks.check_invariants([b, taker])
    blocks.free(taker)
    blocks.free(b)
    again = computed("again", list(b.prompt_ids))
    assert again.block_ids and again.num_computed_tokens == 9
    blocks.free(again)
    probe = Request("probe", list(b.prompt_ids), GenerationParams(), 0.0)
    blocks.reuse_cached_prefix(probe)
    assert probe.num_computed_tokens == 8  # all four full blocks before the last token
    blocks.check_invariants([probe])
