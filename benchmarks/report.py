"""Summaries of a benchmark run: throughput, TTFT and latency percentiles, errors; written as
a markdown table, a JSON file and PNG plots (latency CDF per config, throughput bars)."""

from __future__ import annotations

import json
import statistics
from pathlib import Path


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


def summarize(wall_seconds: float, results) -> dict:
    ok = [r for r in results if r.error is None]
    latencies = [r.latency for r in ok if r.latency is not None]
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    first_tokens = [r.sent_at + r.ttft for r in ok if r.ttft is not None]
    generated = sum(r.output_tokens for r in ok)
    summary = {
        "num_requests": len(results),
        "errors": len(results) - len(ok),
        "wall_seconds": wall_seconds,
        "tokens_requested": sum(r.output_tokens_requested for r in results),
        "tokens_generated": generated,
        "throughput_tokens_per_s": generated / wall_seconds if wall_seconds > 0 else 0.0,
        "mean_latency_s": statistics.fmean(latencies) if latencies else None,
        # When the last request's first token came: a burst's prompts are all computed by then
        # (prefill), and what follows is decoding.
        "all_first_tokens_s": max(first_tokens) if first_tokens else None,
    }
    for q in (50, 90, 99):
        summary[f"ttft_p{q}_s"] = percentile(ttfts, q)
        summary[f"latency_p{q}_s"] = percentile(latencies, q)
    return summary


def markdown(runs: dict[str, dict]) -> str:
    header = (
        "| config | requests | errors | tokens/s | TTFT p50 / p90 / p99 (s) |"
        " latency p50 / p90 / p99 (s) |\n|---|---|---|---|---|---|"
    )
    rows = []
    for label, run in runs.items():
        s = run["summary"]
        ttft = " / ".join(_seconds(s[f"ttft_p{q}_s"]) for q in (50, 90, 99))
        latency = " / ".join(_seconds(s[f"latency_p{q}_s"]) for q in (50, 90, 99))
        rows.append(
            f"| {label} | {s['num_requests']} | {s['errors']} |"
            f" {s['throughput_tokens_per_s']:.1f} | {ttft} | {latency} |"
        )
    return "\n".join([header, *rows])


def head_to_head(pairs: list[tuple[dict, dict]], ours: str, peer: str) -> str:
    """A markdown table of two servers' rounds of one workload (`pairs`: each round's two runs,
    ours first), summed over the rounds: tokens/s, and the wall time split where the burst's
    last request got its first token. Until then both servers mostly compute prompts; after
    it, only decodes. The speed-up is each sum of the peer's over ours (for tokens/s, ours
    over the peer's)."""
    summaries = [(a["summary"], b["summary"]) for a, b in pairs]
    if any(s["all_first_tokens_s"] is None for pair in summaries for s in pair):
        return ""  # a run with no first token at all: nothing to split

    def summed(key, side):
        return sum(pair[side][key] for pair in summaries)

    rate = [summed("throughput_tokens_per_s", side) for side in (0, 1)]
    until = [summed("all_first_tokens_s", side) for side in (0, 1)]
    after = [summed("wall_seconds", side) - until[side] for side in (0, 1)]
    rows = [
        ("tokens/s, summed over rounds", rate, _ratio(rate[0], rate[1]), ".1f"),
        ("s until every request's first token", until, _ratio(until[1], until[0]), ".2f"),
        ("s after it, to the last token", after, _ratio(after[1], after[0]), ".2f"),
    ]
    lines = [
        f"| {len(pairs)} rounds | {ours} | {peer} | {ours}'s speed-up |",
        "|---|---|---|---|",
    ]
    for name, (a, b), ratio, form in rows:
        lines.append(f"| {name} | {a:{form}} | {b:{form}} | {ratio} |")
    return "\n".join(lines)


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b > 0 else "-"


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def write(runs: dict[str, dict], out_dir: Path, title: str) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path = out_dir / "results.json"
    json_path.write_text(json.dumps(runs, indent=2))
    table_path = out_dir / "results.md"
    table_path.write_text(f"## {title}\n\n{markdown(runs)}\n")
    return [json_path, table_path, *plot(runs, out_dir, title)]


def plot(runs: dict[str, dict], out_dir: Path, title: str) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cdf_path, bars_path = out_dir / "latency_cdf.png", out_dir / "throughput.png"
    figure, axes = plt.subplots(figsize=(6, 4))
    for label, run in runs.items():
        latencies = sorted(r["latency"] for r in run["requests"] if r["latency"] is not None)
        if latencies:
            fractions = [(i + 1) / len(latencies) for i in range(len(latencies))]
            axes.step(latencies, fractions, where="post", label=label)
    axes.set_xlabel("end-to-end latency (s)")
    axes.set_ylabel("fraction of requests")
    axes.set_title(title, fontsize=9)
    axes.grid(alpha=0.3)
    axes.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(cdf_path, dpi=100)
    plt.close(figure)

    figure, axes = plt.subplots(figsize=(6, 4))
    labels = list(runs)
    rates = [runs[label]["summary"]["throughput_tokens_per_s"] for label in labels]
    axes.barh(labels, rates)
    axes.set_xlabel("generated tokens/s")
    axes.set_title(title, fontsize=9)
    for y, rate in enumerate(rates):
        axes.text(rate, y, f" {rate:.1f}", va="center", fontsize=8)
    figure.tight_layout()
    figure.savefig(bars_path, dpi=100)
    plt.close(figure)
    return [cdf_path, bars_path]
