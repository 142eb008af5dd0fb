"""The rolling scheduler with a fake model (no torch): the prefill budget and the batch size
hold every step, long prompts are chunked while decodes run, a tiny block pool forces
preemptions that change no output, aborts free blocks at once. Every test ends with
check_invariants()."""

from __future__ import annotations

import random
from typing import NamedTuple

from lmserve.rolling_batch.core.block_manager import BlockManager
from lmserve.rolling_batch.core.request import Request
from lmserve.rolling_batch.core.scheduler import Scheduler
from lmserve.rolling_batch.core.step import Sample
from lmserve.rolling_batch.ipc.protocol import GenerationParams

EOS = 2


def fake_next_token(tokens: list[int]) -> int:
    """A deterministic 'model': the next token depends on the whole sequence."""
    return 3 + (sum(t * (i + 1) for i, t in enumerate(tokens)) * 31) % 997


def make_requests(count: int, seed: int = 0, max_new: tuple[int, int] = (1, 40)):
    rng = random.Random(seed)
    return [
        Request(
            f"r{i}",
            [rng.randrange(3, 1000) for _ in range(rng.randrange(1, 70))],
            GenerationParams(max_new_tokens=rng.randrange(*max_new), ignore_eos=True),
            arrival_time=float(i),
        )
        for i in range(count)
    ]


def run(scheduler: Scheduler, requests, on_step=None, arrivals_per_step: int = 3) -> dict:
    pending = list(requests)
    steps = 0
    while pending or scheduler.has_work():
        for _ in range(arrivals_per_step):  # requests keep arriving while others run
            if pending:
                scheduler.add(pending.pop(0))
        out = scheduler.schedule()
        sampled = {r: Sample(fake_next_token(r.all_token_ids), -0.5) for r in out.sampling}
        if on_step is not None:
            on_step(out)
        scheduler.update(out, sampled, {EOS})
        scheduler.check_invariants()
        steps += 1
        assert steps < 10_000, "the scheduler stopped making progress"
    return {r.request_id: list(r.output_ids) for r in requests}


def expected_outputs(requests) -> dict:
    outputs = {}
    for request in requests:
        tokens = list(request.prompt_ids)
        for _ in range(request.params.max_new_tokens):
            tokens.append(fake_next_token(tokens))
        outputs[request.request_id] = tokens[len(request.prompt_ids) :]
    return outputs


def fresh(requests):
    return [Request(r.request_id, list(r.prompt_ids), r.params, r.arrival_time) for r in requests]


def test_budget_and_batch_size_hold_every_step_and_outputs_are_right():
    requests = make_requests(30)
    scheduler = Scheduler(
        BlockManager(200, 16), max_rolling_batch_size=8, max_prefill_tokens=64, max_model_len=512
    )
    seen_batch_sizes = set()

    def check(out):
        prefill = sum(
            len(c.token_ids)
            for r, c in zip(out.requests, out.chunks)
            if len(c.token_ids) > 1 or c.num_computed < len(r.prompt_ids)
        )
        assert prefill <= 64
        assert len(out.requests) <= 8
        seen_batch_sizes.add(len(out.requests))

    assert run(scheduler, requests, check) == expected_outputs(requests)
    assert max(seen_batch_sizes) == 8
    assert scheduler.blocks.num_free == 200


def test_long_prompt_is_chunked_while_decodes_keep_running():
    short = make_requests(3, seed=1, max_new=(30, 31))
    long = Request(
        "long", list(range(3, 203)), GenerationParams(max_new_tokens=5, ignore_eos=True), 9.0
    )
    scheduler = Scheduler(
        BlockManager(100, 16), max_rolling_batch_size=8, max_prefill_tokens=48, max_model_len=512
    )
    mixed_steps = []

    def check(out):
        chunks = dict(zip((r.request_id for r in out.requests), out.chunks))
        if "long" in chunks and len(chunks["long"].token_ids) > 1:
            decodes = [c for rid, c in chunks.items() if rid != "long" and len(c.token_ids) == 1]
            mixed_steps.append(len(decodes))
            assert len(chunks["long"].token_ids) <= 48

    outputs = run(scheduler, short + [long], check, arrivals_per_step=4)
    assert outputs == expected_outputs(short + [long])
    assert len(mixed_steps) >= 200 // 48  # the prompt took several steps...
    assert sum(mixed_steps) > 0  # ...during which the short requests kept decoding


