"""engine=Python's core for the engine shell (rolling_batch/engine/shell.py): dynamic
batching. Requests wait in the DynamicBatcher; each step runs whichever batch is due to
completion and answers every request in it. What a batch is depends on the work: token ids
through HF `generate` (hf_work.py), or raw requests through a model.py's `handle`
(user_handler_work.py). Torch-free.

The LoRA adapter management API is answered as the rolling batch answers it (the HF work's
`adapters`, rolling_batch/lora/registry.py), between batches: the model changes only then.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Protocol

from lmserve.rolling_batch.engine.shell import Outbox
from lmserve.rolling_batch.ipc import protocol
from lmserve.rolling_batch.lora.registry import ServedAdapters

from .dynamic_batcher import DynamicBatcher, PendingRequest


class BatchWork(Protocol):
    """What a batch is. A work that serves LoRA adapters (HF generate) also has `adapters`, a
    ServedAdapters (None: LoRA is off); a model.py's has none, and is told it takes no
    adapter commands."""

    request_type: type  # the request message this work takes
    num_failed: int

    def batch_key(self, message) -> tuple: ...

    def refusal(self, message) -> protocol.ErrorEvent | None:
        """The answer to a request this work will not run (None: it will), given before the
        request is queued."""
        ...

    def run(self, batch: list[PendingRequest], outbox: Outbox) -> int:
        """Answers every request of `batch` through `outbox`; returns how many requests ran
        in a batch (for the batch-size stats)."""
        ...


class DynamicBatchCore:
    def __init__(self, work: BatchWork, batcher: DynamicBatcher):
        self.work = work
        self.batcher = batcher
        self.request_type = work.request_type
        self.takes_adapter_commands = hasattr(work, "adapters")
        self.adapters: ServedAdapters | None = getattr(work, "adapters", None)
        self.batch_sizes: Counter[int] = Counter()

    def refusal(self, message) -> protocol.ErrorEvent | None:
        return self.work.refusal(message)

    def num_queued(self) -> int:
        return self.batcher.num_queued

    def add(self, identity: bytes, message, now: float) -> None:
        key = self.work.batch_key(message)
        self.batcher.add(PendingRequest(message.id, identity, message, key, now))

    def abort(self, request_id: str) -> bool:
        return self.batcher.remove(request_id) is not None

    def expire(self, arrived_before: float) -> list[tuple[bytes, str]]:
        return [(r.reply_to, r.request_id) for r in self.batcher.pop_expired(arrived_before)]

    def seconds_until_work(self, now: float) -> float | None:
        return self.batcher.seconds_until_due(now)

    def step(self, outbox: Outbox) -> None:
        batch = self.batcher.next_batch(time.monotonic())
        if batch:
            self.run_batch(batch, outbox)

    def run_batch(self, batch: list[PendingRequest], outbox: Outbox) -> None:
        if self.work.run(batch, outbox):
            self.batch_sizes[len(batch)] += 1

    def stats(self) -> dict:
        return {
            "batch_sizes": {str(size): count for size, count in sorted(self.batch_sizes.items())},
            "num_queued": self.batcher.num_queued,
            "num_failed": self.work.num_failed,
        }
