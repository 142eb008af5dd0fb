"""Tensor parallel across hosts against one host: the same TP=2 server with both ranks here,
and with rank 1 on a worker "host" (a network namespace joined by a veth pair; netns_hosts.py),
where every all-reduce crosses TCP. Runs alternate; needs root and `ip netns`:

    .venv/bin/python -m lmserve.benchmarks.multi_host [--rounds 2]

Results go to benchmarks/results/multi-host/<workload>/.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from lmserve.properties.config import default_cache_dir

from . import report
from .bench_cli import measure
from .netns_hosts import worker_namespace
from .serving import running_server
from .vllm_compare import WORKLOADS, lmserve_properties
from .workload import PromptBuilder

HERE = Path(__file__).resolve().parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--port", type=int, default=8099)
    parser.add_argument("--out", type=Path, default=HERE / "results" / "multi-host")
    parser.add_argument(
        "--workloads",
        nargs="+",
        choices=[w.name for w in WORKLOADS],
        default=["burst32-in32-out128", "single-in32-out256"],
    )
    options = parser.parse_args()
    workloads = [w for w in WORKLOADS if w.name in options.workloads]

    from lmserve.rolling_batch.model.source import local_model_path

    model_dir = local_model_path(None, default_cache_dir())
    builder = PromptBuilder(str(model_dir / "tokenizer.json"), seed=0)
    properties = {**lmserve_properties("fp32"), "option.tensor_parallel_degree": 2}
    runs: dict[str, dict[str, dict]] = {w.name: {} for w in workloads}
    with (
        worker_namespace() as worker,
        running_server(properties, options.port) as (one_host, _),
        running_server(properties, options.port + 1, worker.djl_environment()) as (two, _),
    ):
        for round_ in range(1, options.rounds + 1):
            for w in workloads:
                requests = w.plan(builder, round_)
                suffix = f", round {round_}" if options.rounds > 1 else ""
                runs[w.name][f"TP=2 on one host{suffix}"] = measure(
                    one_host, "lmserve", requests, None, w.concurrency
                )
                runs[w.name][f"TP=2 over two hosts (veth, TCP){suffix}"] = measure(
                    two, "lmserve", requests, None, w.concurrency
                )
    for w in workloads:
        title = f"Tensor parallel across hosts, fp32: {w.describe()}, SmolLM2-135M, 2-core CPU"
        report.write(runs[w.name], options.out / w.name, title)
        print(f"\n{title}\n{report.markdown(runs[w.name])}")


if __name__ == "__main__":
    main()
