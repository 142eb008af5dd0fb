"""A benchmark run's summary, and two servers' rounds set side by side split where a burst's
last request got its first token (what vllm_compare prints for each burst)."""

from __future__ import annotations

from lmserve.benchmarks import report
from lmserve.benchmarks.loadgen import RequestResult


def _result(sent_at, ttft, latency, tokens, error=None):
    result = RequestResult(input_tokens=8, output_tokens_requested=tokens)
    result.sent_at, result.ttft, result.latency = sent_at, ttft, latency
    result.output_tokens = 0 if error else tokens
    result.error = error
    return result


def _run(wall, results):
    return {"summary": report.summarize(wall, results)}


def test_the_last_first_token_counts_from_the_start_of_the_run():
    results = [
        _result(0.0, 3.0, 9.0, 40),
        _result(0.5, 4.0, 7.0, 30),  # its first token at 4.5 s: the last
        _result(0.0, 1.0, 2.0, 10),
        _result(0.0, None, None, 0, error="ConnectionError: refused"),  # counts nowhere
    ]
    summary = report.summarize(10.0, results)
    assert summary["all_first_tokens_s"] == 4.5
    assert summary["errors"] == 1
    assert summary["throughput_tokens_per_s"] == 8.0


def test_head_to_head_sums_rounds_and_splits_them_at_the_last_first_token():
    ours = [
        _run(20.0, [_result(0.0, 8.0, 20.0, 300)]),
        _run(10.0, [_result(0.0, 4.0, 10.0, 200)]),
    ]
    peer = [
        _run(30.0, [_result(0.0, 9.0, 30.0, 300)]),
        _run(16.0, [_result(0.0, 3.0, 16.0, 200)]),
    ]
    table = report.head_to_head(list(zip(ours, peer)), "lmserve", "vLLM")
    lines = table.splitlines()
    assert lines[0] == "| 2 rounds | lmserve | vLLM | lmserve's speed-up |"
    # tokens/s: (15 + 20) against (10 + 12.5); prompts' part: 12 s against 12 s; after: 18
    # against 34 s
    assert lines[2] == "| tokens/s, summed over rounds | 35.0 | 22.5 | 1.56x |"
    assert lines[3] == "| s until every request's first token | 12.00 | 12.00 | 1.00x |"
    assert lines[4] == "| s after it, to the last token | 18.00 | 34.00 | 1.89x |"


def test_head_to_head_of_a_run_without_any_first_token_is_empty():
    failed = _run(5.0, [_result(0.0, None, None, 0, error="HTTPError: 500")])
    fine = _run(5.0, [_result(0.0, 1.0, 5.0, 10)])
    assert report.head_to_head([(failed, fine)], "lmserve", "vLLM") == ""
