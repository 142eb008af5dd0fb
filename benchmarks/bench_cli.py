"""`lmserve bench`: one workload against one or more servers, reported as a markdown table,
JSON and PNG plots.

    lmserve bench --url http://127.0.0.1:8080 --num-requests 32 --input-len 32 --output-len 128
    lmserve bench --config dynamic=dyn.properties --config rolling=roll.properties ...
    lmserve bench --url http://127.0.0.1:8000 --api openai --model NAME ...   # e.g. vLLM

`--config LABEL=FILE` starts lmserve with that serving.properties for its run (then stops it);
`--qps` sends a Poisson stream instead of a burst; `--concurrency N` keeps at most N requests
in flight (N clients in a closed loop; `--concurrency 1` sends them one at a time); lengths are
fixed (`128`) or uniform (`uniform:16:256`); EOS is ignored so output lengths are exact.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from lmserve.properties.config import default_cache_dir
from lmserve.properties.javaprops import parse_properties

from . import loadgen, report, soak
from .serving import running_server
from .workload import Lengths, PromptBuilder, plan, spread_over_adapters

# Requests of a run's plan sent once before it is measured (step_floor drops their steps).
WARMUP_REQUESTS = 2


def add_arguments(parser: argparse.ArgumentParser) -> None:
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument("--url", help="a running server")
    target.add_argument(
        "--config", action="append", metavar="LABEL=FILE", help="serving.properties to start"
    )
    parser.add_argument("--api", choices=["lmserve", "openai"], default="lmserve")
    parser.add_argument("--model", help="model name for --api openai")
    parser.add_argument("--label", default="server", help="row label for --url")
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--input-len", type=Lengths.parse, default=Lengths(32, 32))
    parser.add_argument("--output-len", type=Lengths.parse, default=Lengths(128, 128))
    parser.add_argument("--qps", type=float, help="Poisson arrivals; default: one burst")
    parser.add_argument(
        "--concurrency",
        type=_positive_int,
        help="at most N requests in flight, each client sending its next when one ends",
    )
    parser.add_argument(
        "--shared-prefix",
        type=int,
        default=0,
        metavar="N",
        help="every prompt starts with the same system prompt of N tokens (prefix caching)",
    )
    parser.add_argument(
        "--turns",
        type=_positive_int,
        default=1,
        help="conversations of this many turns, each resending the history (prefix caching);"
        " use --concurrency num-requests/turns so each turn follows its previous one",
    )
    parser.add_argument(
        "--adapters",
        type=lambda text: [name for name in text.split(",") if name],
        default=[],
        metavar="NAME[,NAME...]",
        help="LoRA adapters the requests name, in turn (default: the base model)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tokenizer", type=Path, help="model dir with tokenizer.json")
    parser.add_argument("--out", type=Path, default=Path("bench-results"))
    parser.add_argument("--title", help="plot and table title")
    parser.add_argument("--port", type=int, default=8099, help="for --config servers")
    parser.add_argument(
        "--soak",
        action="store_true",
        help="the soak mix (benchmarks/soak.py) and its survival checks instead of a workload",
    )


def run(args: argparse.Namespace) -> int:
    if args.soak:
        return run_soak(args)
    tokenizer_dir = args.tokenizer or _default_tokenizer_dir()
    builder = PromptBuilder(str(tokenizer_dir / "tokenizer.json"), args.seed)
    planned = plan(
        builder,
        args.num_requests,
        args.input_len,
        args.output_len,
        args.qps,
        args.seed,
        args.shared_prefix,
        args.turns,
    )
    planned = spread_over_adapters(planned, args.adapters)
    arrival = describe_arrival(args.qps, args.concurrency)
    shared = f" after a shared {args.shared_prefix}-token prefix" if args.shared_prefix else ""
    turns = f", conversations of {args.turns} turns" if args.turns > 1 else ""
    turns += f", over {len(args.adapters)} LoRA adapters" if args.adapters else ""
    title = args.title or (
        f"{args.num_requests} requests ({arrival}{turns}), input {args.input_len}{shared}, "
        f"output {args.output_len} tokens"
    )
    runs = {}
    for label, url, properties in _targets(args):
        if properties is None:
            runs[label] = measure(url, args.api, planned, args.model, args.concurrency)
            continue
        with running_server(properties, args.port) as (started_url, _):
            runs[label] = measure(started_url, args.api, planned, args.model, args.concurrency)
        print(f"{label}: {runs[label]['summary']['throughput_tokens_per_s']:.1f} tokens/s")
    written = report.write(runs, args.out, title)
    print(report.markdown(runs))
    print("wrote " + ", ".join(str(p) for p in written))
    return 0 if all(r["summary"]["errors"] == 0 for r in runs.values()) else 1


def run_soak(args: argparse.Namespace) -> int:
    """Exit status 1 when any request was lost or answered badly, or the engine is not idle
    and healthy after."""
    failed = False
    for label, url, properties in _targets(args):
        if properties is None:
            failed |= _soak_one(label, url, args)
            continue
        with running_server(properties, args.port) as (started_url, _):
            failed |= _soak_one(label, started_url, args)
    return 1 if failed else 0


def _soak_one(label: str, url: str, args: argparse.Namespace) -> bool:
    results, wall = soak.run(
        url, args.num_requests, args.concurrency or 64, args.output_len.high, args.seed
    )
    after = soak.settle(url)
    print(f"{label}:\n{soak.table(results, wall, after)}")
    problems = soak.failures(results, after)
    for problem in problems[:20]:
        print(f"  FAILED {problem}")
    return bool(problems)


def describe_arrival(qps: float | None, concurrency: int | None) -> str:
    """How requests arrive, in words: "burst", "one at a time", "Poisson 4.0/s, 8 at a time"."""
    if concurrency is None:
        return "burst" if qps is None else f"Poisson {qps}/s"
    bound = "one at a time" if concurrency == 1 else f"{concurrency} at a time"
    return bound if qps is None else f"Poisson {qps}/s, {bound}"


def measure(
    url: str,
    api: str,
    planned,
    model: str | None,
    concurrency: int | None = None,
    openai_extra: dict | None = None,
) -> dict:
    loadgen.run(url, api, planned[:WARMUP_REQUESTS], model, concurrency, openai_extra)
    wall, results = loadgen.run(url, api, planned, model, concurrency, openai_extra)
    return {
        "url": url,
        "summary": report.summarize(wall, results),
        "requests": [r.to_dict() for r in results],
    }


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _targets(args):
    if args.url:
        yield args.label, args.url.rstrip("/"), None
        return
    for spec in args.config:
        label, _, path = spec.partition("=")
        if not path:
            label, path = Path(spec).stem, spec
        entries = parse_properties(Path(path).read_text())
        yield label, None, {entry.key: entry.value for entry in entries}


def _default_tokenizer_dir() -> Path:
    from lmserve.rolling_batch.model.source import local_model_path

    return local_model_path(None, default_cache_dir())
