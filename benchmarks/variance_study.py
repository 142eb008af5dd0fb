"""Anyscale's continuous-batching study on our server, one command:

    .venv/bin/python -m lmserve.benchmarks.variance_study [--num-requests 64]

Three configs (benchmarks/configs/variance-*.properties): static batching (engine=Python,
batch_size=8), continuous batching with contiguous KV, and continuous batching with paged KV,
the two rolling configs given the same KV budget (8192 token slots).

1. Throughput as the variance of output lengths grows: one burst of --num-requests requests,
   32 prompt tokens each, output lengths uniform around a mean of 64 tokens and ever wider
   (EOS ignored, so every length is exact).
2. Latency CDFs under Poisson arrivals at 1 and 4 requests/s, output lengths uniform in 16..128.

Each config's server is started once and runs every workload. Results (table, JSON, PNGs) go
to benchmarks/results/variance/.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from lmserve.properties.config import default_cache_dir
from lmserve.properties.javaprops import parse_properties

from . import report
from .bench_cli import measure
from .serving import running_server
from .workload import Lengths, PromptBuilder, plan

HERE = Path(__file__).resolve().parent
CONFIGS = {
    "static (batch_size=8)": "variance-static",
    "continuous, contiguous KV": "variance-continuous",
    "continuous, paged KV": "variance-paged",
}
INPUT_LEN = Lengths(32, 32)
# Mean 64 new tokens, spread ever wider.
OUTPUT_SPREADS = [
    Lengths(64, 64),
    Lengths(48, 80),
    Lengths(32, 96),
    Lengths(16, 112),
    Lengths(1, 127),
]
CDF_OUTPUT = Lengths(16, 128)
CDF_RATES = (1.0, 4.0)


def uniform_std(lengths: Lengths) -> float:
    count = lengths.high - lengths.low + 1
    return ((count * count - 1) / 12) ** 0.5


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--num-requests", type=int, default=64, help="per burst")
    parser.add_argument("--cdf-requests", type=int, default=48, help="per Poisson run")
    parser.add_argument("--out", type=Path, default=HERE / "results" / "variance")
    parser.add_argument("--port", type=int, default=8099)
    options = parser.parse_args()

    from lmserve.rolling_batch.model.source import local_model_path

    tokenizer = local_model_path(None, default_cache_dir()) / "tokenizer.json"
    builder = PromptBuilder(str(tokenizer), seed=0)
    bursts = [plan(builder, options.num_requests, INPUT_LEN, o, None, 0) for o in OUTPUT_SPREADS]
    poisson = {
        rate: plan(builder, options.cdf_requests, INPUT_LEN, CDF_OUTPUT, rate, 1)
        for rate in CDF_RATES
    }

    spread_runs: dict[str, list[dict]] = {}
    rate_runs: dict[float, dict[str, dict]] = {rate: {} for rate in CDF_RATES}
    for label, name in CONFIGS.items():
        entries = parse_properties((HERE / "configs" / f"{name}.properties").read_text())
        with running_server({e.key: e.value for e in entries}, options.port) as (url, _):
            spread_runs[label] = [measure(url, "lmserve", burst, None) for burst in bursts]
            for rate, planned in poisson.items():
                rate_runs[rate][label] = measure(url, "lmserve", planned, None)
        rates = [run["summary"]["throughput_tokens_per_s"] for run in spread_runs[label]]
        print(f"{label}: " + ", ".join(f"{rate:.1f}" for rate in rates) + " tokens/s")

    options.out.mkdir(parents=True, exist_ok=True)
    (options.out / "spread.json").write_text(json.dumps(spread_runs, indent=2))
    table = spread_table(spread_runs, options.num_requests)
    written = [options.out / "spread.md", plot_spread(spread_runs, options.out)]
    written[0].write_text(table + "\n")
    print(table)
    for rate, runs in rate_runs.items():
        title = (
            f"Poisson {rate:g} requests/s, {options.cdf_requests} requests,"
            f" input {INPUT_LEN}, output {CDF_OUTPUT} tokens"
        )
        written += report.write(runs, options.out / f"poisson-{rate:g}qps", title)
        print(f"\n{title}\n{report.markdown(runs)}")
    print("wrote " + ", ".join(str(p) for p in written))


def spread_table(spread_runs: dict[str, list[dict]], num_requests: int) -> str:
    stds = " | ".join(f"{s} (std {uniform_std(s):.0f})" for s in OUTPUT_SPREADS)
    lines = [
        f"Generated tokens/s, burst of {num_requests} requests, {INPUT_LEN} prompt tokens,"
        " output lengths:",
        "",
        f"| config | {stds} |",
        "|---|" + "---|" * len(OUTPUT_SPREADS),
    ]
    for label, runs in spread_runs.items():
        rates = [run["summary"]["throughput_tokens_per_s"] for run in runs]
        lines.append(f"| {label} | " + " | ".join(f"{rate:.1f}" for rate in rates) + " |")
    ratios = _ratio_row(spread_runs)
    if ratios:
        lines.append(ratios)
    return "\n".join(lines)


def _ratio_row(spread_runs: dict[str, list[dict]]) -> str | None:
    labels = list(spread_runs)
    if len(labels) < 2:
        return None
    static, best = spread_runs[labels[0]], spread_runs[labels[-1]]
    ratios = [
        b["summary"]["throughput_tokens_per_s"] / s["summary"]["throughput_tokens_per_s"]
        for s, b in zip(static, best)
    ]
    return f"| {labels[-1]} / {labels[0]} | " + " | ".join(f"{r:.2f}x" for r in ratios) + " |"


def plot_spread(spread_runs: dict[str, list[dict]], out_dir: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = out_dir / "throughput_vs_spread.png"
    stds = [uniform_std(s) for s in OUTPUT_SPREADS]
    figure, axes = plt.subplots(figsize=(6, 4))
    for label, runs in spread_runs.items():
        rates = [run["summary"]["throughput_tokens_per_s"] for run in runs]
        axes.plot(stds, rates, marker="o", label=label)
    axes.set_xlabel("std of output length (tokens), mean 64")
    axes.set_ylabel("generated tokens/s")
    axes.set_ylim(bottom=0)
    axes.set_title("Throughput as output lengths vary (burst, EOS ignored)", fontsize=9)
    axes.grid(alpha=0.3)
    axes.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path


if __name__ == "__main__":
    main()
