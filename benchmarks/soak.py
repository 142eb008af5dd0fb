"""A soak: a mix of every kind of request a server meets, at high concurrency, then the checks
that say the server survived it whole.

    lmserve bench --soak --url http://127.0.0.1:8080 --num-requests 2000 --concurrency 64

Kinds, in a seeded random order: plain (non-streamed text), streamed (jsonlines), dropped (a
stream the client abandons after its first event), chat (OpenAI chat), sampled (seeded
temperature/top-p), list (two inputs), completion (OpenAI completions) and malformed (bad JSON,
a bad parameter: must be a 400 naming the field). Every request but a dropped one must get
exactly one well-formed answer: a 200 of its kind's shape, or a JSON error (a 503 from a full
queue counts as answered). Then, within `settle_s`: `/ping` healthy, no request running or
waiting, no KV block in use.
"""

from __future__ import annotations

import json
import random
import statistics
import time
from collections import Counter, defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import requests

KINDS = ("plain", "streamed", "dropped", "chat", "sampled", "list", "completion", "malformed")
_PROMPTS = (
    "The capital of France is",
    "Write a haiku about the sea.",
    "List three prime numbers:",
    "Once upon a time, in a small village,",
)


@dataclass
class SoakResult:
    kind: str
    status: int | None = None
    latency: float | None = None
    problem: str | None = None  # why the answer is missing or malformed (None: fine)


def run(url: str, num_requests: int, concurrency: int, max_tokens: int, seed: int = 0):
    """(results in send order, wall seconds)."""
    rng = random.Random(seed)
    plan = [
        (rng.choice(KINDS), rng.choice(_PROMPTS), rng.randrange(1 << 30))
        for _ in range(num_requests)
    ]
    started = time.monotonic()
    with ThreadPoolExecutor(concurrency) as clients:
        results = list(clients.map(lambda p: _send(url, *p, max_tokens), plan))
    return results, time.monotonic() - started


def _send(url: str, kind: str, prompt: str, seed: int, max_tokens: int) -> SoakResult:
    result = SoakResult(kind)
    sent = time.monotonic()
    try:
        response = _request(url, kind, prompt, seed, max_tokens)
        with response:
            result.status = response.status_code
            result.problem = _check(kind, response)
    except (requests.RequestException, ValueError) as error:
        result.problem = f"no answer: {type(error).__name__}: {error}"
    result.latency = time.monotonic() - sent
    return result


def _request(url: str, kind: str, prompt: str, seed: int, max_tokens: int):
    parameters = {"max_new_tokens": max_tokens}
    post = lambda path, **kw: requests.post(url + path, timeout=600, **kw)  # noqa: E731
    if kind == "plain":
        return post("/invocations", json={"inputs": prompt, "parameters": parameters})
    if kind in ("streamed", "dropped"):
        body = {"inputs": prompt, "parameters": parameters, "stream": True}
        return post("/invocations", json=body, stream=True)
    if kind == "chat":
        messages = [{"role": "user", "content": prompt}]
        body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0}
        return post("/v1/chat/completions", json=body)
    if kind == "sampled":
        sampled = {**parameters, "do_sample": True, "temperature": 0.8, "top_p": 0.9, "seed": seed}
        return post("/invocations", json={"inputs": prompt, "parameters": sampled})
    if kind == "list":
        return post(
            "/invocations", json={"inputs": [prompt, prompt[::-1]], "parameters": parameters}
        )
    if kind == "completion":
        body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
        return post("/v1/completions", json=body)
    bad = b'{"inputs": "x", "parameters": {"max_new_tokens": -1}}' if seed % 2 else b"{oops"
    return post("/invocations", data=bad, headers={"content-type": "application/json"})


def _check(kind: str, response: requests.Response) -> str | None:
    """None when the answer is well formed for its kind; else what is wrong with it."""
    status = response.status_code
    if kind == "dropped":
        next(response.iter_lines(), None)  # the first event, then the client walks away
        return None
    if kind == "malformed":
        if status != 400:
            return f"malformed request got {status}"
        return None if response.json().get("field") else "400 without the field named"
    if status != 200:
        body = response.json()
        detail = body.get("error") if isinstance(body.get("error"), dict) else body
        if status == 503 and detail.get("message"):
            return None  # a full queue, answered: not lost
        return f"{status}: {str(body)[:200]}"
    if kind == "streamed":
        events = [json.loads(line) for line in response.iter_lines() if line]
        return None if events and "generated_text" in events[-1] else "stream without its end"
    body = response.json()
    if kind in ("plain", "sampled"):
        return None if isinstance(body.get("generated_text"), str) else "no generated_text"
    if kind == "list":
        return None if isinstance(body, list) and len(body) == 2 else "not two outputs"
    if kind == "chat":
        return None if body["choices"][0]["message"]["content"] is not None else "no content"
    return None if isinstance(body["choices"][0]["text"], str) else "no completion text"


def settle(url: str, settle_s: float = 10.0) -> dict:
    """Waits until the engine is idle (or `settle_s` passes); its last stats and /ping."""
    deadline = time.monotonic() + settle_s
    name = requests.get(f"{url}/models", timeout=10).json()["models"][0]["modelName"]
    while True:
        stats = requests.get(f"{url}/models/{name}", timeout=10).json()["engine"]["stats"]
        idle = stats.get("num_running", 0) == 0 and stats.get("num_waiting", 0) == 0
        if (idle and stats.get("kv_blocks_used", 0) == 0) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    return {"stats": stats, "ping": requests.get(f"{url}/ping", timeout=10).status_code}


def failures(results: list[SoakResult], after: dict) -> list[str]:
    """What went wrong, in words; empty when the server survived the soak whole."""
    problems = [f"{r.kind}: {r.problem}" for r in results if r.problem]
    stats = after["stats"]
    if after["ping"] != 200:
        problems.append(f"/ping answered {after['ping']} after the soak")
    for key in ("num_running", "num_waiting", "kv_blocks_used"):
        if stats.get(key, 0):
            problems.append(f"{key}={stats[key]} after the soak settled")
    return problems


def table(results: list[SoakResult], wall_s: float, after: dict) -> str:
    by_kind: dict[str, list[SoakResult]] = defaultdict(list)
    for result in results:
        by_kind[result.kind].append(result)
    lines = [
        "| kind | requests | statuses | not answered well | latency p50 (s) | p99 (s) |",
        "|---|---|---|---|---|---|",
    ]
    for kind in KINDS:
        group = by_kind.get(kind, [])
        if not group:
            continue
        statuses = Counter(r.status for r in group)
        shown = ", ".join(f"{s}: {n}" for s, n in sorted(statuses.items(), key=str))
        latencies = sorted(r.latency for r in group if r.latency is not None)
        bad = sum(1 for r in group if r.problem)
        lines.append(
            f"| {kind} | {len(group)} | {shown} | {bad} | {statistics.median(latencies):.2f} |"
            f" {_percentile(latencies, 0.99):.2f} |"
        )
    stats = after["stats"]
    lines.append(
        f"\n{len(results)} requests in {wall_s:.0f} s; after: /ping {after['ping']},"
        f" running {stats.get('num_running')}, waiting {stats.get('num_waiting')},"
        f" KV blocks in use {stats.get('kv_blocks_used')}"
    )
    return "\n".join(lines)


def _percentile(values: list[float], share: float) -> float:
    return values[min(len(values) - 1, int(share * len(values)))]
