"""step_floor: a traced step's floor is its arithmetic at the machine's matmul rate or its
bytes at the machine's stream, whichever is longer, and with its K/V apart, the K/V's bytes
after that; steps are grouped by kind and summed in the table; a trace replays offline on the
runtime, step by step."""

from __future__ import annotations

import json

import pytest

from lmserve.benchmarks.step_floor import (
    Chunk,
    Machine,
    ModelShape,
    TracedStep,
    burst_steps,
    floor_seconds,
    kv_apart_floor_seconds,
    read_trace,
    replay_seconds,
    table,
)

# Q, K, V, O: 4 x (2 + 2) x 2 + 2 x 2 x 4 = 48; gate, up, down: 3 x 4 x 8 = 96. 144 a layer.
SHAPE = ModelShape(
    hidden=4, intermediate=8, layers=2, q_heads=2, kv_heads=1, head_dim=2, vocab=10, element_bytes=4
)
PROMPT = TracedStep((Chunk(3, 0, True, False),), {"forward": 4.0})
DECODE = TracedStep((Chunk(1, 5, True, True),), {"forward": 2.0, "send": 1.0})


def test_a_prompt_step_bound_by_arithmetic_takes_its_flops_at_the_matmul_rate():
    # 3 rows x 144 x 2 layers x 2 = 1728; the fp32 head for its last row 2 x 4 x 10 = 80;
    # attention over 1 + 2 + 3 keys, 4 x 6 x 2 heads x 2 dims x 2 layers = 192.
    assert floor_seconds(PROMPT, SHAPE, Machine(flops=1000.0, stream=1e12)) == pytest.approx(2.0)


def test_a_greedy_decode_step_bound_by_memory_takes_its_bytes_at_the_stream_rate():
    # Weights 144 x 2 and K/V of 6 keys x 2 x 2 dims x 2 layers = 48, 336 values of 4 bytes;
    # the greedy head reads its bf16 copy, 40 values of 2 bytes.
    assert floor_seconds(DECODE, SHAPE, Machine(flops=1e12, stream=1000.0)) == pytest.approx(1.424)


def test_a_greedy_rows_head_counts_at_the_bf16_rate():
    greedy_prompt = TracedStep((Chunk(3, 0, True, True),), {"forward": 4.0})
    # As the prompt above, with the head's 80 flops at twice the rate: 1960.
    assert floor_seconds(greedy_prompt, SHAPE, Machine(1000.0, 1e12)) == pytest.approx(1.96)


def test_a_steps_kv_read_adds_to_its_arithmetic_where_the_kv_is_apart():
    machine = Machine(flops=1000.0, stream=2000.0)
    # The decode above: 576 + the greedy head's 40 + attention's 192 = 808 flops, 0.808 s;
    # weights and head 1,232 bytes, 0.616 s, under them; K/V 192 bytes, 0.096 s.
    assert floor_seconds(DECODE, SHAPE, machine) == pytest.approx(0.808)
    assert kv_apart_floor_seconds(DECODE, SHAPE, machine) == pytest.approx(0.904)
    # Bound by its bytes, the step reads them all one after the other either way.
    slow_stream = Machine(flops=1000.0, stream=1000.0)
    assert kv_apart_floor_seconds(DECODE, SHAPE, slow_stream) == pytest.approx(1.424)


def test_a_trace_reads_back_and_its_steps_sum_by_kind(tmp_path):
    path = tmp_path / "steps.jsonl"
    lines = [
        {"t": 1.0, "chunks": [[3, 0, True, False]], "phases": {"forward": 4.0}},
        {"t": 2.0, "chunks": [[1, 5, True, True]], "phases": {"forward": 2.0, "send": 1.0}},
        {"t": 3.0, "chunks": [[1, 5, True, True]], "phases": {"forward": 2.0, "send": 1.0}},
    ]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    steps = read_trace(path)
    assert steps == [PROMPT, DECODE, DECODE]
    assert [step.group for step in steps] == ["with prompt chunks", *["decode, 1-7 rows"] * 2]
    floors, kv_apart, offline = [2.0, 1.0, 1.0], [3.0, 1.5, 1.5], [2.0, 1.0, 1.0]
    rows = table(steps, floors, kv_apart, offline).splitlines()[2:]
    assert rows == [
        "| with prompt chunks | 1 | 3 | 4.00 | 4.00 | 2.00 | 50% | 3.00 | 75% | 2.00 | 2.000 |",
        "| decode, 1-7 rows | 2 | 2 | 6.00 | 4.00 | 2.00 | 50% | 3.00 | 75% | 2.00 | 2.000 |",
        "| all | 3 | 5 | 10.00 | 8.00 | 4.00 | 50% | 6.00 | 75% | 4.00 | 2.000 |",
    ]


def test_a_bursts_steps_start_at_its_first_step_of_more_than_two_sequences():
    burst = TracedStep((Chunk(3, 0, True, False),) * 3, {"forward": 4.0})
    tail = TracedStep((Chunk(1, 5, True, True),) * 2, {"forward": 2.0})
    assert burst_steps([PROMPT, DECODE, DECODE, burst, tail, DECODE]) == [burst, tail, DECODE]
    assert burst_steps([PROMPT, DECODE]) == []


def test_a_trace_replays_every_step_offline(tiny_model_dir):
    steps = [
        TracedStep((Chunk(5, 0, True, False), Chunk(4, 0, True, True)), {"forward": 1.0}),
        TracedStep((Chunk(1, 5, True, False), Chunk(1, 4, True, True)), {"forward": 1.0}),
        TracedStep((Chunk(1, 6, True, False),), {"forward": 1.0}),
    ]
    seconds = replay_seconds(steps, tiny_model_dir, "fp32", passes=1)
    assert len(seconds) == 3 and all(0 < s < 10 for s in seconds)
