"""Counters and latency histograms of the rolling engine, sent to the front end on request
(for /models and /metrics). Torch-free."""

from __future__ import annotations

import bisect
from collections import Counter
from dataclasses import dataclass, field

# Seconds. Time to first token spans prefill queues; per-token latency is one decode step.
TTFT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TOKEN_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


@dataclass
class Histogram:
    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    count: int = 0

    def __post_init__(self):
        self.counts = [0] * (len(self.buckets) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value
        self.count += 1

    def to_dict(self) -> dict:
        return {
            "buckets": list(self.buckets),
            "counts": self.counts,
            "sum": self.total,
            "count": self.count,
        }


@dataclass
class EngineStats:
    num_steps: int = 0
    num_steps_with_joins: int = 0  # a request entered the running batch between steps
    num_steps_with_leaves: int = 0  # a request left it (finished) while others ran on
    tokens_generated: int = 0
    finished: Counter = field(default_factory=Counter)  # finish reason -> requests
    http_responses: Counter = field(default_factory=Counter)  # status -> responses
    time_to_first_token: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS))
    time_per_token: Histogram = field(default_factory=lambda: Histogram(TOKEN_BUCKETS))

    def to_dict(self) -> dict:
        return {
            "num_steps": self.num_steps,
            "num_steps_with_joins": self.num_steps_with_joins,
            "num_steps_with_leaves": self.num_steps_with_leaves,
            "tokens_generated": self.tokens_generated,
            "finished": dict(self.finished),
            "http_responses": {str(k): v for k, v in self.http_responses.items()},
            "time_to_first_token_seconds": self.time_to_first_token.to_dict(),
            "time_per_output_token_seconds": self.time_per_token.to_dict(),
        }