def test_tiny_block_pool_preempts_and_changes_no_output():
    requests = make_requests(12, seed=2, max_new=(20, 60))
    roomy = Scheduler(
        BlockManager(500, 4), max_rolling_batch_size=6, max_prefill_tokens=128, max_model_len=160
    )
    tight = Scheduler(
        BlockManager(40, 4), max_rolling_batch_size=6, max_prefill_tokens=128, max_model_len=160
    )
    assert run(tight, fresh(requests)) == run(roomy, fresh(requests)) == expected_outputs(requests)
    assert tight.num_preemptions > 0 and roomy.num_preemptions == 0
    assert tight.blocks.num_free == 40


def test_paged_off_holds_one_max_length_block_per_request():
    requests = make_requests(10, seed=3)
    # Three blocks of max_model_len: at most three requests in flight whatever
    # max_rolling_batch_size says.
    scheduler = Scheduler(
        BlockManager(3, 128), max_rolling_batch_size=8, max_prefill_tokens=256, max_model_len=128
    )

    def check(out):
        assert len(scheduler.running) <= 3
        assert all(len(r.block_ids) == 1 for r in scheduler.running)

    assert run(scheduler, requests, check) == expected_outputs(requests)


def test_abort_frees_blocks_at_once_wherever_the_request_is():
    scheduler = Scheduler(
        BlockManager(20, 4), max_rolling_batch_size=1, max_prefill_tokens=64, max_model_len=64
    )
    running, queued = make_requests(2, seed=4, max_new=(30, 31))
    scheduler.add(running)
    scheduler.add(queued)
    out = scheduler.schedule()
    scheduler.update(out, dict.fromkeys(out.sampling, Sample(7, -1.0)), {EOS})
    assert running.block_ids and scheduler.blocks.num_free < 20
    assert scheduler.abort("r1").finish_reason == "abort"  # still waiting
    assert scheduler.abort("r0") is running and running.block_ids == []
    assert scheduler.blocks.num_free == 20 and not scheduler.has_work()
    assert scheduler.abort("r0") is None
    scheduler.check_invariants()


def test_eos_ends_a_request_unless_ignored():
    scheduler = Scheduler(
        BlockManager(20, 4), max_rolling_batch_size=4, max_prefill_tokens=64, max_model_len=64
    )
    stops = Request("stops", [5, 6], GenerationParams(max_new_tokens=10), 0.0)
    ignores = Request("ignores", [5, 6], GenerationParams(max_new_tokens=3, ignore_eos=True), 0.0)
    scheduler.add(stops)
    scheduler.add(ignores)
    while scheduler.has_work():
        out = scheduler.schedule()
        scheduler.update(out, dict.fromkeys(out.sampling, Sample(EOS, -0.1)), {EOS})
        scheduler.check_invariants()
    assert stops.output_ids == [EOS] and stops.finish_reason == "eos_token"
    assert ignores.output_ids == [EOS] * 3 and ignores.finish_reason == "length"


def test_prompt_scoring_covers_each_prompt_position_once_across_chunks_and_preemption():
    """A prompt that asked for its log-probs: its chunks ask for positions 0..n-2 scored
    against the next prompt token, each position once, even when a preemption recomputes it."""
    scheduler = Scheduler(BlockManager(num_blocks=12, block_size=4), 4, 16, 256)
    prompt = list(range(100, 140))
    scored = Request("scored", prompt, GenerationParams(max_new_tokens=8, prompt_logprobs=True), 0)
    others = [Request(f"o{i}", [1, 2, 3], GenerationParams(max_new_tokens=30), 0) for i in range(3)]
    for request in [*others, scored]:
        scheduler.add(request)
    targets: list[int] = []
    while scheduler.has_work():
        out = scheduler.schedule()
        scores = {}
        for index, (request, chunk) in enumerate(zip(out.requests, out.chunks)):
            if chunk.score_targets:
                assert request is scored
                start = chunk.num_computed + chunk.score_from
                assert start == len(targets)  # in order, never again
                targets += chunk.score_targets
                scores[index] = PromptScoresLike([-1.0] * len(chunk.score_targets), None)
        scheduler.record_prompt_scores(out, scores)
        sampled = {r: Sample(fake_next_token(r.all_token_ids), -0.5) for r in out.sampling}
        scheduler.update(out, sampled, {EOS})
        scheduler.check_invariants()
    assert scheduler.num_preemptions > 0 and scored.num_preemptions > 0
    assert targets == prompt[1:] and len(scored.prompt_log_probs) == len(prompt) - 1


class PromptScoresLike(NamedTuple):
    log_probs: list[float]
    top_logprobs: list | None


