"""The rolling engine's loop with a fake model over real ZeroMQ sockets: every request gets its
tokens and one final event, in one frame per web worker per step (a request that is not
streamed in its final event alone), each step's time is split into phases for /metrics and
the log, and a stats request is answered between steps. A malformed request (garbage, a
generate with wrong types) is dropped with an error answer where its id is readable, and the
engine goes on serving."""

from __future__ import annotations

import json
import logging
import math
import time
import uuid

import pytest
import torch
import zmq
from msgspec.msgpack import encode as pack

from lmserve.rolling_batch.core.block_manager import BlockManager
from lmserve.rolling_batch.core.scheduler import Scheduler
from lmserve.rolling_batch.core.speculation import NgramDrafter
from lmserve.rolling_batch.engine import rolling_core
from lmserve.rolling_batch.engine.rolling_core import RollingBatchCore
from lmserve.rolling_batch.engine.sampler import Sampler
from lmserve.rolling_batch.engine.shell import EngineShell
from lmserve.rolling_batch.engine.stats import PHASES, PhaseTimer, StepProfile, StepTrace
from lmserve.rolling_batch.ipc import protocol
from lmserve.rolling_batch.ipc.protocol import GenerationParams
from lmserve.rolling_batch.model.runner import PromptScores, StepLogits

VOCAB = 64


def fake_logits(tokens) -> torch.Tensor:
    """Logits whose argmax is (token + 1) % VOCAB after each token: a predictable greedy
    'model'."""
    logits = torch.zeros(len(tokens), VOCAB)
    for row, token in enumerate(tokens):
        logits[row, (token + 1) % VOCAB] = 5.0
    return logits


def fake_execute(chunks) -> StepLogits:
    # The rows that need logits: a chunk's last token, and its drafted ones.
    last_tokens = [t for c in chunks for t in c.token_ids[len(c.token_ids) - c.num_logits :]]
    scores = {}
    for index, chunk in enumerate(chunks):
        if chunk.score_targets:
            rows = chunk.token_ids[chunk.score_from : chunk.score_from + len(chunk.score_targets)]
            log_probs = torch.log_softmax(fake_logits(rows), dim=-1)
            targets = torch.tensor(chunk.score_targets)
            scores[index] = PromptScores(log_probs.gather(1, targets[:, None])[:, 0].tolist(), None)
    # argmax_only chunks: the greedy token alone, as a model's GreedyHead picks it
    greedy = tuple((c.token_ids[-1] + 1) % VOCAB for c in chunks if c.num_argmax)
    return StepLogits(fake_logits(last_tokens), scores, greedy)


@pytest.fixture
def sockets():
    context = zmq.Context.instance()
    address = f"inproc://engine-{uuid.uuid4().hex}"
    router = context.socket(zmq.ROUTER)
    router.bind(address)
    dealers = []

    def connect() -> zmq.Socket:
        dealer = context.socket(zmq.DEALER)
        dealer.connect(address)
        dealers.append(dealer)
        return dealer

    yield router, connect
    for socket in [router, *dealers]:
        socket.close(linger=0)


def rolling_engine(execute, scheduler, router, slot_timeout_s=None, world_size=1) -> EngineShell:
    """The engine shell around the rolling batch, EOS token 0, at most 100 requests waiting."""
    core = RollingBatchCore(
        execute, scheduler, Sampler(torch.device("cpu")), {0}, world_size=world_size
    )
    return EngineShell(core, router, 100, slot_timeout_s)


def make_engine(router, drafter=None, argmax_head=False) -> EngineShell:
    scheduler = Scheduler(
        BlockManager(64, 16), 8, 256, 512, drafter=drafter, argmax_head=argmax_head
    )
    return rolling_engine(fake_execute, scheduler, router)


def receive_frames(dealer: zmq.Socket) -> list[list[protocol.Event]]:
    frames = []
    while dealer.poll(0):
        frames.append(protocol.decode_events(dealer.recv()))
    return frames


def receive_all(dealer: zmq.Socket) -> list[protocol.Event]:
    return [event for frame in receive_frames(dealer) for event in frame]


