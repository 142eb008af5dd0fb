"""Iteration-level scheduling (Orca, vLLM; LMI's rolling batch). Torch-free.

Every step: running requests first, in arrival order (decodes cost one token each; a prompt
still being prefilled takes what the prefill budget allows), then waiting requests join while
the batch has room and the budget lasts (a request whose LoRA adapter would make more than
max_loras adapters in the batch waits, and those behind it may go first). Waiting requests
queue in arrival order, except that with `shortest_first` the requests that arrived together
(between two steps: a burst, or whatever came in during a long prefill step) queue shortest
prompt first: their order among themselves was the network's, and prefilling the short ones
first gives more of them their first token sooner (a burst of 64 prompts of 16..256 tokens: the
median request waits for ~30% of the burst's prompt tokens instead of ~50%). Earlier arrivals
still go first, so no request waits behind later ones. Prompts longer than
the budget are prefilled in chunks across steps while decodes keep running. KV blocks are
taken on demand; when none are left the newest running request is preempted (blocks freed,
its tokens kept and recomputed later). With prefix caching a joining request starts from the
cached blocks of its longest cached prefix, and full blocks are registered for reuse as steps
compute them.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from ..ipc.protocol import FinishReason
from .block_manager import BlockManager
from .prefix_cache import CacheRoot
from .request import Request, Status
from .speculation import NgramDrafter
from .step import Sample, SequenceChunk


@dataclass
class Scheduled:
    """A request scheduled this step, with the chunk of its tokens the step computes."""

    request: Request
    chunk: SequenceChunk


@dataclass
class SchedulerOutput:
    scheduled: list[Scheduled] = field(default_factory=list)  # in chunk order
    preempted: list[Request] = field(default_factory=list)
    num_joined: int = 0  # requests that entered the running batch this step

    @property
    def requests(self) -> list[Request]:
        """The scheduled requests, in chunk order."""
        return [s.request for s in self.scheduled]

    @property
    def chunks(self) -> list[SequenceChunk]:
        """What the model computes this step, one chunk a scheduled request."""
        return [s.chunk for s in self.scheduled]

    @property
    def sampling(self) -> list[Request]:
        """The requests whose logits this step produces (their chunk ends at their newest token)."""
        return [s.request for s in self.scheduled if s.chunk.needs_logits]

    def logit_rows(self):
        """Whose are the rows of the step's logits: (the requests sampled as usual, their
        rows, [(speculating request, its draft)], their rows: the draft's length + 1 each)."""
        plain, plain_rows, drafts, draft_rows = [], [], [], []
        row = 0
        for request, chunk in ((s.request, s.chunk) for s in self.scheduled):
            if chunk.num_drafts:
                drafts.append((request, chunk.token_ids[-chunk.num_drafts :]))
                draft_rows += range(row, row + chunk.num_logits)
            elif chunk.num_logits:
                plain.append(request)
                plain_rows.append(row)
            row += chunk.num_logits
        return plain, plain_rows, drafts, draft_rows

    @property
    def argmax_requests(self) -> list[Request]:
        """The requests whose greedy token the step picks without logits, in chunk order."""
        return [s.request for s in self.scheduled if s.chunk.num_argmax]


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_rolling_batch_size: int,
        max_prefill_tokens: int,
        max_model_len: int,
        max_loras: int | None = None,
        drafter: NgramDrafter | None = None,
        argmax_head: bool = False,
        shortest_first: bool = False,
        adapter_weights: Callable[[str], str | None] | None = None,
    ):
        self.blocks = block_manager
        # The digest of a LoRA adapter's weights as loaded now (None: not loaded); None: adapters
        # are told apart by name alone (offline use, tests).
        self.adapter_weights = adapter_weights
        self.shortest_first = shortest_first
        self._num_schedules = 0  # a request's arrival step: how many steps were scheduled before
        self.drafter = drafter  # speculative decoding; None: off
        # The model picks greedy tokens without logits (ModelRunner.argmax_head): requests
        # that need no more get `argmax_only` chunks.
        self.argmax_head = argmax_head
        self.max_rolling_batch_size = max_rolling_batch_size
        self.max_loras = max_loras  # distinct LoRA adapters in the running batch, at most
        self.max_prefill_tokens = max_prefill_tokens
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        # Prefix caching, in tokens of the requests that joined: looked up, found cached.
        self.num_prefix_query_tokens = 0
        self.num_prefix_hit_tokens = 0

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, request: Request) -> None:
        request.status = Status.WAITING
        request.arrival_step = self._num_schedules
        self.waiting.append(request)

    def _order_arrivals(self) -> None:
        """The requests added since the last step (the waiting queue's tail: preempted ones
        go back to its front) ordered shortest first; equal lengths keep their arrival order."""
        arrived = []
        while self.waiting and self.waiting[-1].arrival_step == self._num_schedules:
            arrived.append(self.waiting.pop())
        arrived.reverse()
        arrived.sort(key=lambda request: request.num_tokens)
        self.waiting.extend(arrived)

    def abort(self, request_id: str) -> Request | None:
        """Removes the request wherever it is and frees its blocks at once."""
        for queue in (self.running, self.waiting):
            for request in queue:
                if request.request_id == request_id:
                    queue.remove(request)
                    self.finish(request, "abort")
                    return request
        return None

    def finish(self, request: Request, reason: str) -> None:
        request.status = Status.FINISHED
        request.finish_reason = reason
        self.blocks.free(request)
        if self.drafter is not None:
            self.drafter.forget(request)

    def schedule(self) -> SchedulerOutput:
        if self.shortest_first:
            self._order_arrivals()
        self._num_schedules += 1
        budget = self.max_prefill_tokens
        out = SchedulerOutput()
        for request in list(self.running):
            if request not in self.running:  # preempted below by an older request
                continue
            num_new = self._num_new_tokens(request, budget)
            if num_new == 0:
                continue
            if not self._make_room(request, num_new, out):
                continue  # it was itself the newest and got preempted
            budget -= num_new if request.is_prefilling else 0
            self._add_chunk(out, request, num_new)
        passed_over: list[Request] = []  # their adapter finds no free slot this step
        while self.waiting and len(self.running) < self.max_rolling_batch_size and budget > 0:
            request = self.waiting[0]
            if not self._adapter_fits(request):
                passed_over.append(self.waiting.popleft())
                continue
            request.cache_root = self._cache_root(request)
            self.blocks.reuse_cached_prefix(request)
            num_new = self._num_new_tokens(request, budget)
            if num_new == 0 or not self.blocks.can_hold(
                request, request.num_computed_tokens + num_new
            ):
                self._release(request)
                break  # first come, first served: no overtaking a request that does not fit
            self.waiting.popleft()
            self.num_prefix_query_tokens += request.num_tokens
            self.num_prefix_hit_tokens += request.num_computed_tokens
            request.status = Status.RUNNING
            self.running.append(request)
            self.blocks.grow(request, request.num_computed_tokens + num_new)
            budget -= num_new
            out.num_joined += 1
            self._add_chunk(out, request, num_new)
        self.waiting.extendleft(reversed(passed_over))
        if self.drafter is not None:
            self._add_drafts(out, budget)
        if self.max_loras is not None:
            _group_by_adapter(out)
        return out

    def _add_drafts(self, out: SchedulerOutput, budget: int) -> None:
        """Drafted tokens for the step's speculating decodes, from what the prefill budget
        left (prompts keep their share, as without speculation) and only into KV blocks held
        or free now (a draft never preempts anyone)."""
        step_rows = sum(len(s.chunk.token_ids) for s in out.scheduled)
        for scheduled in out.scheduled:
            request, chunk = scheduled.request, scheduled.chunk
            if budget <= 0:
                return
            if request.is_prefilling or not self.drafter.speculates(request):
                continue
            limit = min(
                budget,
                request.params.max_new_tokens - len(request.output_ids) - 1,
                self.max_model_len - request.num_tokens - 1,
                self._draft_room(request),
            )
            draft = self.drafter.propose(request, limit, step_rows)
            if request.grammar is not None:  # only what the grammar allows is worth checking
                draft = draft[: request.grammar.valid_prefix(draft)]
            if not draft:
                continue
            self.blocks.grow(request, request.num_tokens + len(draft))
            budget -= len(draft)
            scheduled.chunk = replace(
                chunk,
                token_ids=chunk.token_ids + draft,
                block_ids=tuple(request.block_ids),
                num_drafts=len(draft),
                argmax_only=False,  # the draft's check reads the logits
            )

    def _draft_room(self, request: Request) -> int:
        """Tokens after the newest one that the request's blocks and the free ones hold."""
        blocks = len(request.block_ids) + self.blocks.num_free
        return blocks * self.blocks.block_size - request.num_tokens

    def _adapter_fits(self, request: Request) -> bool:
        """A request joins if its adapter (if any) is already running or a slot is left for
        it; the others wait (as in vLLM), and requests behind them may go first."""
        adapter = request.params.adapter
        if adapter is None or self.max_loras is None:
            return True
        running = {r.params.adapter for r in self.running} - {None}
        return adapter in running or len(running) < self.max_loras

    def _cache_root(self, request: Request) -> CacheRoot | None:
        """Where the request's prefix-cache chain starts, read as it joins: its adapter's
        weights are the ones this step runs with (an adapter not loaded yet is read in the
        step, so what it will hold is unknown: no root, no cached blocks)."""
        adapter, weights = request.params.adapter, ""
        if adapter is not None and self.adapter_weights is not None:
            weights = self.adapter_weights(adapter)
            if weights is None:
                return None
        return CacheRoot(adapter, weights, request.params.cache_salt)

    def _num_new_tokens(self, request: Request, budget: int) -> int:
        if request.is_prefilling:
            return min(request.num_uncomputed, budget)
        return request.num_uncomputed  # a decode: its newest token

    def _make_room(self, request: Request, num_new: int, out: SchedulerOutput) -> bool:
        target = request.num_computed_tokens + num_new
        while not self.blocks.can_hold(request, target):
            victim = self.running[-1]  # the newest
            self._preempt(victim, out)
            if victim is request:
                return False
        self.blocks.grow(request, target)
        return True

    def _release(self, request: Request) -> None:
        """Back to holding nothing, nothing computed (what a waiting request is)."""
        self.blocks.free(request)
        request.num_computed_tokens = 0

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        self.running.remove(request)
        # Already scheduled this step: unscheduled.
        out.scheduled = [s for s in out.scheduled if s.request is not request]
        self._release(request)
        request.status = Status.WAITING
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)
        out.preempted.append(request)

    def _add_chunk(self, out: SchedulerOutput, request: Request, num_new: int) -> None:
        start = request.num_computed_tokens
        tokens = request.all_token_ids[start : start + num_new]
        needs_logits = start + num_new == request.num_tokens
        chunk = SequenceChunk(
            tuple(tokens),
            start,
            tuple(request.block_ids),
            needs_logits,
            **_prompt_scoring(request, start, num_new),
            adapter=request.params.adapter,
            argmax_only=needs_logits and self.argmax_head and _argmax_only(request.params),
        )
        out.scheduled.append(Scheduled(request, chunk))

    def update(self, out: SchedulerOutput, sampled: dict, eos_ids: set[int]):
        """Records this step: sampled tokens (`{request: Sample}`, or a list of Samples for a
        speculating request: its kept draft and the token after it) are appended up to the
        request's end, computed tokens advance (a speculating request's by its kept draft),
        finished requests leave the batch and free their blocks. Returns (request, [Sample])
        for every request that got tokens, in chunk order."""
        produced = []
        for request, chunk in ((s.request, s.chunk) for s in out.scheduled):
            if request.status == Status.FINISHED:  # failed while sampling
                continue
            samples = sampled.get(request, []) if chunk.needs_logits else []
            samples = [samples] if isinstance(samples, Sample) else samples
            agreed = max(len(samples) - 1, 0)  # draft tokens the model agreed with
            if chunk.num_drafts and samples:
                self.drafter.record(request, chunk.num_drafts, agreed)
            elif self.drafter is not None and samples:
                self.drafter.observe(request, samples[0].token)
            reason = None
            for count, sample in enumerate(samples, 1):
                self._append(request, sample)
                reason = self._finish_reason(request, sample.token, eos_ids)
                if reason is not None:
                    samples = samples[:count]
                    break
            # Of a draft, the kept tokens now in the output count as computed; the cache holds
            # the rejected ones past that, and the next step writes over them.
            kept_drafts = min(agreed, len(samples))
            request.num_computed_tokens += len(chunk.token_ids) - chunk.num_drafts + kept_drafts
            self.blocks.cache_full_blocks(request)
            if samples:
                produced.append((request, samples))
            if reason is not None:
                self.running.remove(request)
                self.finish(request, reason)
        return produced

    @staticmethod
    def _append(request: Request, sample: Sample) -> None:
        request.output_ids.append(sample.token)
        request.output_log_probs.append(sample.log_prob)
        if request.grammar is not None:
            request.grammar.accept(sample.token)
        if sample.top_logprobs is not None:
            request.output_top_logprobs.append(sample.top_logprobs)

    def _finish_reason(
        self, request: Request, token: int, eos_ids: set[int]
    ) -> FinishReason | None:
        if token in eos_ids and not request.params.ignore_eos:
            return FinishReason.EOS_TOKEN
        if request.grammar is not None and request.grammar.is_finished:
            return FinishReason.EOS_TOKEN  # the grammar allows nothing more, EOS or not
        if len(request.output_ids) >= request.params.max_new_tokens:
            return FinishReason.LENGTH
        if request.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        return None

    def fail(self, requests: list[Request]) -> None:
        """Ends `requests`, running or waiting (blocks freed); the batch goes on without them."""
        for request in requests:
            for queue in (self.running, self.waiting):
                if request in queue:
                    queue.remove(request)
            self.finish(request, "error")

    def record_prompt_scores(self, out: SchedulerOutput, scores: dict) -> None:
        """Adds this step's prompt log-probs (`{chunk index: PromptScores}`) to their requests."""
        for index, score in scores.items():
            request = out.scheduled[index].request
            request.prompt_log_probs += score.log_probs
            if score.top_logprobs is not None:
                request.prompt_top_logprobs += score.top_logprobs

    def check_invariants(self) -> None:
        self.blocks.check_invariants(self.running + list(self.waiting))
        assert len(self.running) <= self.max_rolling_batch_size
        assert all(r.status == Status.RUNNING for r in self.running)
        assert all(r.status == Status.WAITING and not r.block_ids for r in self.waiting)


