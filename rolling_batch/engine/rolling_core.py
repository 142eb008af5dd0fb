"""Rank 0's core for engine=MPI: the rolling batch, as docs/design.md draws it. The shell
(shell.py) reads the socket and queues requests here; each step:

      out = scheduler.schedule()
      logits = execute(out.chunks)          # broadcast to every rank, all run the model
                                            # (and score prompts that asked for log-probs)
      sampled = sampler.sample(logits)      # rank 0 only
      events = scheduler.update(out, sampled)
      outbox.send(events)                   # one frame per web worker

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

from ..core.grammar import GrammarCompiler
from ..core.request import Request
from ..core.scheduler import Scheduler, SchedulerOutput
from ..core.step import Sample
from ..ipc import protocol
from ..lora.registry import AdapterRegistry
from ..model.runner import StepLogits
from .out_of_memory import failure_status, is_out_of_memory, largest_chunk
from .sampler import Sampler
from .shell import Outbox
from .stats import EngineStats, PhaseTimer, StepTrace

log = logging.getLogger("lmserve.engine")

_GRAMMAR_POLL_S = 0.001  # while only grammars are being built
_PROFILE_LOG_S = 30.0  # while busy, a log line of where the steps' time went
# The log-prob of a token picked without logits (argmax_only): asked for by no one.
_NO_LOG_PROB = float("nan")


class RollingBatchCore:
    """The rolling batch as the shell's EngineCore (shell.py)."""

    request_type = protocol.GenerateRequest
    takes_adapter_commands = True

    def __init__(
        self,
        execute: Callable,
        scheduler: Scheduler,
        sampler: Sampler,
        eos_token_ids: set[int],
        world_size: int = 1,
        adapters: AdapterRegistry | None = None,
        step_trace: StepTrace | None = None,
        grammars: GrammarCompiler | None = None,
    ):
        self.execute = execute
        self.scheduler = scheduler
        self.sampler = sampler
        self.eos_token_ids = eos_token_ids
        self.world_size = world_size
        self.adapters = adapters  # the LoRA adapters served; None: LoRA is off
        self.step_trace = step_trace  # option.step_trace; None: no trace
        self.grammars = grammars  # builds structured outputs' grammars; None: refused
        self._building: dict[Request, Future] = {}  # requests waiting for their grammar
        self.metrics = EngineStats()
        self._unstreamed: set[Request] = set()  # answered with one final event
        self._prefix_seen = (0, 0)  # prefix-cache (query, hit) tokens at the last log line
        self._drafts_seen = (0, 0)  # speculative (drafted, kept) tokens at the last log line
        # Restarted at each step's end (and when work arrives after a wait): a step's "intake"
        # is the shell's reading of the socket before it.
        self._timer = PhaseTimer()
        self._idle = True
        blocks = scheduler.blocks
        self.capacity_tokens = min(blocks.num_blocks * blocks.block_size, scheduler.max_model_len)

    def seconds_until_work(self, now: float) -> float | None:
        if self.scheduler.has_work():
            return 0.0
        return _GRAMMAR_POLL_S if self._building else None

    def num_queued(self) -> int:
        return len(self.scheduler.waiting) + len(self._building)

    def step(self, outbox: Outbox) -> None:
        timer = self._timer
        if self._idle:
            timer.restart()  # waiting for work is not step time
        self._admit_built(outbox)
        timer.mark("intake")
        self._idle = not self.scheduler.has_work()
        if self._idle:
            return
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
            self._step_failed(outbox, out, error)
            timer.restart()
            return
        timer.mark("forward")
        self.scheduler.record_prompt_scores(out, step_logits.prompt_scores)
        sampled, failed = self._sample(step_logits, out)
        timer.mark("sample")
        for request, error in failed:
            self._fail(outbox, [request], failure_status(error), f"sampling failed: {error}")
        before = len(self.scheduler.running)
        produced = self.scheduler.update(out, sampled, self.eos_token_ids)
        self._count_step(out, before, produced)
        for request, samples in produced:
            event = self._event(request, samples, len(out.requests))
            if event is not None:
                outbox.send(request.reply_to, event)
        timer.mark("update")
        outbox.flush()
        timer.mark("send")
        if self.step_trace is not None:
            self.step_trace.record(out.chunks, timer)
        self._profile(timer, len(out.requests))
        timer.restart()

    def _admit_built(self, outbox: Outbox) -> None:
        """Requests whose grammar is built join the scheduler; a grammar that failed to build
        fails its request."""
        for request, future in list(self._building.items()):
            if not future.done():
                continue
            del self._building[request]
            try:
                request.grammar = future.result()
            except Exception as error:
                self._fail(outbox, [request], 400, f"the grammar does not build: {error}")
                continue
            self.scheduler.add(request)

    def expire(self, arrived_before: float) -> list[tuple[bytes, str]]:
        """A request that has produced tokens is never cut (a preempted one waits again, but
        it is under way); one whose grammar is being built has not arrived yet."""
        expired = [
            request
            for request in self.scheduler.waiting
            if request.first_token_time is None and request.arrival_time < arrived_before
        ]
        self._drop(expired, "error")
        return [(request.reply_to, request.request_id) for request in expired]

    def _step_failed(self, outbox: Outbox, out: SchedulerOutput, error: Exception) -> None:
        """A model step raised (one rank: no collective is left waiting). Out of memory fails
        the request with the step's largest chunk alone, 507 as engine=Python answers it (it
        may fit later); the others stay as they were, their tokens not computed, and run
        again next step, so each such step sheds one request until the rest fit. Any other
        error fails every request of the step."""
        if not is_out_of_memory(error):
            log.exception("model step failed; failing its %d requests", len(out.requests))
            self._fail(outbox, out.requests, 424, f"model step failed: {error!r}")
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
        self._fail(outbox, [request], 507, message)

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
        self.metrics.steps.record(timer, batch_size)
        summary = self.metrics.steps.take_summary(_PROFILE_LOG_S)
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

    def _event(self, request: Request, samples: list[Sample], batch_size: int):
        """The event for this step's tokens (one, or more where a draft was kept), counted in
        the stats; None for a request that is not streamed and not finished (its final event
        carries every token). A streamed request's first event carries its prompt's
        log-probs, if asked."""
        now = time.monotonic()
        first = request.first_token_time is None
        if first:
            request.first_token_time = now
            self.metrics.time_to_first_token.observe(now - request.arrival_time)
        else:
            for _ in samples:  # the step's time shared among its tokens
                self.metrics.time_per_token.observe((now - request.last_token_time) / len(samples))
        request.last_token_time = now
        self.metrics.tokens_generated += len(samples)
        unstreamed = request in self._unstreamed
        if request.finish_reason is not None:
            self.metrics.finished[request.finish_reason] += 1
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
        self.metrics.num_steps += 1
        if out.num_joined and running_before > out.num_joined:
            self.metrics.num_steps_with_joins += 1
        finished = sum(1 for request, _ in produced if request.finish_reason is not None)
        if finished and len(self.scheduler.running) > 0:
            self.metrics.num_steps_with_leaves += 1

    def _fail(self, outbox: Outbox, requests: list[Request], status: int, message: str) -> None:
        self._drop(requests, "error")
        for request in requests:
            outbox.send(request.reply_to, protocol.ErrorEvent(request.request_id, status, message))

    def _drop(self, requests: list[Request], counted_as: str) -> None:
        self.scheduler.fail(requests)
        for request in requests:
            self.metrics.finished[counted_as] += 1
            self._forget(request)

    def abort(self, request_id: str) -> bool:
        request = self.scheduler.abort(request_id) or self._stop_building(request_id)
        if request is None:
            return False
        self.metrics.finished["abort"] += 1
        self._forget(request)
        return True

    def _stop_building(self, request_id: str) -> Request | None:
        for request in self._building:
            if request.request_id == request_id:
                del self._building[request]
                return request
        return None

    def refusal(self, message: protocol.GenerateRequest) -> protocol.ErrorEvent | None:
        needed = len(message.prompt_ids) + message.params.max_new_tokens
        if needed > self.capacity_tokens:
            reason = (
                f"prompt + max_new_tokens = {needed} tokens exceed the {self.capacity_tokens}"
                " tokens the KV cache holds for one request"
            )
            return protocol.ErrorEvent(message.id, 400, reason)
        refusal = protocol.adapter_refusal(message.id, message.params.adapter, self.adapters)
        if refusal is not None:
            return refusal
        if message.params.grammar is not None and self.grammars is None:
            reason = "this engine does not serve structured outputs"
            return protocol.ErrorEvent(message.id, 400, reason)
        return None

    def add(self, identity: bytes, message: protocol.GenerateRequest, now: float) -> None:
        request = Request(message.id, message.prompt_ids, message.params, now, reply_to=identity)
        if not message.stream:
            self._unstreamed.add(request)
        if message.params.grammar is not None:
            self._building[request] = self.grammars.state_for(message.params.grammar)
        else:
            self.scheduler.add(request)

    def stats(self) -> dict:
        blocks = self.scheduler.blocks
        return {
            **self.metrics.to_dict(),
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