def run_until_idle(engine: EngineShell) -> None:
    engine.read_socket()
    while engine.core.scheduler.has_work():
        engine.turn()


def submit(
    dealer, request_id: str, prompt: list[int], max_new: int, stream=True, **logprobs
) -> None:
    params = GenerationParams(max_new_tokens=max_new, ignore_eos=True, **logprobs)
    message = protocol.GenerateRequest(request_id, prompt, params, stream=stream)
    dealer.send(protocol.encode(message))


def wait_for_messages(router: zmq.Socket) -> None:
    assert router.poll(2000), "no message reached the engine"


def test_every_request_gets_its_tokens_and_one_final_event(sockets):
    router, connect = sockets
    engine = make_engine(router)
    first, second = connect(), connect()
    submit(first, "a", [5, 6], 4)
    submit(first, "b", [10], 3)
    submit(second, "c", [20, 21, 22], 5)
    wait_for_messages(router)
    run_until_idle(engine)
    tokens: dict[str, list[int]] = {}
    finals: dict[str, str] = {}
    frames = {dealer: receive_frames(dealer) for dealer in (first, second)}
    for frame in frames[first] + frames[second]:
        for event in frame:
            tokens.setdefault(event.id, []).extend(event.token_ids)
            if isinstance(event, protocol.FinalEvent):
                finals[event.id] = event.finish_reason
    assert tokens == {"a": [7, 8, 9, 10], "b": [11, 12, 13], "c": [23, 24, 25, 26, 27]}
    assert finals == {"a": "length", "b": "length", "c": "length"}
    # One frame per step for each worker: 4 steps for a and b together, 5 for c.
    assert [len(frame) for frame in frames[first]] == [2, 2, 2, 1]
    assert [len(frame) for frame in frames[second]] == [1] * 5
    engine.core.scheduler.check_invariants()


def test_requests_without_log_probs_take_tokens_picked_without_logits(sockets):
    """Beside requests whose logits are sampled, in the same steps: the same greedy tokens,
    and no log-prob where none was asked for."""
    router, connect = sockets
    engine, dealer = make_engine(router, argmax_head=True), connect()
    requests = {"bare": ([5, 6], 4, {"log_probs": False}), "detailed": ([40], 3, {})}
    for name, (prompt, max_new, params) in requests.items():
        submit(dealer, name, prompt, max_new, **params)
    wait_for_messages(router)
    run_until_idle(engine)
    events = receive_all(dealer)
    tokens = {name: [t for e in events if e.id == name for t in e.token_ids] for name in requests}
    assert tokens == {"bare": [7, 8, 9, 10], "detailed": [41, 42, 43]}
    bare = [p for e in events if e.id == "bare" for p in e.log_probs]
    detailed = [p for e in events if e.id == "detailed" for p in e.log_probs]
    assert len(bare) == 4 and all(math.isnan(p) for p in bare)
    assert len(detailed) == 3 and all(p <= 0.0 for p in detailed)
    engine.core.scheduler.check_invariants()


def test_a_request_that_is_not_streamed_gets_one_final_event_with_every_token(sockets):
    router, connect = sockets
    engine = make_engine(router)
    dealer = connect()
    submit(dealer, "quiet", [5, 6], 4, stream=False)
    submit(dealer, "loud", [30], 2)
    wait_for_messages(router)
    run_until_idle(engine)
    events = receive_all(dealer)
    quiet = [e for e in events if e.id == "quiet"]
    assert len(quiet) == 1 and isinstance(quiet[0], protocol.FinalEvent)
    assert quiet[0].token_ids == [7, 8, 9, 10] and len(quiet[0].log_probs) == 4
    loud = [type(e) for e in events if e.id == "loud"]
    assert loud == [protocol.TokenEvent, protocol.FinalEvent]
    assert not engine.core._unstreamed


