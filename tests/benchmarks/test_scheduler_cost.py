"""scheduler_cost: a burst sharing a prompt runs to the end through the scheduler alone, every
request finishing, and the table reports the cache on and off."""

from __future__ import annotations

import argparse

from lmserve.benchmarks.scheduler_cost import main, run_round

ARGS = argparse.Namespace(
    requests=6, per_step=2, system=40, own=5, new_tokens=3, block_size=4, num_blocks=64,
    max_rolling_batch_size=4, prefill_budget=32,
)  # fmt: skip


def test_a_round_runs_every_request_to_its_end():
    # 6 requests of 45 prompt tokens and 3 new ones: with the prompt cached after the first,
    # fewer steps than with every prompt prefilled whole.
    _, steps_cached = run_round(ARGS, caching=True, seed=0)
    _, steps_uncached = run_round(ARGS, caching=False, seed=0)
    assert 0 < steps_cached < steps_uncached


def test_the_table_has_a_row_for_the_cache_on_and_off(capsys):
    main(["--requests", "4", "--system", "32", "--own", "4", "--new-tokens", "2", "--rounds", "1"])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| o")]
    assert [row.split("|")[1].strip() for row in rows] == ["on", "off"]
