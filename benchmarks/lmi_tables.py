"""The LMI blog's two scenarios (Falcon-40B there, the embedded SmolLM2-135M here) with its
three serving.properties configs (benchmarks/configs/), one command:

    .venv/bin/python -m lmserve.benchmarks.lmi_tables [--num-requests 32]

Scenario 1: 32 input / 128 output tokens; scenario 2: 256 input / 32 output tokens. Each is a
burst of --num-requests concurrent requests, EOS ignored. Results (table, JSON, PNGs) go to
benchmarks/results/lmi-scenario-N/.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from .bench_cli import add_arguments, run

HERE = Path(__file__).resolve().parent
CONFIGS = ("dynamic", "rolling-contiguous", "rolling-paged")
SCENARIOS = {1: ("32", "128"), 2: ("256", "32")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--num-requests", default="32")
    parser.add_argument("--scenarios", type=int, nargs="+", default=sorted(SCENARIOS))
    options = parser.parse_args()
    for scenario in options.scenarios:
        input_len, output_len = SCENARIOS[scenario]
        bench = argparse.ArgumentParser()
        add_arguments(bench)
        argv = [f"--config={name}={HERE / 'configs' / f'{name}.properties'}" for name in CONFIGS]
        argv += [
            f"--num-requests={options.num_requests}",
            f"--input-len={input_len}",
            f"--output-len={output_len}",
            f"--out={HERE / 'results' / f'lmi-scenario-{scenario}'}",
            f"--title=LMI scenario {scenario}: {options.num_requests} concurrent requests,"
            f" {input_len} in / {output_len} out, SmolLM2-135M, 2-core CPU",
        ]
        run(bench.parse_args(argv))


if __name__ == "__main__":
    main()