def test_steps_are_profiled_by_phase(sockets):
    router, connect = sockets
    engine = make_engine(router)
    dealer = connect()
    submit(dealer, "a", [1, 2, 3], 6)
    wait_for_messages(router)
    run_until_idle(engine)
    stats = engine.stats()
    assert stats["num_steps"] == 6
    assert stats["step_seconds"]["count"] == 6 and stats["step_forward_seconds"]["count"] == 6
    assert stats["step_sequences"] == 6
    phases = stats["step_phase_seconds"]
    assert set(phases) == set(PHASES) and all(seconds >= 0 for seconds in phases.values())
    assert phases["forward"] > 0 and stats["step_seconds"]["sum"] >= phases["forward"]
    dealer.send(protocol.encode(protocol.StatsRequest("s")))
    wait_for_messages(router)
    run_until_idle(engine)
    (answer,) = receive_all(dealer)[-1:]
    assert isinstance(answer, protocol.StatsEvent) and answer.stats["num_steps"] == 6


def test_a_step_trace_holds_each_steps_chunks_and_phases(sockets, tmp_path):
    """option.step_trace: a JSON line a step, each chunk's new tokens, the tokens before them
    and what it asks for, in step order (what benchmarks/step_floor.py replays)."""
    router, connect = sockets
    path = tmp_path / "steps.jsonl"
    engine = make_engine(router, argmax_head=True)
    engine.core.step_trace = StepTrace(str(path))
    dealer = connect()
    submit(dealer, "a", [1, 2, 3], 3, log_probs=False)
    wait_for_messages(router)
    run_until_idle(engine)
    submit(dealer, "b", [4, 5], 2)
    wait_for_messages(router)
    run_until_idle(engine)
    steps = [json.loads(line) for line in path.read_text().splitlines()]
    assert [step["chunks"] for step in steps] == [
        [[3, 0, True, True]],
        [[1, 3, True, True]],
        [[1, 4, True, True]],
        [[2, 0, True, False]],
        [[1, 2, True, False]],
    ]
    assert all(
        set(step["phases"]) <= set(PHASES) and step["phases"]["forward"] > 0 for step in steps
    )
    assert steps[0]["t"] <= steps[-1]["t"] <= time.time()


def test_a_step_trace_that_cannot_be_written_is_refused_by_name(tmp_path):
    with pytest.raises(ValueError, match=r"option.step_trace: cannot write .*missing"):
        StepTrace(str(tmp_path / "missing" / "steps.jsonl"))


def test_profile_log_line_comes_once_a_window_is_long_enough(sockets, caplog, monkeypatch):
    router, connect = sockets
    engine = make_engine(router)
    monkeypatch.setattr(rolling_core, "_PROFILE_LOG_S", 0.0)
    dealer = connect()
    submit(dealer, "a", [1, 2, 3], 2)
    wait_for_messages(router)
    with caplog.at_level(logging.INFO, logger="lmserve.engine"):
        run_until_idle(engine)
    lines = [r.getMessage() for r in caplog.records if "per step ms" in r.getMessage()]
    assert len(lines) == 2 and "mean batch 1.0" in lines[0] and "forward=" in lines[0]


def test_step_profile_window_resets_after_a_summary():
    profile = StepProfile()
    timer = PhaseTimer()
    for phase in PHASES:
        timer.mark(phase)
    profile.record(timer, batch_size=4)
    profile.record(timer, batch_size=2)
    assert profile.take_summary(every_s=3600) is None  # the window is still young
    summary = profile.take_summary(every_s=0)
    assert summary.startswith("2 steps") and "mean batch 3.0" in summary
    assert profile.take_summary(every_s=0) is None  # nothing since
    assert profile.to_dict()["step_sequences"] == 6


def test_a_failing_sampler_fails_the_step_requests_and_the_engine_goes_on(sockets):
    router, connect = sockets
    engine = make_engine(router)
    dealer = connect()
    submit(dealer, "a", [1, 2], 3)
    wait_for_messages(router)
    real_sample = engine.core.sampler.sample
    engine.core.sampler.sample = lambda *args: 1 / 0
    run_until_idle(engine)
    (error,) = receive_all(dealer)
    assert isinstance(error, protocol.ErrorEvent) and error.id == "a"
    engine.core.sampler.sample = real_sample
    submit(dealer, "b", [1, 2], 3)
    wait_for_messages(router)
    run_until_idle(engine)
    assert isinstance(receive_all(dealer)[-1], protocol.FinalEvent)
    engine.core.scheduler.check_invariants()


