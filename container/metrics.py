"""Prometheus text exposition of the engine's stats (requests, queue, running, KV blocks,
tokens, time to first token and per-token latency, where the rolling engine's step time goes).
The engine keeps the numbers, so every gunicorn worker reports the same ones."""

from __future__ import annotations

_PREFIX = "lmserve_"
_UP_HELP = "1 when the engine is serving and reported its stats (see lmserve_stats_age_seconds)"


def render(stats: dict | None, model_name: str) -> str:
    lines: list[str] = []
    label = f'model="{model_name}"'
    if not stats:
        lines += _metric("up", "gauge", _UP_HELP, [(label, 0)])
        return "\n".join(lines) + "\n"
    lines += _metric("up", "gauge", _UP_HELP, [(label, 1)])
    responses = stats.get("http_responses", {})
    lines += _metric(
        "requests_total",
        "counter",
        "inference requests answered, by HTTP status",
        [(f'{label},status="{status}"', n) for status, n in sorted(responses.items())],
    )
    finished = stats.get("finished", {})
    lines += _metric(
        "engine_requests_finished_total",
        "counter",
        "requests that left the engine, by finish reason",
        [(f'{label},reason="{reason}"', n) for reason, n in sorted(finished.items())],
    )
    gauges = {
        "num_waiting": "requests waiting for the running batch",
        "num_running": "requests in the running batch",
        "kv_blocks_used": "KV cache blocks in use",
        "kv_blocks_free": "KV cache blocks free (cached ones among them, until reused)",
        "prefix_cached_blocks": "full KV blocks in the prefix cache (held or free)",
        "num_queued": "requests waiting for a dynamic batch",
        "stats_age_seconds": "seconds since the engine reported these numbers (0: this scrape)",
    }
    for key, help_text in gauges.items():
        if key in stats:
            lines += _metric(key, "gauge", help_text, [(label, stats[key])])
    counters = {
        "tokens_generated": "tokens generated",
        "num_preemptions": "requests preempted for KV blocks",
        "prefix_cache_query_tokens": "tokens of joining requests looked up in the prefix cache",
        "prefix_cache_hit_tokens": "of those, tokens found cached (not computed again)",
        "spec_draft_tokens": "drafted tokens checked by speculative decoding",
        "spec_accepted_tokens": "of those, tokens the model agreed with (kept)",
        "num_steps": "rolling-batch steps run",
        "step_sequences": "sequences in rolling-batch steps (over num_steps: the mean batch)",
    }
    for key, help_text in counters.items():
        if key in stats:
            lines += _metric(f"{key}_total", "counter", help_text, [(label, stats[key])])
    for key, help_text in (
        ("time_to_first_token_seconds", "time from arrival to the first token"),
        ("time_per_output_token_seconds", "time between consecutive tokens of a request"),
        ("step_seconds", "wall time of a rolling-batch step, socket to socket"),
        ("step_forward_seconds", "the model's forward pass within a step"),
    ):
        if key in stats:
            lines += _histogram(key, help_text, label, stats[key])
    for key, help_text in (
        ("adapter_requests", "requests admitted for each LoRA adapter"),
        ("adapter_tokens", "tokens generated through each LoRA adapter"),
    ):
        if stats.get(key):
            samples = [
                (f'{label},adapter="{_label_value(name)}"', n)
                for name, n in sorted(stats[key].items())
            ]
            lines += _metric(f"{key}_total", "counter", help_text, samples)
    if "step_phase_seconds" in stats:
        lines += _metric(
            "step_phase_seconds_total",
            "counter",
            "rolling-batch step time by phase (intake, schedule, forward, sample, update, send)",
            [(f'{label},phase="{p}"', s) for p, s in stats["step_phase_seconds"].items()],
        )
    return "\n".join(lines) + "\n"


def _label_value(text: str) -> str:
    """Prometheus' escapes for a label value."""
    return text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _metric(name: str, kind: str, help_text: str, samples) -> list[str]:
    full = _PREFIX + name
    lines = [f"# HELP {full} {help_text}", f"# TYPE {full} {kind}"]
    lines += [f"{full}{{{labels}}} {value}" for labels, value in samples]
    return lines


def _histogram(name: str, help_text: str, label: str, histogram: dict) -> list[str]:
    full = _PREFIX + name
    lines = [f"# HELP {full} {help_text}", f"# TYPE {full} histogram"]
    cumulative = 0
    for bound, count in zip(histogram["buckets"] + ["+Inf"], histogram["counts"]):
        cumulative += count
        lines.append(f'{full}_bucket{{{label},le="{bound}"}} {cumulative}')
    lines.append(f"{full}_sum{{{label}}} {histogram['sum']}")
    lines.append(f"{full}_count{{{label}}} {histogram['count']}")
    return lines
