"""Dynamic batching decisions, with a fake clock: full batches go at once, partial batches after
max_batch_delay, different parameters never share a batch, the oldest group goes first."""

from __future__ import annotations

from lmserve.handlers.python_engine.dynamic_batcher import DynamicBatcher, PendingRequest
from lmserve.rolling_batch.ipc.protocol import GenerationParams

GREEDY = GenerationParams()
SAMPLED = GenerationParams(do_sample=True, temperature=0.7, seed=1)


def request(request_id: str, at: float, params: GenerationParams = GREEDY) -> PendingRequest:
    return PendingRequest(request_id, b"client", None, params.batch_key(), at)


def ids(batch: list[PendingRequest]) -> list[str]:
    return [r.request_id for r in batch]


def test_a_full_batch_is_due_at_once():
    batcher = DynamicBatcher(batch_size=2, max_batch_delay_s=0.1)
    batcher.add(request("a", 0.0))
    assert batcher.next_batch(0.0) == []
    batcher.add(request("b", 0.01))
    assert batcher.seconds_until_due(0.01) == 0.0
    assert ids(batcher.next_batch(0.01)) == ["a", "b"]
    assert batcher.num_queued == 0
    assert batcher.seconds_until_due(0.02) is None


def test_a_partial_batch_waits_for_max_batch_delay():
    batcher = DynamicBatcher(batch_size=4, max_batch_delay_s=0.1)
    batcher.add(request("a", 0.0))
    batcher.add(request("b", 0.05))
    assert abs(batcher.seconds_until_due(0.05) - 0.05) < 1e-9
    assert batcher.next_batch(0.09) == []
    assert ids(batcher.next_batch(0.1)) == ["a", "b"]


def test_batches_never_exceed_batch_size_and_keep_arrival_order():
    batcher = DynamicBatcher(batch_size=3, max_batch_delay_s=0.1)
    for index in range(7):
        batcher.add(request(str(index), index * 0.001))
    assert ids(batcher.next_batch(0.01)) == ["0", "1", "2"]
    assert ids(batcher.next_batch(0.01)) == ["3", "4", "5"]
    assert batcher.next_batch(0.01) == []  # "6" alone waits out its delay
    assert ids(batcher.next_batch(0.2)) == ["6"]


def test_different_parameters_are_grouped_not_mixed():
    batcher = DynamicBatcher(batch_size=4, max_batch_delay_s=0.1)
    batcher.add(request("g1", 0.0))
    batcher.add(request("s1", 0.01, SAMPLED))
    batcher.add(request("g2", 0.02, GenerationParams(max_new_tokens=99)))  # length may differ
    batcher.add(request("s2", 0.03, SAMPLED))
    first = batcher.next_batch(0.2)
    second = batcher.next_batch(0.2)
    assert ids(first) == ["g1", "g2"]  # the group holding the oldest request goes first
    assert ids(second) == ["s1", "s2"]


def test_greedy_requests_batch_together_whatever_their_sampling_knobs():
    a = GenerationParams(temperature=0.3)
    b = GenerationParams(top_p=0.5, top_k=3)
    assert a.batch_key() == b.batch_key()
    assert (
        GenerationParams(do_sample=True, seed=1).batch_key()
        != GenerationParams(do_sample=True, seed=2).batch_key()
    )


def test_queue_count_and_removal():
    batcher = DynamicBatcher(batch_size=4, max_batch_delay_s=0.1)
    batcher.add(request("a", 0.0))
    batcher.add(request("b", 0.0))
    assert batcher.num_queued == 2
    assert batcher.remove("a").request_id == "a"
    assert batcher.remove("a") is None
    assert batcher.num_queued == 1
    assert ids(batcher.next_batch(1.0)) == ["b"]
    assert batcher.remove("b") is None


def test_requests_waiting_too_long_are_taken_out():
    batcher = DynamicBatcher(batch_size=4, max_batch_delay_s=10.0)
    batcher.add(request("old", 0.0))
    batcher.add(request("sampled", 0.5, SAMPLED))
    batcher.add(request("new", 5.0))
    assert ids(batcher.pop_expired(arrived_before=1.0)) == ["old", "sampled"]
    assert batcher.num_queued == 1
    assert ids(batcher.next_batch(20.0)) == ["new"]
