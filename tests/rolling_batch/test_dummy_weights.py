"""option.load_format=dummy: a folder with config.json and a tokenizer, no checkpoint, serves
random weights (what benchmarks/gpu_bench.py times an 8B-shaped model with)."""

from __future__ import annotations

import json
import shutil

import pytest

from lmserve.rolling_batch import LLM
from lmserve.rolling_batch.model.source import ModelSourceError

from ..conftest import TEST_CACHE_DIR, TOKENIZER_FILES

PROMPTS = ["The capital of France is", "def fibonacci(n):"]


@pytest.fixture(scope="module")
def config_only_dir(tiny_model_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("config-only")
    for name in ("config.json", *TOKENIZER_FILES):
        if (tiny_model_dir / name).exists():
            shutil.copy(tiny_model_dir / name, folder / name)
    return folder


def generate(folder, **options) -> list[list[int]]:
    with LLM(folder, cache_dir=TEST_CACHE_DIR, max_model_len=128, dtype="fp32", **options) as llm:
        model = llm._engine.runner.model
        norms = [p for name, p in model.named_parameters() if name.endswith("norm.weight")]
        assert norms and all(bool((p == 1).all()) for p in norms)  # no activation blow-up
        results = llm.generate(PROMPTS, max_new_tokens=8, ignore_eos=True)
    return [r.token_ids for r in results]


def test_a_config_alone_serves_the_same_random_model_every_time(config_only_dir):
    first = generate(config_only_dir, load_format="dummy")
    assert [len(ids) for ids in first] == [8, 8]
    assert first[0] != first[1]  # the prompts are read: not one token for everything
    assert generate(config_only_dir, load_format="dummy") == first


def test_without_dummy_the_folder_is_refused_for_its_missing_weights(config_only_dir):
    with pytest.raises(ModelSourceError, match=r"config\.json but no \*\.safetensors"):
        LLM(config_only_dir, cache_dir=TEST_CACHE_DIR)


def test_dummy_weights_quantize_at_load(config_only_dir):
    ids = generate(config_only_dir, load_format="dummy", quantize="int8")
    assert [len(t) for t in ids] == [8, 8]


def test_the_generic_path_draws_transformers_own_initialization(config_only_dir):
    with LLM(
        config_only_dir,
        cache_dir=TEST_CACHE_DIR,
        max_model_len=128,
        dtype="fp32",
        load_format="dummy",
        model_impl="transformers",
    ) as llm:
        (result,) = llm.generate(PROMPTS[:1], max_new_tokens=4, ignore_eos=True)
    assert len(result.token_ids) == 4


def test_a_quantized_checkpoints_config_is_refused(config_only_dir, tmp_path):
    folder = tmp_path / "awq"
    shutil.copytree(config_only_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": 32}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="load_format=dummy fills dense weights"):
        LLM(folder, cache_dir=TEST_CACHE_DIR, load_format="dummy")