def test_malformed_requests_are_answered_with_errors_and_the_engine_goes_on(sockets, caplog):
    router, connect = sockets
    engine = make_engine(router)
    dealer = connect()
    params = {"max_new_tokens": 3, "ignore_eos": True}
    dealer.send(b"\xc1 not msgpack")
    dealer.send(pack({"op": "generate", "id": "x", "prompt_ids": ["one"], "params": {}}))
    dealer.send(pack({"op": "generate", "id": "y", "prompt_ids": [1], "params": "?"}))
    dealer.send(pack({"op": "teleport", "id": "z"}))
    dealer.send(pack([1, 2, 3]))
    dealer.send(pack({"op": "generate", "id": "ok", "prompt_ids": [1], "params": params}))
    wait_for_messages(router)
    with caplog.at_level(logging.ERROR):
        run_until_idle(engine)
    events = receive_all(dealer)
    errors = [e for e in events if isinstance(e, protocol.ErrorEvent)]
    assert [(e.id, e.status) for e in errors] == [("x", 500), ("y", 500), ("z", 500)]
    assert "prompt_ids" in errors[0].message  # says what was wrong
    assert [e.token_ids for e in events if e.id == "ok"] == [[2], [3], [4]]
    assert isinstance(events[-1], protocol.FinalEvent)
    assert sum("malformed IPC message" in r.getMessage() for r in caplog.records) == 5
    engine.core.scheduler.check_invariants()


def test_a_request_that_waits_past_predict_timeout_for_a_place_is_answered(sockets):
    """option.predict_timeout bounds the wait for a place in the batch, never a request that is
    under way: one running request outlives the timeout, one still waiting gets a 503."""
    router, connect = sockets
    scheduler = Scheduler(BlockManager(64, 16), 1, 256, 512)  # one request runs at a time
    engine = rolling_engine(fake_execute, scheduler, router, slot_timeout_s=5)
    dealer = connect()
    submit(dealer, "running", [5], 50)
    submit(dealer, "waiting", [6], 2)
    wait_for_messages(router)
    engine.read_socket()
    engine.turn()  # "running" starts; "waiting" has no place
    later = time.monotonic() + 6
    engine.expire_waiting(later)
    run_until_idle(engine)
    events = receive_all(dealer)
    (refused,) = [e for e in events if e.id == "waiting"]
    assert isinstance(refused, protocol.ErrorEvent) and refused.status == 503
    assert "option.predict_timeout" in refused.message
    finals = [e for e in events if e.id == "running" and isinstance(e, protocol.FinalEvent)]
    assert len(finals) == 1 and len([e for e in events if e.id == "running"]) == 50
    engine.core.scheduler.check_invariants()
    assert engine.core.scheduler.blocks.num_free == 64


def test_out_of_memory_in_a_step_is_507_and_the_engine_goes_on(sockets):
    router, connect = sockets
    calls = []

    def execute(chunks):
        calls.append(len(chunks))
        if len(calls) == 1:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return fake_execute(chunks)

    scheduler = Scheduler(BlockManager(64, 16), 8, 256, 512)
    engine = rolling_engine(execute, scheduler, router)
    dealer = connect()
    submit(dealer, "big", [5, 6], 2)
    wait_for_messages(router)
    run_until_idle(engine)
    submit(dealer, "after", [7], 2)
    wait_for_messages(router)
    run_until_idle(engine)
    events = receive_all(dealer)
    (failed,) = [e for e in events if e.id == "big"]
    assert isinstance(failed, protocol.ErrorEvent) and failed.status == 507
    assert "out of memory" in failed.message
    assert [type(e) for e in events if e.id == "after"][-1] is protocol.FinalEvent
    assert engine.core.scheduler.blocks.num_free == 64


def run_out_of_memory() -> None:
    """A real allocation no machine grants (1 PiB): the CPU allocator's own error, a plain
    RuntimeError."""
    torch.empty(2**50, dtype=torch.uint8)


