"""Dynamic batching for engine=Python: gather up to `batch_size` requests within
`max_batch_delay`.

DJL fails a whole batch whose requests differ in parameters; here requests are grouped by a
batch key (for generation, `GenerationParams.batch_key()`; a user's handler takes any mix, one
key) and each group batches on its own. A group is due when it is full
or its oldest request has waited `max_batch_delay`; among due groups the one holding the oldest
request runs first, so no group starves. Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class PendingRequest:
    request_id: str
    reply_to: bytes  # ROUTER identity of the front-end socket that asked
    message: Any  # what the engine runs: a GenerateRequest, or a HandleRequest
    batch_key: tuple  # requests with equal keys may share a batch
    arrived_at: float


class DynamicBatcher:
    def __init__(self, batch_size: int, max_batch_delay_s: float):
        self.batch_size = batch_size
        self.max_batch_delay_s = max_batch_delay_s
        self._groups: dict[tuple, list[PendingRequest]] = {}  # batch key -> arrival order
        self.num_queued = 0

    def add(self, request: PendingRequest) -> None:
        self._groups.setdefault(request.batch_key, []).append(request)
        self.num_queued += 1

    def remove(self, request_id: str) -> PendingRequest | None:
        """Drops a queued request (client gone); None when it is not queued (running or done)."""
        for key, group in self._groups.items():
            for request in group:
                if request.request_id == request_id:
                    group.remove(request)
                    self.num_queued -= 1
                    if not group:
                        del self._groups[key]
                    return request
        return None

    def pop_expired(self, arrived_before: float) -> list[PendingRequest]:
        """Removes and returns the requests that arrived before `arrived_before` and still
        wait (their batch never started)."""
        expired = []
        for key in list(self._groups):
            group = self._groups[key]
            expired += [r for r in group if r.arrived_at < arrived_before]
            group[:] = [r for r in group if r.arrived_at >= arrived_before]
            if not group:
                del self._groups[key]
        self.num_queued -= len(expired)
        return expired

    def seconds_until_due(self, now: float) -> float | None:
        """How long the engine may sleep before a batch is due; None when nothing is queued."""
        if not self._groups:
            return None
        waits = [self._group_wait(group, now) for group in self._groups.values()]
        return max(0.0, min(waits))

    def next_batch(self, now: float) -> list[PendingRequest]:
        """The due batch whose oldest request is oldest, or [] when none is due yet."""
        due = [
            (group[0].arrived_at, key)
            for key, group in self._groups.items()
            if self._group_wait(group, now) <= 0
        ]
        if not due:
            return []
        _, key = min(due, key=lambda entry: entry[0])
        group = self._groups[key]
        batch = group[: self.batch_size]
        del group[: self.batch_size]
        if not group:
            del self._groups[key]
        self.num_queued -= len(batch)
        return batch

    def _group_wait(self, group: list[PendingRequest], now: float) -> float:
        if len(group) >= self.batch_size:
            return 0.0
        return group[0].arrived_at + self.max_batch_delay_s - now
