"""Prometheus exposition of the engine's stats: lmserve_up says whether the engine answered,
the step profile comes out as histograms and per-phase counters."""

from __future__ import annotations

from lmserve.container import metrics
from lmserve.rolling_batch.engine.stats import PHASES, EngineStats, PhaseTimer


def samples(text: str) -> dict[str, float]:
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    return values


def test_no_stats_means_down():
    assert samples(metrics.render(None, "m")) == {'lmserve_up{model="m"}': 0}


def test_step_profile_is_exposed():
    stats = EngineStats()
    timer = PhaseTimer()
    for phase in PHASES:
        timer.mark(phase)
    stats.steps.record(timer, batch_size=3)
    stats.num_steps = 1
    values = samples(metrics.render(stats.to_dict(), "m"))
    assert values['lmserve_up{model="m"}'] == 1
    assert values['lmserve_step_seconds_count{model="m"}'] == 1
    assert values['lmserve_step_seconds_bucket{model="m",le="+Inf"}'] == 1
    assert values['lmserve_step_forward_seconds_count{model="m"}'] == 1
    assert values['lmserve_step_sequences_total{model="m"}'] == 3
    for phase in PHASES:
        assert f'lmserve_step_phase_seconds_total{{model="m",phase="{phase}"}}' in values


def test_requests_and_tokens_per_lora_adapter():
    # The engine shell's counts beside the rolling batch's.
    stats = {
        **EngineStats().to_dict(),
        "adapter_requests": {"sql": 2, 'odd"name': 1},
        "adapter_tokens": {"sql": 40, 'odd"name': 7},
    }
    values = samples(metrics.render(stats, "m"))
    assert values['lmserve_adapter_requests_total{model="m",adapter="sql"}'] == 2
    assert values['lmserve_adapter_tokens_total{model="m",adapter="sql"}'] == 40
    assert values['lmserve_adapter_tokens_total{model="m",adapter="odd\\"name"}'] == 7
    idle = {**EngineStats().to_dict(), "adapter_requests": {}, "adapter_tokens": {}}
    assert not any("adapter" in name for name in samples(metrics.render(idle, "m")))