def test_at_most_max_loras_adapters_run_and_the_others_wait_their_turn():
    """Three adapters, two slots: a request whose adapter finds no slot waits (requests behind
    it for running adapters or the base model go first), joins when an adapter leaves, and
    every output is still right. Each step's sequences of one adapter sit side by side."""
    adapters = ["a", "b", "c", None, "a", "c", "b", None]
    requests = [
        Request(f"r{i}", [5 + i] * 6, GenerationParams(max_new_tokens=3 + i, adapter=adapter), i)
        for i, adapter in enumerate(adapters)
    ]
    scheduler = Scheduler(
        BlockManager(64, 16),
        max_rolling_batch_size=8,
        max_prefill_tokens=512,
        max_model_len=256,
        max_loras=2,
    )
    seen_together = []

    def check(out):
        running = {r.params.adapter for r in scheduler.running} - {None}
        assert len(running) <= 2
        seen_together.append({r.request_id for r in out.requests})
        # One run of chunks an adapter (the model computes a LoRA segment a run).
        order = [chunk.adapter for chunk in out.chunks]
        runs = [adapter for i, adapter in enumerate(order) if i == 0 or order[i - 1] != adapter]
        assert len(runs) == len(set(runs)), order
        assert [r.params.adapter for r in out.requests] == order

    outputs = run(scheduler, requests, on_step=check, arrivals_per_step=8)
    assert outputs == expected_outputs(fresh(requests))
    first = seen_together[0]
    assert {"r0", "r1", "r3", "r4", "r6", "r7"} == first  # c (r2, r5) waits; b and None pass it
    assert any("r2" in step for step in seen_together)


def _prompt(request_id: str, length: int, arrival: float) -> Request:
    params = GenerationParams(max_new_tokens=3, ignore_eos=True)
    return Request(request_id, list(range(3, 3 + length)), params, arrival)


def _prefill_scheduler(max_prefill_tokens: int, shortest_first: bool) -> Scheduler:
    return Scheduler(
        BlockManager(200, 16),
        max_rolling_batch_size=8,
        max_prefill_tokens=max_prefill_tokens,
        max_model_len=512,
        shortest_first=shortest_first,
    )


def _first_token_steps(scheduler: Scheduler, arrivals: list[list[Request]]) -> dict[str, int]:
    """Runs `arrivals[k]` added before step k; the step at which each request got its first
    token."""
    first: dict[str, int] = {}
    step = 0
    while step < len(arrivals) or scheduler.has_work():
        for request in arrivals[step] if step < len(arrivals) else []:
            scheduler.add(request)
        out = scheduler.schedule()
        sampled = {r: Sample(fake_next_token(r.all_token_ids), -0.5) for r in out.sampling}
        scheduler.update(out, sampled, {EOS})
        scheduler.check_invariants()
        for request in sampled:
            first.setdefault(request.request_id, step)
        step += 1
    return first


def test_shortest_first_prefills_a_burst_short_prompts_first_and_lowers_the_median_wait():
    lengths = [200, 30, 120, 10, 250, 60, 90, 20]
    runs = {}
    for shortest_first in (False, True):
        burst = [_prompt(f"p{i}", n, float(i)) for i, n in enumerate(lengths)]
        scheduler = _prefill_scheduler(120, shortest_first)
        runs[shortest_first] = _first_token_steps(scheduler, [burst])
    arrival_order, shortest = runs[False], runs[True]
    # Arrival order: the 200-token prompt takes the first step's 120 tokens for itself.
    assert arrival_order["p0"] <= arrival_order["p1"] < arrival_order["p3"]
    # Shortest first: 10, 20, 30 and 60 tokens fill the first step's 120 together.
    assert shortest["p3"] == shortest["p7"] == shortest["p1"] == shortest["p5"] == 0
    by_length = sorted(range(len(lengths)), key=lambda i: lengths[i])
    steps = [shortest[f"p{i}"] for i in by_length]
    assert steps == sorted(steps)
    median = len(lengths) // 2
    assert sorted(shortest.values())[median] < sorted(arrival_order.values())[median]


def test_shortest_first_never_puts_a_later_arrival_before_an_earlier_one():
    early = [_prompt("early-long", 150, 0.0), _prompt("early-mid", 80, 0.1)]
    late = [_prompt("late-short", 5, 1.0)]
    first = _first_token_steps(_prefill_scheduler(64, shortest_first=True), [early, late])
    # The early pair arrived together (the shorter first), the short one a step later: it
    # waits for both, however short.
    assert first["early-mid"] < first["early-long"] <= first["late-short"]
