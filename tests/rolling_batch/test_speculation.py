"""Speculative decoding with n-gram drafts, torch-free: the drafter's lookups, and the scheduler
running a fake model that repeats itself at times, its drafts checked the way the engine checks
them. Outputs equal decoding without drafts token for token, in fewer steps; every chunk attends
over exactly its sequence's tokens (rejected draft tokens in the cache are written over before
anyone reads them); invariants hold after every step, with prefix caching, a pool small enough
to preempt, and EOS inside a kept draft."""

from __future__ import annotations

import random

import pytest

from lmserve.rolling_batch.core.block_manager import BlockManager
from lmserve.rolling_batch.core.request import Request
from lmserve.rolling_batch.core.scheduler import Scheduler
from lmserve.rolling_batch.core.speculation import NgramDrafter, accepted_prefix
from lmserve.rolling_batch.core.step import Sample
from lmserve.rolling_batch.ipc.protocol import GenerationParams

from .test_prefix_caching import BLOCK, SimulatedCache
from .test_scheduler import EOS, fake_next_token, fresh


def looping_next_token(tokens: list[int]) -> int:
    """A 'model' that mostly repeats what it said a few tokens back and now and then says
    something new (or EOS), so drafts are sometimes right, sometimes wrong."""
    new = fake_next_token(tokens)
    if new % 11 == 0:
        return EOS
    if new % 5 == 0 or len(tokens) < 4:
        return new
    return tokens[-(2 + new % 3)]


def request(rid: str, prompt: list[int], max_new: int = 20, **params) -> Request:
    params.setdefault("ignore_eos", True)
    return Request(rid, prompt, GenerationParams(max_new_tokens=max_new, **params), 0.0)


def greedy_outputs(requests) -> dict[str, list[int]]:
    outputs = {}
    for r in requests:
        tokens = list(r.prompt_ids)
        for _ in range(r.params.max_new_tokens):
            tokens.append(looping_next_token(tokens))
            if tokens[-1] == EOS and not r.params.ignore_eos:
                break
        outputs[r.request_id] = tokens[len(r.prompt_ids) :]
    return outputs


def run(scheduler: Scheduler, requests, on_step=None) -> tuple[dict, int]:
    """Runs `requests` (two arriving a step) as the engine does: the model's choice after
    every row that has logits, a draft kept up to its first wrong token. Checks every chunk's
    context and the invariants. Returns the outputs and the number of steps."""
    cache = SimulatedCache()
    pending, steps = list(requests), 0
    events: dict[str, list[int]] = {r.request_id: [] for r in requests}
    while pending or scheduler.has_work():
        for _ in range(2):
            if pending:
                scheduler.add(pending.pop(0))
        out = scheduler.schedule()
        budgeted = 0  # prompt tokens and drafts share the prefill budget
        for r, chunk in zip(out.requests, out.chunks):
            assert (
                cache.context(chunk.block_ids, chunk.num_computed)
                == (r.all_token_ids[: chunk.num_computed])
            )
            budgeted += len(chunk.token_ids) if r.is_prefilling else chunk.num_drafts
            # Never more drafts than tokens left to generate after the step's own.
            assert chunk.num_drafts <= r.params.max_new_tokens - len(r.output_ids) - 1
        assert budgeted <= scheduler.max_prefill_tokens
        cache.step(out.chunks)
        plain, _, drafts, _ = out.logit_rows()
        sampled: dict = {r: Sample(looping_next_token(r.all_token_ids), -0.5) for r in plain}
        for r, draft in drafts:
            tokens = r.all_token_ids
            chosen = [looping_next_token(tokens + list(draft[:i])) for i in range(len(draft) + 1)]
            kept = accepted_prefix(draft, chosen)
            sampled[r] = [Sample(token, -0.5) for token in chosen[: kept + 1]]
        if on_step is not None:
            on_step(out)
        for r, samples in scheduler.update(out, sampled, {EOS}):
            events[r.request_id] += [sample.token for sample in samples]
        scheduler.check_invariants()
        steps += 1
        assert steps < 20_000, "the scheduler stopped making progress"
    outputs = {r.request_id: list(r.output_ids) for r in requests}
    assert events == outputs  # what the engine sends on: each token once, none past the end
    return outputs, steps


def random_requests(count: int, seed: int) -> list[Request]:
    rng = random.Random(seed)
    return [
        request(
            f"r{i}",
            [rng.randrange(3, 1000) for _ in range(rng.randrange(1, 30))],
            rng.randrange(1, 40),
            ignore_eos=rng.random() < 0.5,
        )
        for i in range(count)
    ]