def _group_by_adapter(out: SchedulerOutput) -> None:
    """Puts the step's sequences of one LoRA adapter side by side (the base model's first, the
    order kept otherwise): the model then runs one segment an adapter (layers/lora.py)."""
    out.scheduled.sort(key=lambda s: s.chunk.adapter or "")


def _argmax_only(params) -> bool:
    """Whether the greedy token alone serves a request: no sampling, no penalty or grammar on
    the logits, no log-probs to report (the sampler would read the logits for any of them)."""
    return (
        not params.do_sample
        and params.grammar is None
        and params.repetition_penalty == 1.0
        and params.top_logprobs == 0
        and not params.log_probs
    )


def _prompt_scoring(request: Request, start: int, num_new: int) -> dict:
    """What of a chunk to score for a request that asked for its prompt's log-probs: positions
    start.. predict the prompt's tokens start + 1.., up to the prompt's last token. Positions
    scored before (the request was preempted and is recomputed) are not scored again."""
    if not request.params.prompt_logprobs:
        return {}
    first = max(start, len(request.prompt_log_probs))
    end = min(start + num_new, len(request.prompt_ids) - 1)
    if first >= end:
        return {}
    return {
        "score_from": first - start,
        "score_targets": tuple(request.prompt_ids[first + 1 : end + 1]),
        "score_top": request.params.top_logprobs,
    }
