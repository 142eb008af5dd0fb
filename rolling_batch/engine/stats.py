"""Counters and latency histograms of the rolling engine, sent to the front end on request
(for /models and /metrics), and where each step's wall time goes. Torch-free."""

from __future__ import annotations

import bisect
import json
import time
from collections import Counter
from dataclasses import dataclass, field

# Seconds. Time to first token spans prefill queues; per-token latency is one decode step.
TTFT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TOKEN_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
# A CPU decode step of SmolLM2 takes 20-70 ms; a long prefill chunk seconds.
STEP_BUCKETS = (0.005, 0.01, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5)
# A step's phases in loop order; "intake" reads the socket before the step.
PHASES = ("intake", "schedule", "forward", "sample", "update", "send")


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


class PhaseTimer:
    """Splits one step's wall time into PHASES: `mark(phase)` ends that phase at now."""

    def __init__(self):
        self.restart()

    def restart(self) -> None:
        self.start = self.last = time.perf_counter()
        self.seconds: dict[str, float] = {}

    def mark(self, phase: str) -> None:
        now = time.perf_counter()
        self.seconds[phase] = self.seconds.get(phase, 0.0) + now - self.last
        self.last = now

    @property
    def total(self) -> float:
        return self.last - self.start


class StepTrace:
    """option.step_trace: each step's shape and phase times appended to a file, a JSON line a
    step: {"t": wall clock at the step's end, "chunks": [[new tokens, tokens computed before,
    needs logits, argmax only], ...] in step order, "phases": {phase: seconds}}.
    benchmarks/step_floor.py sets a served run's steps against the machine's floor and replays
    them offline. Line-buffered: a trace read while the server runs holds whole steps."""

    def __init__(self, path: str):
        try:
            self._file = open(path, "a", buffering=1)  # noqa: SIM115 (open while the engine runs)
        except OSError as error:
            raise ValueError(f"option.step_trace: cannot write {path}: {error.strerror}") from None

    def record(self, chunks, timer: PhaseTimer) -> None:
        shape = [[len(c.token_ids), c.num_computed, c.needs_logits, c.argmax_only] for c in chunks]
        line = {"t": time.time(), "chunks": shape, "phases": timer.seconds}
        self._file.write(json.dumps(line) + "\n")


@dataclass
class _Window:
    """Sums over the steps since the last log line."""

    num_steps: int = 0
    num_sequences: int = 0
    step_seconds: float = 0.0
    phase_seconds: Counter = field(default_factory=Counter)
    started: float = field(default_factory=time.monotonic)


@dataclass
class StepProfile:
    """Each step's wall time (loop iteration from reading the socket to the last send) and its
    forward pass, as histograms for /metrics, and per-phase totals: the time the engine loses
    outside the model is step - forward."""

    step_seconds: Histogram = field(default_factory=lambda: Histogram(STEP_BUCKETS))
    forward_seconds: Histogram = field(default_factory=lambda: Histogram(STEP_BUCKETS))
    phase_seconds: Counter = field(default_factory=Counter)
    num_sequences: int = 0  # summed batch sizes: / num steps = mean batch
    window: _Window = field(default_factory=_Window)

    def record(self, timer: PhaseTimer, batch_size: int) -> None:
        self.step_seconds.observe(timer.total)
        self.forward_seconds.observe(timer.seconds.get("forward", 0.0))
        self.phase_seconds.update(timer.seconds)
        self.num_sequences += batch_size
        window = self.window
        window.num_steps += 1
        window.num_sequences += batch_size
        window.step_seconds += timer.total
        window.phase_seconds.update(timer.seconds)

    def take_summary(self, every_s: float) -> str | None:
        """One log line of means over the last `every_s` seconds or more (None before then),
        then a new window starts."""
        window = self.window
        if not window.num_steps or time.monotonic() - window.started < every_s:
            return None
        self.window = _Window()
        n = window.num_steps

        def ms(seconds: float) -> str:
            return f"{1000 * seconds / n:.1f}"

        phases = " ".join(f"{p}={ms(window.phase_seconds[p])}" for p in PHASES)
        return (
            f"{n} steps in {time.monotonic() - window.started:.0f} s, mean batch"
            f" {window.num_sequences / n:.1f}; per step ms: step={ms(window.step_seconds)}"
            f" {phases}"
        )

    def to_dict(self) -> dict:
        return {
            "step_seconds": self.step_seconds.to_dict(),
            "step_forward_seconds": self.forward_seconds.to_dict(),
            "step_phase_seconds": {p: self.phase_seconds[p] for p in PHASES},
            "step_sequences": self.num_sequences,
        }


@dataclass
class EngineStats:
    num_steps: int = 0
    num_steps_with_joins: int = 0  # a request entered the running batch between steps
    num_steps_with_leaves: int = 0  # a request left it (finished) while others ran on
    tokens_generated: int = 0
    finished: Counter = field(default_factory=Counter)  # finish reason -> requests
    time_to_first_token: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS))
    time_per_token: Histogram = field(default_factory=lambda: Histogram(TOKEN_BUCKETS))
    steps: StepProfile = field(default_factory=StepProfile)

    def to_dict(self) -> dict:
        return {
            "num_steps": self.num_steps,
            "num_steps_with_joins": self.num_steps_with_joins,
            "num_steps_with_leaves": self.num_steps_with_leaves,
            "tokens_generated": self.tokens_generated,
            "finished": dict(self.finished),
            "time_to_first_token_seconds": self.time_to_first_token.to_dict(),
            "time_per_output_token_seconds": self.time_per_token.to_dict(),
            **self.steps.to_dict(),
        }