def scheduler(
    num_blocks=200, drafts=4, caching=False, max_rolling_batch_size=6, budget=24, max_len=96
):
    drafter = NgramDrafter(drafts) if drafts else None
    return Scheduler(
        BlockManager(num_blocks, BLOCK, caching),
        max_rolling_batch_size,
        budget,
        max_len,
        drafter=drafter,
    )


# The drafter


def test_a_draft_continues_the_latest_earlier_occurrence_of_the_longest_match():
    drafter = NgramDrafter(max_draft=3)
    # "7 8" occurred twice before; its latest occurrence went on "9 4", the earlier "1 2".
    r = request("a", [7, 8, 1, 2, 5, 7, 8, 9, 4, 6, 7, 8])
    assert drafter.propose(r, limit=3) == (9, 4, 6)
    # With a longer match available the longest wins: "4 7 8" occurred once, before "5".
    r = request("b", [4, 7, 8, 5, 3, 7, 8, 6, 4, 7, 8])
    assert drafter.propose(r, limit=1) == (5,)


def test_a_loop_is_drafted_past_the_end_of_the_text():
    drafter = NgramDrafter(max_draft=5)
    r = request("loop", [3, 5, 6, 5, 6])
    assert drafter.propose(r, limit=5) == (5, 6, 5, 6, 5)


def test_no_earlier_occurrence_no_draft_and_the_index_follows_new_tokens():
    drafter = NgramDrafter(max_draft=4)
    r = request("fresh", [10, 11, 12])
    assert drafter.propose(r, limit=4) == ()
    r.output_ids += [10, 11]  # now "10 11" occurred before
    assert drafter.propose(r, limit=4) == (12, 10, 11, 12)
    assert drafter.propose(r, limit=2) == (12, 10)
    assert drafter.propose(r, limit=0) == ()


def test_the_draft_length_grows_after_a_full_hit_and_shrinks_after_a_miss():
    drafter = NgramDrafter(max_draft=5)
    r = request("loop", [1, 2, 1, 2, 1, 2])
    assert len(drafter.propose(r, limit=9)) == 5
    drafter.record(r, 5, 2)
    assert len(drafter.propose(r, limit=9)) == 4
    for _ in range(5):
        drafter.record(r, 4, 0)
    assert len(drafter.propose(r, limit=9)) == 1  # never below one
    drafter.record(r, 1, 1)
    assert len(drafter.propose(r, limit=9)) == 3
    assert (drafter.num_drafted, drafter.num_accepted) == (5 + 4 * 5 + 1, 3)


def test_drafts_kept_rarely_are_held_back_from_big_steps_until_their_guesses_come_true():
    drafter = NgramDrafter(max_draft=4)
    r = request("loop", [1, 2, 1, 2, 1, 2])
    assert drafter.propose(r, limit=4, step_rows=64)  # hopeful at first
    for _ in range(4):
        drafter.record(r, 4, 1)  # a quarter kept
    assert drafter.propose(r, limit=4, step_rows=64) == ()  # needs two thirds at 64 rows
    assert drafter.propose(r, limit=4, step_rows=4)  # an eighth at 4 rows
    assert drafter.propose(r, limit=4, step_rows=64) == ()  # held back: its guess, 1, ...
    drafter.observe(r, 5)  # ... was wrong
    for step in range(3):
        assert drafter.propose(r, limit=4, step_rows=64) == ()
        drafter.observe(r, 1)  # right
        if step == 0:
            drafter.observe(r, 1)  # nothing held back since: not scored
    # Worth drafting again, one token: the misses shrank its length.
    assert drafter.propose(r, limit=4, step_rows=64) == (1,)


def test_accepted_prefix_stops_at_the_first_disagreement():
    assert accepted_prefix((4, 5, 6), [4, 5, 9, 1]) == 2
    assert accepted_prefix((4, 5, 6), [4, 5, 6, 1]) == 3
    assert accepted_prefix((4,), [3, 4]) == 0
    assert accepted_prefix((), [3]) == 0


# The scheduler with drafts


@pytest.mark.parametrize("seed", range(6))
def test_drafts_change_no_output_and_save_steps(seed):
    requests = random_requests(30, seed)
    plain_outputs, plain_steps = run(scheduler(drafts=0), fresh(requests))
    speculating = scheduler()
    outputs, steps = run(speculating, fresh(requests))
    assert outputs == plain_outputs == greedy_outputs(requests)
    drafter = speculating.drafter
    assert drafter.num_accepted > 0 and drafter.num_drafted > drafter.num_accepted
    assert steps < plain_steps
    assert speculating.blocks.num_free == 200