def tokens_and_endings(events) -> tuple[dict, dict]:
    """({request id: its tokens}, {request id: its finish reason, or its error's status})."""
    tokens: dict[str, list[int]] = {}
    endings: dict[str, object] = {}
    for event in events:
        if isinstance(event, protocol.ErrorEvent):
            endings[event.id] = event.status
            continue
        tokens.setdefault(event.id, []).extend(event.token_ids)
        if isinstance(event, protocol.FinalEvent):
            endings[event.id] = event.finish_reason
    return tokens, endings


def test_out_of_memory_fails_the_largest_chunk_alone_and_the_others_go_on(sockets):
    """A deliberately small activation budget: a step of more than 40 tokens runs out of
    memory. A long prompt joining two decodes fails alone with 507; the decodes go on as if
    nothing happened, and a later request is served."""
    router, connect = sockets

    def execute(chunks):
        if sum(len(chunk.token_ids) for chunk in chunks) > 40:
            run_out_of_memory()
        return fake_execute(chunks)

    scheduler = Scheduler(BlockManager(64, 16), 8, 256, 512)
    engine = rolling_engine(execute, scheduler, router)
    dealer = connect()
    submit(dealer, "a", [5, 6], 4)
    submit(dealer, "b", [10], 3)
    wait_for_messages(router)
    engine.read_socket()
    engine.turn()  # a and b prefill: 3 tokens
    submit(dealer, "long", list(range(1, 51)), 2)
    wait_for_messages(router)
    run_until_idle(engine)  # long's 50 tokens beside two decodes: out of memory
    submit(dealer, "after", [7], 2)
    wait_for_messages(router)
    run_until_idle(engine)
    events = receive_all(dealer)
    tokens, endings = tokens_and_endings(events)
    assert endings == {"a": "length", "b": "length", "long": 507, "after": "length"}
    assert tokens == {"a": [7, 8, 9, 10], "b": [11, 12, 13], "after": [8, 9]}
    (failed,) = [e for e in events if e.id == "long"]
    assert "out of memory" in failed.message and "50 tokens" in failed.message
    assert engine.core.metrics.finished["error"] == 1
    engine.core.scheduler.check_invariants()
    assert engine.core.scheduler.blocks.num_free == 64


def test_out_of_memory_among_equal_chunks_fails_the_newest(sockets):
    router, connect = sockets

    def execute(chunks):
        if len(chunks) > 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return fake_execute(chunks)

    scheduler = Scheduler(BlockManager(64, 16), 8, 256, 512)
    engine = rolling_engine(execute, scheduler, router)
    dealer = connect()
    for name, token in (("first", 1), ("second", 2), ("third", 3)):
        submit(dealer, name, [token], 2)
    wait_for_messages(router)
    run_until_idle(engine)
    tokens, endings = tokens_and_endings(receive_all(dealer))
    assert endings == {"first": "length", "second": "length", "third": 507}
    assert tokens == {"first": [2, 3], "second": [3, 4]}
    engine.core.scheduler.check_invariants()


def test_out_of_memory_with_several_ranks_ends_the_job(sockets):
    """The other ranks may be inside a collective of the failed step: no rank can go on."""
    router, connect = sockets

    def execute(chunks):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    scheduler = Scheduler(BlockManager(64, 16), 8, 256, 512)
    engine = rolling_engine(execute, scheduler, router, world_size=2)
    dealer = connect()
    submit(dealer, "a", [1], 2)
    wait_for_messages(router)
    engine.read_socket()
    with pytest.raises(torch.OutOfMemoryError):
        engine.turn()


def python_out_of_memory() -> None:
    raise MemoryError()


