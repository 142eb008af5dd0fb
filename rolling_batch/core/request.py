"""A request inside the rolling engine: its tokens, how many of them the KV cache holds, its
blocks. Torch-free."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING

from ..ipc.protocol import GenerationParams
from .prefix_cache import CacheRoot, RequestChain

if TYPE_CHECKING:
    from .grammar import GrammarState


class Status(StrEnum):
    """Where a request is in the scheduler: waiting for a place (new or preempted), in the
    running batch, or done (ended, aborted or failed)."""

    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_ids: list[int]
    params: GenerationParams
    arrival_time: float
    reply_to: bytes = b""
    output_ids: list[int] = field(default_factory=list)
    output_log_probs: list[float] = field(default_factory=list)
    # Reported log-probs, only when the params ask (protocol.GenerationParams).
    output_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    prompt_log_probs: list[float] = field(default_factory=list)  # prompt tokens 2.. so far
    prompt_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    block_ids: list[int] = field(default_factory=list)
    # Prefix caching: where its chain starts (the scheduler sets it again as the request joins
    # the batch, with its adapter's weights; None: it neither takes nor gives cached blocks),
    # and its chain so far (block_manager.py).
    cache_root: CacheRoot | None = None
    cache_chain: RequestChain | None = None
    # Structured output (params.grammar): where the output is in its grammar; fed each token
    # as it is appended.
    grammar: GrammarState | None = None
    status: Status = Status.WAITING
    finish_reason: str | None = None
    num_preemptions: int = 0
    arrival_step: int = 0  # the scheduler's steps before it was added (Scheduler.add)
    first_token_time: float | None = None
    last_token_time: float | None = None

    def __post_init__(self):
        if self.cache_root is None:
            self.cache_root = CacheRoot(self.params.adapter, "", self.params.cache_salt)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_uncomputed(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_prefilling(self) -> bool:
        """More than the newest token is missing from the cache: a prompt (or, after a
        preemption, prompt plus output) being computed, under the prefill budget."""
        return self.num_uncomputed > 1 or self.num_computed_tokens < len(self.prompt_ids)