@pytest.mark.parametrize("seed", range(4))
def test_with_prefix_caching_and_a_tight_pool_drafts_change_no_output(seed):
    requests = random_requests(30, seed)
    for i, r in enumerate(requests[1:], 1):  # shared prefixes: half repeat an earlier prompt
        if i % 2:
            r.prompt_ids = list(requests[i - 1].prompt_ids) + r.prompt_ids[:3]
    tight = scheduler(num_blocks=24, caching=True)
    outputs, _ = run(tight, fresh(requests))
    assert outputs == greedy_outputs(requests)
    assert tight.num_preemptions > 0 and tight.num_prefix_hit_tokens > 0
    assert tight.drafter.num_accepted > 0


def test_eos_inside_a_kept_draft_ends_the_request_there():
    sched = scheduler()
    r = request("e", [5, EOS, 7, 3], max_new=20, ignore_eos=False)
    sched.add(r)
    sched.update(sched.schedule(), {r: Sample(5, -0.1)}, {EOS})
    out = sched.schedule()
    assert out.chunks[0].token_ids == (5, EOS, 7, 3, 5)  # "5" was followed by EOS before
    agreed = [Sample(token, -0.2) for token in (EOS, 7, 3, 5, 8)]
    produced = sched.update(out, {r: agreed}, {EOS})
    assert produced == [(r, agreed[:1])]  # nothing after the EOS reaches the client
    assert r.output_ids == [5, EOS] and r.finish_reason == "eos_token"
    assert sched.blocks.num_free == 200 and not sched.has_work()
    sched.check_invariants()


@pytest.mark.parametrize("seed", range(3))
def test_outputs_ending_in_eos_are_the_same_with_drafts(seed):
    requests = random_requests(30, seed)
    for r in requests:  # EOS in the prompts: drafts may carry it
        r.prompt_ids[::4] = [EOS] * len(r.prompt_ids[::4])
    outputs, _ = run(scheduler(), fresh(requests))
    assert outputs == greedy_outputs(requests)
    assert any(out[-1] == EOS for out in outputs.values())


def test_drafts_respect_max_new_tokens_and_the_model_length():
    looping = [5, 6] * 6
    near_end = request("len", looping, max_new=40)
    short = request("new", looping, max_new=3)
    drafted = []
    sched = scheduler(max_len=16)
    outputs, _ = run(sched, [near_end, short], on_step=lambda out: drafted.append(out.chunks))
    assert len(outputs["new"]) == 3
    assert len(near_end.all_token_ids) == 16  # stopped by the model length, nothing past it
    for chunks in drafted:
        for chunk in chunks:
            assert chunk.num_computed + len(chunk.token_ids) <= 16


def test_prompts_keep_their_prefill_budget_and_drafts_take_what_is_left():
    sched = scheduler(budget=10)
    decoding = request("d", [5, 6] * 4, max_new=50)
    sched.add(decoding)
    out = sched.schedule()  # its prompt
    sched.update(out, {decoding: Sample(5, 0.0)}, {EOS})
    sched.add(request("p", list(range(100, 108))))
    seen_rows, propose = [], sched.drafter.propose
    sched.drafter.propose = lambda r, limit, rows: seen_rows.append(rows) or propose(r, limit, rows)
    out = sched.schedule()
    chunks = dict(zip([r.request_id for r in out.requests], out.chunks))
    assert len(chunks["p"].token_ids) == 8  # the whole prompt, as without drafts
    assert chunks["d"].num_drafts == 2  # the 2 tokens the budget had left
    assert chunks["d"].token_ids == (5, 6, 5)
    # The drafter was told the step's size (a decode row and the prompt's 8), which decides
    # how often drafts must be kept to pay.
    assert seen_rows == [1 + 8]


def test_sampled_and_penalized_requests_do_not_speculate():
    sched = scheduler()
    loop = [5, 6] * 4
    rows = [
        request("sampled", loop, do_sample=True, seed=1),
        request("penalized", loop, repetition_penalty=1.2),
        request("greedy", loop),
    ]
    for r in rows:
        sched.add(r)
    out = sched.schedule()
    sched.update(out, {r: Sample(5, 0.0) for r in rows}, {EOS})
    out = sched.schedule()
    drafts = {r.request_id: c.num_drafts for r, c in zip(out.requests, out.chunks)}
    assert drafts == {"sampled": 0, "penalized": 0, "greedy": 4}


def test_finished_and_aborted_requests_leave_the_drafter():
    sched = scheduler()
    done = request("done", [5, 6] * 4, max_new=2)
    gone = request("gone", [7, 8] * 4, max_new=20)
    run(sched, [done])
    sched.add(gone)
    out = sched.schedule()
    sched.update(out, {gone: Sample(7, 0.0)}, {EOS})
    sched.schedule()
    sched.abort("gone")
    assert sched.drafter._lookups == {}
