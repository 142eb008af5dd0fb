"""benchmarks/generic_path.py measures both paths on the same folder."""

from __future__ import annotations

from lmserve.benchmarks.generic_path import compare


def test_both_paths_are_measured_on_the_same_folder(tiny_model_dir):
    result = compare(tiny_model_dir, "fp32", batch=2, prompt_len=8, steps=2, rounds=1)
    assert set(result) == {"auto", "transformers"}
    assert all(prefill > 0 and decode > 0 for prefill, decode in result.values())