@pytest.mark.parametrize(
    "run_out", [run_out_of_memory, python_out_of_memory], ids=["torch", "python"]
)
def test_out_of_memory_while_sampling_fails_that_request_with_507(sockets, run_out):
    """The sampler's batch runs out of memory with the request whose row needs the most (here:
    any batch holding "big"); every row is then sampled alone, and only "big" fails."""
    router, connect = sockets
    engine = make_engine(router)
    sample_batch = engine.core.sampler._sample_batch

    def sample_rows(logits, requests):
        if any(request.request_id == "big" for request in requests):
            run_out()
        return sample_batch(logits, requests)

    engine.core.sampler._sample_batch = sample_rows
    dealer = connect()
    submit(dealer, "a", [5], 3)
    submit(dealer, "big", [6], 3, top_logprobs=20)
    submit(dealer, "b", [7], 3)
    wait_for_messages(router)
    run_until_idle(engine)
    events = receive_all(dealer)
    tokens, endings = tokens_and_endings(events)
    assert endings == {"a": "length", "big": 507, "b": "length"}
    assert tokens == {"a": [6, 7, 8], "b": [8, 9, 10]}
    (failed,) = [e for e in events if e.id == "big"]
    assert failed.message.startswith("sampling failed")
    engine.core.scheduler.check_invariants()


def test_log_probs_asked_for_come_with_the_tokens_and_the_first_event(sockets):
    """Top log-probs with every token, the prompt's (scored over two prefill chunks: the
    budget is 256 tokens) with the first event, streamed or not; nothing for others."""
    router, connect = sockets
    engine = make_engine(router)
    dealer = connect()
    prompt = [(7 * i) % VOCAB for i in range(300)]
    asks = {"prompt_logprobs": True, "top_logprobs": 2}
    submit(dealer, "streamed", prompt, 3, **asks)
    submit(dealer, "quiet", prompt, 3, stream=False, **asks)
    submit(dealer, "plain", prompt[:5], 3)
    wait_for_messages(router)
    run_until_idle(engine)
    events = receive_all(dealer)
    expected_prompt = torch.log_softmax(fake_logits(prompt[:-1]), -1)
    expected_prompt = expected_prompt.gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]
    for name in ("streamed", "quiet"):
        mine = [e for e in events if e.id == name]
        assert mine[0].prompt_log_probs == pytest.approx(expected_prompt.tolist(), abs=1e-6)
        assert all(e.prompt_log_probs is None for e in mine[1:])
        tops = [top for e in mine for top in e.top_logprobs]
        tokens = [token for e in mine for token in e.token_ids]
        assert len(tops) == len(tokens) == 3
        # The fake model puts its mass on one token: the sampled one comes first.
        assert [top[0][0] for top in tops] == tokens and all(len(top) == 2 for top in tops)
    plain = [e for e in events if e.id == "plain"]
    assert all(e.top_logprobs is None and e.prompt_log_probs is None for e in plain)


def test_kept_drafts_reach_the_client_as_several_tokens_a_step(sockets):
    """The fake model counts up; a prompt that counted up before lets the drafter guess the
    next tokens: streamed events carry several tokens, the same ones and log-probs as one
    token a step, the metrics count drafts, and fewer steps are run."""
    router, connect = sockets
    engine = make_engine(router, NgramDrafter(max_draft=4))
    dealer = connect()
    prompt = [*range(10, 30), 10, 11]
    submit(dealer, "counting", prompt, 12, top_logprobs=1)
    submit(dealer, "quiet", prompt, 12, stream=False)
    submit(dealer, "sampled", prompt, 5, do_sample=True, seed=3)  # drawn: never drafted
    wait_for_messages(router)
    run_until_idle(engine)
    events = receive_all(dealer)
    counting = [e for e in events if e.id == "counting"]
    assert [t for e in counting for t in e.token_ids] == list(range(12, 24))
    assert max(len(e.token_ids) for e in counting) > 1
    log_probs = [p for e in counting for p in e.log_probs]
    expected = torch.log_softmax(fake_logits([11]), -1)[0, 12].item()
    assert log_probs == pytest.approx([expected] * 12, abs=1e-6)
    assert [top[0][0] for e in counting for top in e.top_logprobs] == list(range(12, 24))
    (quiet,) = [e for e in events if e.id == "quiet"]
    assert quiet.token_ids == list(range(12, 24)) and len(quiet.log_probs) == 12
    assert len([t for e in events if e.id == "sampled" for t in e.token_ids]) == 5
    stats = engine.stats()
    assert 0 < stats["spec_accepted_tokens"] <= stats["spec_draft_tokens"]
    assert stats["tokens_generated"] == 12 + 12 + 5
    assert stats["num_steps"] < 12
    engine.core.scheduler.check_invariants()
