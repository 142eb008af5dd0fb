"""benchmarks/gpu_bench.py, the one device run of issue 57: its roofline counts an 8B Llama as
published, and its dry run on the CPU (the same code on a 2-layer shape) times every planned
step against a floor, so the script a device session spends its minutes on has already run."""

from __future__ import annotations

import json

import pytest

from lmserve.benchmarks import gpu_bench
from lmserve.benchmarks.gpu_roofline import Ceilings, LlamaShape

LLAMA_31_8B = {
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "tie_word_embeddings": False,
}


def test_the_roofline_counts_llama_3_8b_as_published():
    shape = LlamaShape.of(LLAMA_31_8B)
    assert shape.num_params == 8_030_261_248  # "8.03B", 16.06 GB in bf16
    # A decode step reads every weight but the embedding table (only its rows), then the
    # K/V of its 511 cached tokens and its own, 128 KiB a token in bf16.
    one = shape.decode_bytes(batch=1, context=511)
    assert one == pytest.approx(16.06e9 - 128256 * 4096 * 2 + 512 * 2**17, rel=1e-4)
    assert shape.decode_bytes(1, 1023) - one == 512 * 32 * 8 * 128 * 2 * 2  # K and V, bf16
    ceilings = Ceilings(3.35e12, 3.0e12, 700e12, 8192)
    floor, bound = ceilings.floor_s(one, shape.decode_flops(1, 511))
    assert bound == "memory" and floor == pytest.approx(4.49e-3, rel=0.01)
    # A 2k prompt is bound by its matmuls: 2 flops a decoder weight a token (the LM head for
    # the last token only), plus 4% for attention.
    decoder = shape.num_params - 2 * 128256 * 4096
    assert shape.prefill_flops(2048) == pytest.approx(2 * decoder * 2048 * 1.04, rel=0.01)
    assert ceilings.floor_s(one, shape.prefill_flops(2048))[1] == "matmul"


def test_the_dry_run_times_every_planned_step_against_its_floor(smollm2_dir, tmp_path):
    folder = gpu_bench.write_model_folder(tmp_path / "tiny", "tiny", smollm2_dir)
    plan = gpu_bench.TINY

    status = gpu_bench.run(plan, folder, tmp_path / "out", 600, served=False, hf=False)

    results = json.loads((tmp_path / "out" / "gpu_bench.json").read_text())
    assert status == 0 and results["errors"] == {} and "kernel_errors" not in results["engine"]
    steps = results["engine"]["steps"]
    # On a CPU the one attention there is ("cpu"); on a GPU each CUDA kernel in turn.
    assert {(s["kernel"], s["mode"], s["batch"], s["context"]) for s in steps} == {
        ("cpu", "eager", b, c) for b in plan.batches for c in plan.contexts
    }
    assert all(s["step_s"] > 0 and s["inputs_s"] > 0 for s in steps)
    offline = results["engine"]["offline"]["cpu, eager"]
    assert offline["tokens"] == plan.batch * plan.batch_output  # EOS ignored: exact lengths
    table = (tmp_path / "out" / "gpu_bench.md").read_text()
    assert f"| decode | cpu | eager | {plan.batches[-1]} | {plan.contexts[-1]} |" in table
    assert f"| first token | cpu | eager | 1 | {plan.prompt} prompt |" in table
    assert "(memory)" in table or "(matmul)" in table
    assert (tmp_path / "out" / "profile-cpu.txt").stat().st_size > 0


def test_a_kernel_failing_on_the_device_is_reported_and_the_run_goes_on(
    smollm2_dir, tmp_path, monkeypatch
):
    def fails(kernel, work, found):
        raise RuntimeError(f"{kernel} did not compile")

    monkeypatch.setattr(gpu_bench, "_time_kernel", fails)
    folder = gpu_bench.write_model_folder(tmp_path / "tiny", "tiny", smollm2_dir)

    status = gpu_bench.run(gpu_bench.TINY, folder, tmp_path / "out", 600, served=False, hf=False)

    assert status == 1
    results = json.loads((tmp_path / "out" / "gpu_bench.json").read_text())
    assert results["engine"]["load_s"] > 0  # what was measured before the failure stays
    assert "ceilings" in results
    table = (tmp_path / "out" / "gpu_bench.md").read_text()
    assert "engine with cpu: FAILED: RuntimeError: cpu did not compile" in table
