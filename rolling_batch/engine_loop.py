"""Rank 0's loop for engine=MPI: the rolling batch, as DESIGN.md draws it.

    loop:
      drain new requests and aborts from the socket into the scheduler
      out = scheduler.schedule()
      logits = execute(out.chunks)          # broadcast to every rank, all run the model
                                            # (and score prompts that asked for log-probs)
      sampled = sampler.sample(logits)      # rank 0 only
      events = scheduler.update(out, sampled)
      send(events)                          # one frame per web worker

A request that cannot be sampled fails alone. A failed model step fails the requests in it and
the loop goes on, except with several ranks: then the ranks may be out of step, so the error
propagates and the job ends (the supervisor answers everyone and restarts or exits). A step that
ran out of memory fails only the request with its largest chunk, with 507 (out_of_memory.py);
the others run again next step. A request with a grammar (structured output) joins the
scheduler once its grammar is built in the background (grammar.py); one that does not build is
answered 400.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future

import zmq

from . import protocol
from .adapter_registry import AdapterRegistry, lora_off_answer
from .engine_stats import EngineStats, PhaseTimer, StepTrace
from .grammar import GrammarCompiler
from .ipc import drain_router
from .model_runner import StepLogits
from .out_of_memory import failure_status, is_out_of_memory, largest_chunk
from .request import Request
from .sampler import Sampler
from .scheduler import Scheduler, SchedulerOutput
from .step import Sample

log = logging.getLogger("lmserve.engine")

_IDLE_POLL_MS = 100
_GRAMMAR_POLL_MS = 1  # while only grammars are being built
_PROFILE_LOG_S = 30.0  # while busy, a log line of where the steps' time went
# The log-prob of a token picked without logits (argmax_only): asked for by no one.
_NO_LOG_PROB = float("nan")


class RollingEngine:
    def __init__(
        self,
        execute: Callable,
        scheduler: Scheduler,
        sampler: Sampler,
        socket: zmq.Socket,
        eos_token_ids: set[int],
        max_waiting: int,
        world_size: int = 1,
        slot_timeout_s: float | None = None,
        adapters: AdapterRegistry | None = None,
        step_trace: StepTrace | None = None,
        grammars: GrammarCompiler | None = None,
    ):
        self.execute = execute
        self.scheduler = scheduler
        self.sampler = sampler
        self.socket = socket
        self.eos_token_ids = eos_token_ids
        self.max_waiting = max_waiting
        self.world_size = world_size
        # option.predict_timeout: how long a request may wait for its place in the batch.
        self.slot_timeout_s = slot_timeout_s
        self.adapters = adapters  # the LoRA adapters served; None: LoRA is off
        self.step_trace = step_trace  # option.step_trace; None: no trace
        self.grammars = grammars  # builds structured outputs' grammars; None: refused
        self._building: dict[Request, Future] = {}  # requests waiting for their grammar
        self.stats = EngineStats()
        self._unstreamed: set[Request] = set()  # answered with one final event
        self._prefix_seen = (0, 0)  # prefix-cache (query, hit) tokens at the last log line
        self._drafts_seen = (0, 0)  # speculative (drafted, kept) tokens at the last log line
        blocks = scheduler.blocks
        self.capacity_tokens = min(blocks.num_blocks * blocks.block_size, scheduler.max_model_len)

    def run_forever(self) -> None:
        poller = zmq.Poller()
        poller.register(self.socket, zmq.POLLIN)
        timer = PhaseTimer()
        while True:
            busy = self.scheduler.has_work()
            timer.restart()
            wait = 0 if busy else _GRAMMAR_POLL_MS if self._building else _IDLE_POLL_MS
            if poller.poll(wait):
                if not busy:
                    timer.restart()  # waiting for work is not step time
                drain_router(self.socket, self._handle)
            self._admit_built()
            timer.mark("intake")
            self._expire_waiting(time.monotonic())
            if self.scheduler.has_work():
                self.step(timer)
            if self.adapters is not None and self.adapters.retiring:
                self.adapters.retire_unused(self._adapters_in_use())

    def _admit_built(self) -> None:
        """Requests whose grammar is built join the scheduler; a grammar that failed to build
        fails its request."""
        for request, future in list(self._building.items()):
            if not future.done():
                continue
            del self._building[request]
            try:
                request.grammar = future.result()
            except Exception as error:
                self._fail([request], 400, f"the grammar does not build: {error}")
                continue
            self.scheduler.add(request)

    def _expire_waiting(self, now: float) -> None:
        """Answers the requests that waited longer than option.predict_timeout for a place in
        the batch and never got one. A request that has produced tokens is never cut (a
        preempted one waits again, but it is under way)."""
        if self.slot_timeout_s is None:
            return
        expired = [
            request
            for request in self.scheduler.waiting
            if request.first_token_time is None and now - request.arrival_time > self.slot_timeout_s
        ]
        if expired:
            message = (
                f"no place in the running batch within {self.slot_timeout_s:g} s"
                " (option.predict_timeout); the server is busy, retry later"
            )
            self._fail(expired, 503, message)

    def step(self, timer: PhaseTimer | None = None) -> None:
        timer = timer or PhaseTimer()
        out = self.scheduler.schedule()
        if not out.requests:
            return
        timer.mark("schedule")
        try:
            # On CUDA this returns before the kernels finish: their time shows in "sample".
            step_logits = self.execute(out.chunks)
        except Exception as error:
            if self.world_size > 1:
                raise  # the other ranks may be inside a collective: end the job
            self._step_failed(out, error)
            return
        timer.mark("forward")
        self.scheduler.record_prompt_scores(out, step_logits.prompt_scores)
        sampled, failed = self._sample(step_logits, out)
        timer.mark("sample")
        for request, error in failed:
            self._fail([request], failure_status(error), f"sampling failed: {error}")
        before = len(self.scheduler.running)
        produced = self.scheduler.update(out, sampled, self.eos_token_ids)
        self._count_step(out, before, produced)
        events = self._events_by_worker(produced, len(out.requests))
        timer.mark("update")
        for identity, group in events.items():
            self._send(identity, group[0] if len(group) == 1 else protocol.BatchEvent(group))
        timer.mark("send")
        if self.step_trace is not None:
            self.step_trace.record(out.chunks, timer)
        self._profile(timer, len(out.requests))

    def _step_failed(self, out: SchedulerOutput, error: Exception) -> None:
        """A model step raised (one rank: no collective is left waiting). Out of memory fails
        the request with the step's largest chunk alone, 507 as engine=Python answers it (it
        may fit later); the others stay as they were, their tokens not computed, and run
        again next step, so each such step sheds one request until the rest fit. Any other
        error fails every request of the step."""
        if not is_out_of_memory(error):
            log.exception("model step failed; failing its %d requests", len(out.requests))
            self._fail(out.requests, 424, f"model step failed: {error!r}")
            return
        request, num_tokens = largest_chunk(out.requests, out.chunks, self.scheduler.running)
        total = sum(len(chunk.token_ids) for chunk in out.chunks)
        log.exception(
            "out of memory in a step of %d requests (%d tokens); failing %s (%d tokens)",
            len(out.requests),
            total,
            request.request_id,
            num_tokens,
        )
        message = (
            f"out of memory computing this request's {num_tokens} tokens in a step of {total}"
            f" tokens: {error}"
        )
        self._fail([request], 507, message)

    def _sample(self, step_logits: StepLogits, out: SchedulerOutput):
        """({request: Sample, or [Sample] where it speculated}, [(request, error)])."""
        logits = step_logits.logits
        plain, plain_rows, drafts, draft_rows = out.logit_rows()
        if drafts:
            logits, draft_logits = logits[plain_rows], logits[draft_rows]
        sampled, failed = {}, []
        if plain:
            try:
                sampled, failed = self.sampler.sample(logits, plain)
            except Exception as error:  # a sampler bug must not end the engine; rank 0 only
                log.exception("sampling failed; failing its %d requests", len(plain))
                failed = [(request, error) for request in plain]
        # Picked by the model without logits: their requests report no log-probs.
        for request, token in zip(out.argmax_requests, step_logits.greedy_tokens):
            sampled[request] = Sample(token, _NO_LOG_PROB)
        if drafts:
            try:
                sampled.update(self.sampler.verify(draft_logits, drafts))
            except Exception as error:
                log.exception("checking drafts failed; failing their %d requests", len(drafts))
                failed += [(request, error) for request, _ in drafts]
        return sampled, failed

    def _profile(self, timer: PhaseTimer, batch_size: int) -> None:
        self.stats.steps.record(timer, batch_size)
        summary = self.stats.steps.take_summary(_PROFILE_LOG_S)
        if summary is not None:
            log.info("%s%s%s", summary, self._prefix_cache_summary(), self._draft_summary())

    def _prefix_cache_summary(self) -> str:
        """The prefix cache's hit rate since the last log line."""
        scheduler = self.scheduler
        if not scheduler.blocks.enable_prefix_caching:
            return ""
        counts = (scheduler.num_prefix_query_tokens, scheduler.num_prefix_hit_tokens)
        queried, hit, rate = _share_since(counts, self._prefix_seen)
        self._prefix_seen = counts
        return f"; prefix cache: {hit} of {queried} prompt tokens cached ({rate:.0f}%)"

    def _draft_summary(self) -> str:
        """Speculative decoding's acceptance since the last log line."""
        drafter = self.scheduler.drafter
        if drafter is None:
            return ""
        counts = (drafter.num_drafted, drafter.num_accepted)
        drafted, accepted, rate = _share_since(counts, self._drafts_seen)
        self._drafts_seen = counts
        return f"; drafts: {accepted} of {drafted} tokens kept ({rate:.0f}%)"

    def _events_by_worker(self, produced, batch_size: int) -> dict[bytes, list[protocol.Event]]:
        events: dict[bytes, list[protocol.Event]] = {}
        for request, samples in produced:
            event = self._event(request, samples, batch_size)
            if event is not None:
                events.setdefault(request.reply_to, []).append(event)
        return events

    def _event(self, request: Request, samples: list[Sample], batch_size: int):
        """The event for this step's tokens (one, or more where a draft was kept), counted in
        the stats; None for a request that is not streamed and not finished (its final event
        carries every token). A streamed request's first event carries its prompt's
        log-probs, if asked."""
        now = time.monotonic()
        first = request.first_token_time is None
        if first:
            request.first_token_time = now
            self.stats.time_to_first_token.observe(now - request.arrival_time)
        else:
            for _ in samples:  # the step's time shared among its tokens
                self.stats.time_per_token.observe((now - request.last_token_time) / len(samples))
        request.last_token_time = now
        self.stats.tokens_generated += len(samples)
        if request.params.adapter is not None:
            self.stats.adapter_tokens[request.params.adapter] += len(samples)
        unstreamed = request in self._unstreamed
        if request.finish_reason is not None:
            self.stats.finished[request.finish_reason] += 1
            self._forget(request)
        elif unstreamed:
            return None
        if unstreamed:  # the final event: every token
            token_ids, log_probs = request.output_ids, request.output_log_probs
            top = request.output_top_logprobs if request.params.top_logprobs else None
        else:
            token_ids = [sample.token for sample in samples]
            log_probs = [sample.log_prob for sample in samples]
            top = None
            if request.params.top_logprobs:
                top = [sample.top_logprobs for sample in samples]
        prompt = _prompt_log_probs(request) if first or unstreamed else {}
        if request.finish_reason is None:
            return protocol.TokenEvent(request.request_id, token_ids, log_probs, top, **prompt)
        return protocol.FinalEvent(
            request.request_id,
            token_ids,
            log_probs,
            request.finish_reason,
            batch_size,
            top,
            **prompt,
        )

    def _forget(self, request: Request) -> None:
        self.sampler.forget(request.request_id)
        self._unstreamed.discard(request)

    def _count_step(self, out: SchedulerOutput, running_before: int, produced) -> None:
        self.stats.num_steps += 1
        if out.num_joined and running_before > out.num_joined:
            self.stats.num_steps_with_joins += 1
        finished = sum(1 for request, _ in produced if request.finish_reason is not None)
        if finished and len(self.scheduler.running) > 0:
            self.stats.num_steps_with_leaves += 1

    def _fail(self, requests: list[Request], status: int, message: str) -> None:
        self.scheduler.fail(requests)
        for request in requests:
            self.stats.finished["error"] += 1
            self._forget(request)
            self._send(request.reply_to, protocol.ErrorEvent(request.request_id, status, message))

    def _handle(self, identity: bytes, message: protocol.ToEngine) -> None:
        if isinstance(message, protocol.GenerateRequest):
            self._admit(identity, message)
        elif isinstance(message, protocol.AbortRequest):
            request = self.scheduler.abort(message.id) or self._stop_building(message.id)
            if request is not None:
                self.stats.finished["abort"] += 1
                self._forget(request)
        elif isinstance(message, protocol.StatsRequest):
            self._send(identity, protocol.StatsEvent(message.id, self.snapshot()))
        elif isinstance(message, protocol.CountResponse):
            self.stats.http_responses[message.status] += 1
        elif isinstance(message, protocol.AdapterCommand):
            if self.adapters is None:
                self._send(identity, lora_off_answer(message))
            else:
                self._send(identity, self.adapters.answer(message, self._adapters_in_use()))
        elif isinstance(message, protocol.HandleRequest):
            # A user's handle() runs with engine=Python; answer a front end that thinks otherwise.
            reason = "the rolling-batch engine serves the LLM handler, not a model.py handle()"
            self._send(identity, protocol.ErrorEvent(message.id, 500, reason))

    def _stop_building(self, request_id: str) -> Request | None:
        for request in self._building:
            if request.request_id == request_id:
                del self._building[request]
                return request
        return None

    def _adapters_in_use(self) -> set[str]:
        queued = [*self.scheduler.running, *self.scheduler.waiting]
        return {request.params.adapter for request in queued} - {None}

    def _admit(self, identity: bytes, message: protocol.GenerateRequest) -> None:
        needed = len(message.prompt_ids) + message.params.max_new_tokens
        if needed > self.capacity_tokens:
            reason = (
                f"prompt + max_new_tokens = {needed} tokens; the KV cache holds at most"
                f" {self.capacity_tokens} for one request"
            )
            self._send(identity, protocol.ErrorEvent(message.id, 400, reason))
            return
        refusal = protocol.adapter_refusal(message.id, message.params.adapter, self.adapters)
        if refusal is not None:
            self._send(identity, refusal)
            return
        if message.params.grammar is not None and self.grammars is None:
            reason = "this engine does not serve structured outputs"
            self._send(identity, protocol.ErrorEvent(message.id, 400, reason))
            return
        if len(self.scheduler.waiting) + len(self._building) >= self.max_waiting:
            self._send(identity, protocol.queue_full_event(message.id, self.max_waiting))
            return
        request = Request(
            message.id, message.prompt_ids, message.params, time.monotonic(), reply_to=identity
        )
        if not message.stream:
            self._unstreamed.add(request)
        if message.params.adapter is not None:
            self.stats.adapter_requests[message.params.adapter] += 1
        if message.params.grammar is not None:
            self._building[request] = self.grammars.state_for(message.params.grammar)
        else:
            self.scheduler.add(request)

    def snapshot(self) -> dict:
        blocks = self.scheduler.blocks
        return {
            **self.stats.to_dict(),
            "num_waiting": len(self.scheduler.waiting),
            "num_running": len(self.scheduler.running),
            "kv_blocks_total": blocks.num_blocks,
            "kv_blocks_free": blocks.num_free,
            "kv_blocks_used": blocks.num_blocks - blocks.num_free,
            "num_preemptions": self.scheduler.num_preemptions,
            "prefix_cache_query_tokens": self.scheduler.num_prefix_query_tokens,
            "prefix_cache_hit_tokens": self.scheduler.num_prefix_hit_tokens,
            "prefix_cached_blocks": blocks.num_cached,
            **self._speculation_counts(),
        }

    def _speculation_counts(self) -> dict:
        drafter = self.scheduler.drafter
        if drafter is None:
            return {}
        return {
            "spec_draft_tokens": drafter.num_drafted,
            "spec_accepted_tokens": drafter.num_accepted,
        }

    def _send(self, identity: bytes, event: protocol.FromEngine) -> None:
        self.socket.send_multipart([identity, protocol.encode(event)])


def _share_since(counts: tuple[int, int], seen: tuple[int, int]) -> tuple[int, int, float]:
    """(all, part, part in percent) of two running counts since they were `seen`."""
    total, part = (now - before for now, before in zip(counts, seen))
    return total, part, 100 * part / total if total else 0.0


def _prompt_log_probs(request: Request) -> dict:
    """The prompt's log-probs as event fields, for a request that asked for them."""
    if not request.params.prompt_logprobs:
        return {}
    top = request.prompt_top_logprobs if request.params.top_logprobs else None
    return {"prompt_log_probs": request.prompt_log_probs, "prompt_top_logprobs": top}
