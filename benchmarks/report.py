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
    generated = sum(r.output_tokens for r in ok)
    summary = {
        "num_requests": len(results),
        "errors": len(results) - len(ok),
        "wall_seconds": wall_seconds,
        "tokens_requested": sum(r.output_tokens_requested for r in results),
        "tokens_generated": generated,
        "throughput_tokens_per_s": generated / wall_seconds if wall_seconds > 0 else 0.0,
        "mean_latency_s": statistics.fmean(latencies) if latencies else None,
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
