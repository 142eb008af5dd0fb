"""Sends a planned workload over HTTP and times every request: streaming, so the time to the
first token is seen. Speaks lmserve's `/invocations` (jsonlines stream) and the OpenAI
`/v1/completions` API (SSE), so the same workload can run against other servers."""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass

import requests

from .workload import PlannedRequest


@dataclass
class RequestResult:
    input_tokens: int
    output_tokens_requested: int
    output_tokens: int = 0
    sent_at: float = 0.0  # seconds after the start of the run
    ttft: float | None = None  # seconds from sending to the first token
    latency: float | None = None  # seconds from sending to the last byte
    error: str | None = None

    def to_dict(self) -> dict:
        return asdict(self)


def run(
    url: str,
    api: str,
    planned: list[PlannedRequest],
    model: str | None,
    concurrency: int | None = None,
    openai_extra: dict | None = None,
) -> tuple[float, list]:
    """(wall seconds, results in plan order). `concurrency` bounds the requests in flight: N
    clients each send their next request when the last one ends (a closed loop; 1 sends them
    one at a time). None: every request at its planned time. `openai_extra`: more fields of
    each OpenAI request (a server that ignores `ignore_eos` gets the EOS ids' logit_bias)."""
    start = time.monotonic()
    results = [RequestResult(p.input_tokens, p.output_tokens) for p in planned]
    lock = threading.Lock()

    def send(index: int) -> None:
        request = planned[index]
        delay = start + request.send_at - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        result = results[index]
        result.sent_at = time.monotonic() - start
        try:
            _one(url, api, request, model, result, openai_extra or {})
        except (requests.RequestException, ValueError, KeyError) as error:
            with lock:
                result.error = f"{type(error).__name__}: {error}"

    # The pool's workers are the clients: its queue hands out requests in plan order, and a
    # request's planned time is only ever waited for, never brought forward.
    clients = len(planned) if concurrency is None else min(concurrency, len(planned))
    with ThreadPoolExecutor(max(1, clients)) as pool:
        list(pool.map(send, range(len(planned))))
    return time.monotonic() - start, results


def _one(url: str, api: str, request: PlannedRequest, model: str | None, result, extra) -> None:
    sent = time.monotonic()
    if api == "openai":
        body = {
            "model": request.adapter or model,  # an adapter's name is its model name
            "prompt": request.prompt,
            "max_tokens": request.output_tokens,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
            **extra,
        }
        path = "/v1/completions"
    else:
        parameters = {"max_new_tokens": request.output_tokens, "ignore_eos_token": True}
        body = {"inputs": request.prompt, "parameters": parameters, "stream": True}
        if request.adapter is not None:
            body["adapters"] = request.adapter
        path = "/invocations"
    with requests.post(url + path, json=body, stream=True, timeout=3600) as response:
        if response.status_code != 200:
            result.error = f"HTTP {response.status_code}: {response.text[:200]}"
            return
        usage_tokens = None
        for line in response.iter_lines():
            event = _event(api, line)
            if event is None:
                continue
            if "error" in event:
                raise ValueError(event["error"])
            if event.get("usage"):  # OpenAI's last chunk: the exact count
                usage_tokens = event["usage"]["completion_tokens"]
            if _carries_token(api, event):
                if result.ttft is None:
                    result.ttft = time.monotonic() - sent
                result.output_tokens += 1
        if usage_tokens is not None:
            result.output_tokens = usage_tokens
    result.latency = time.monotonic() - sent


def _event(api: str, line: bytes) -> dict | None:
    if not line:
        return None
    if api == "openai":
        if not line.startswith(b"data: ") or line == b"data: [DONE]":
            return None
        return json.loads(line[6:])
    return json.loads(line)


def _carries_token(api: str, event: dict) -> bool:
    if api == "openai":
        choices = event.get("choices") or []
        return bool(choices) and choices[0].get("text") is not None
    return "token" in event
