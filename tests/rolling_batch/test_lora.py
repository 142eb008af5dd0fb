"""LoRA adapters in the rolling batch: PEFT adapters made here on the tiny Llama (different
targets, ranks and scalings, rsLoRA among them), served in one batch mixing them with the base
model, against HF + PEFT token for token: TP=1 and TP=2, paged and contiguous, with fewer
slots than adapters. And clear refusals of what is not served."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from lmserve.rolling_batch import LLM
from lmserve.rolling_batch.lora.adapters import linear_shapes, load_adapter
from lmserve.rolling_batch.model.layers.parallel import TensorParallelGroup
from lmserve.rolling_batch.model.weights.loader import load_hf_config

from ..conftest import TEST_CACHE_DIR, save_tiny_llama
from ..hf_reference import VARIED_PROMPTS, assert_same_or_near_tie, hf_greedy_alone
from ..lora_adapters import TINY_ADAPTERS, peft_model, save_adapter, save_adapters

MAX_NEW_TOKENS = 12
PROMPTS = VARIED_PROMPTS[:8]


@pytest.fixture(scope="module")
def lora_model_dir(smollm2_dir, tmp_path_factory):
    folder = save_tiny_llama(
        tmp_path_factory.mktemp("tiny-lora"), smollm2_dir, intermediate_size=96, hidden_size=64
    )
    save_adapters(folder)
    return folder


@pytest.fixture(scope="module")
def reference(lora_model_dir):
    """{(prompt index, adapter): (HF + PEFT's greedy tokens, their logits)}, every prompt with
    every adapter and with none."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(lora_model_dir)
    expected = {}
    for adapter in [None, *TINY_ADAPTERS]:
        model = peft_model(lora_model_dir, adapter)
        for index, prompt in enumerate(PROMPTS):
            ids = tokenizer(prompt)["input_ids"]
            expected[index, adapter] = hf_greedy_alone(model, ids, MAX_NEW_TOKENS)
    return expected


def mixed_batch() -> tuple[list[str], list[str | None]]:
    """Every prompt with every adapter and with the base model, interleaved so each step mixes
    them."""
    adapters = [None, *TINY_ADAPTERS]
    pairs = [(p, a) for i, p in enumerate(PROMPTS) for a in adapters[i % 2 :] + adapters[: i % 2]]
    return [p for p, _ in pairs], [a for _, a in pairs]


def assert_matches_reference(results, prompts, adapters, reference):
    for prompt, adapter, result in zip(prompts, adapters, results):
        expected, logits = reference[PROMPTS.index(prompt), adapter]
        assert_same_or_near_tie(result.token_ids, expected, logits)


def test_adapters_change_what_the_model_says(reference):
    """The test adapters matter: each one's greedy text differs from the base model's."""
    for adapter in TINY_ADAPTERS:
        changed = [reference[i, adapter][0] != reference[i, None][0] for i in range(len(PROMPTS))]
        assert sum(changed) >= len(PROMPTS) // 2, adapter


def test_peft_merged_model_agrees_with_peft(lora_model_dir, reference):
    """The reference holds either way PEFT applies an adapter (unmerged layers, merged
    weights)."""
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(lora_model_dir)(PROMPTS[0])["input_ids"]
    for adapter in TINY_ADAPTERS:
        merged = peft_model(lora_model_dir, adapter, merged=True)
        tokens, _ = hf_greedy_alone(merged, ids, MAX_NEW_TOKENS)
        assert tokens == reference[0, adapter][0]


@pytest.mark.parametrize(
    ("paged", "max_loras"),
    [(True, 4), (False, 4), (True, 2)],
    ids=["paged", "contiguous", "two-slots"],
)
def test_mixed_batch_matches_peft(lora_model_dir, reference, paged, max_loras):
    """Three adapters and the base model in the same steps give HF + PEFT's tokens; with two
    slots for three adapters, requests wait for a slot and adapters take turns in them."""
    prompts, adapters = mixed_batch()
    with LLM(
        lora_model_dir,
        dtype="fp32",
        max_model_len=256,
        paged_attention=paged,
        enable_lora=True,
        max_loras=max_loras,
        cache_dir=TEST_CACHE_DIR,
    ) as llm:
        results = llm.generate(prompts, MAX_NEW_TOKENS, ignore_eos=True, adapters=adapters)
    assert_matches_reference(results, prompts, adapters, reference)


def test_tensor_parallel_matches_peft(lora_model_dir, reference):
    """TP=2: adapter weights shard like the linears they modify (column-parallel B rows,
    row-parallel A columns)."""
    prompts, adapters = mixed_batch()
    with LLM(
        lora_model_dir,
        tensor_parallel_degree=2,
        dtype="fp32",
        max_model_len=256,
        enable_lora=True,
        cache_dir=TEST_CACHE_DIR,
    ) as llm:
        results = llm.generate(prompts, MAX_NEW_TOKENS, ignore_eos=True, adapters=adapters)
    assert_matches_reference(results, prompts, adapters, reference)


def test_unknown_adapter_is_refused_by_name(lora_model_dir):
    with LLM(lora_model_dir, dtype="fp32", max_model_len=256, enable_lora=True) as llm:
        with pytest.raises(ValueError, match="no LoRA adapter named 'nope'.*served: attn"):
            llm.generate(["Hello"], 2, adapters="nope")
    with LLM(lora_model_dir, dtype="fp32", max_model_len=256) as llm:
        with pytest.raises(ValueError, match="LoRA is off"):
            llm.generate(["Hello"], 2, adapters="attn")


@pytest.fixture
def shapes(lora_model_dir):
    return linear_shapes(load_hf_config(lora_model_dir))


def test_rank_above_max_lora_rank_is_refused(lora_model_dir, shapes):
    folder = lora_model_dir / "adapters" / "everything"
    with pytest.raises(ValueError, match=r"'everything'.*rank 8: above option.max_lora_rank=4"):
        load_adapter("everything", folder, 4, shapes, torch.float32)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"use_dora": True}, "DoRA"),
        ({"bias": "all"}, "bias='all'"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
        ({"peft_type": "IA3"}, "only LORA"),
        ({"alpha_pattern": {"q_proj": 4}}, "alpha_pattern"),
    ],
)
def test_what_is_not_served_is_refused(lora_model_dir, shapes, tmp_path, change, message):
    folder = shutil.copytree(lora_model_dir / "adapters" / "attn", tmp_path / "attn")
    config = json.loads((folder / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(ValueError, match=f"adapter 'odd': .*{message}"):
        load_adapter("odd", folder, 16, shapes, torch.float32)


def test_adapter_on_the_embedding_is_refused(lora_model_dir, shapes, tmp_path):
    scratch = shutil.copytree(lora_model_dir, tmp_path / "model", ignore=_only_model_files)
    folder = save_adapter(scratch, "embed", ["embed_tokens", "q_proj"], 4, 8, False, seed=9)
    with pytest.raises(ValueError, match="'embed': .*model.embed_tokens"):
        load_adapter("embed", folder, 16, shapes, torch.float32)


def test_adapter_for_another_model_is_refused(lora_model_dir, smollm2_dir, tmp_path):
    """An adapter trained on a wider model does not fit this one's linears."""
    wider = save_tiny_llama(tmp_path / "wider", smollm2_dir, hidden_size=96)
    folder = save_adapter(wider, "wide", ["q_proj"], 4, 8, False, seed=3)
    shapes = linear_shapes(load_hf_config(lora_model_dir))
    with pytest.raises(ValueError, match=r"'wide': .*q_proj: lora_A \(4, 96\)"):
        load_adapter("wide", folder, 16, shapes, torch.float32)


def test_slots_are_reused_without_leftovers(lora_model_dir):
    """An adapter put in a slot another held before sees none of the other's weights: the
    one-slot engine serving adapters in turn gives each its own tokens."""
    prompt = [1, 504, 3458, 282, 4649, 314]
    options = {"max_loras": 1, "max_cpu_loras": 1}
    with LLM(lora_model_dir, dtype="fp32", max_model_len=128, enable_lora=True, **options) as llm:

        def generate(adapter):
            return llm.generate([prompt], 8, ignore_eos=True, adapters=adapter)[0].token_ids

        first = {name: generate(name) for name in TINY_ADAPTERS}
        again = {name: generate(name) for name in reversed(TINY_ADAPTERS)}
        loaded = list(llm._engine.runner.lora.loaded)
    assert first == again
    assert len(set(map(tuple, first.values()))) == len(TINY_ADAPTERS)
    assert loaded == ["attn"]  # max_cpu_loras=1: the last one asked for


def test_the_weights_digest_follows_the_files_read(lora_model_dir, tmp_path):
    """What the prefix cache roots an adapter's blocks at: a digest of the weights as read,
    none while the next step would read them first, another one once the files changed."""
    from lmserve.rolling_batch.model.runner_setup import RuntimeOptions, build_runner

    model_dir = shutil.copytree(lora_model_dir, tmp_path / "model")
    options = RuntimeOptions(
        dtype="fp32", max_model_len=128, enable_lora=True, max_loras=1, max_cpu_loras=1
    )
    lora = build_runner(model_dir, options, TensorParallelGroup())[0].lora
    first, second = list(TINY_ADAPTERS)[:2]
    lora.adapter(first)
    digest = lora.weights_digest(first)
    assert digest is not None and digest != lora.adapter(second).digest
    assert lora.weights_digest(first) is None  # max_cpu_loras=1: unloaded, read again if used
    assert lora.adapter(first).digest == digest  # the same files: the same digest
    lora.adapter(second)
    save_adapter(model_dir, first, *TINY_ADAPTERS[first], seed=99)  # new weights, same name
    assert lora.adapter(first).digest not in (digest, None)
    assert lora.weights_digest(first) == lora.adapter(first).digest


def _only_model_files(directory, names):
    return [name for name in names if name == "adapters"]


SMOLLM2_ADAPTERS = {
    "smol-attn": (["q_proj", "k_proj", "v_proj", "o_proj"], 8, 4, False),
    "smol-mlp": (["gate_proj", "up_proj", "down_proj"], 16, 4, True),
}


@pytest.fixture(scope="module")
def smollm2_lora_dir(smollm2_dir, tmp_path_factory):
    """The embedded SmolLM2-135M (its files linked, not copied) with two adapters of its own."""
    folder = tmp_path_factory.mktemp("smollm2-lora")
    for path in smollm2_dir.iterdir():
        (folder / path.name).symlink_to(path.resolve())
    save_adapters(folder, SMOLLM2_ADAPTERS)
    return folder


def test_smollm2_adapters_match_peft(smollm2_lora_dir):
    """The real model: each adapter, mixed with the base model in one batch, answers as
    HF + PEFT does; and each adapter changes the answers."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_lora_dir)
    prompts = VARIED_PROMPTS[:4]
    names = [None, *SMOLLM2_ADAPTERS]
    expected = {}
    for adapter in names:
        model = peft_model(smollm2_lora_dir, adapter)
        for prompt in prompts:
            ids = tokenizer(prompt)["input_ids"]
            expected[prompt, adapter] = hf_greedy_alone(model, ids, MAX_NEW_TOKENS)
    for adapter in SMOLLM2_ADAPTERS:
        changed = [expected[p, adapter][0] != expected[p, None][0] for p in prompts]
        assert sum(changed) >= len(prompts) // 2, adapter
    batch = [(prompt, adapter) for prompt in prompts for adapter in names]
    with LLM(
        smollm2_lora_dir, dtype="fp32", max_model_len=256, enable_lora=True, max_lora_rank=16
    ) as llm:
        results = llm.generate(
            [p for p, _ in batch], MAX_NEW_TOKENS, adapters=[a for _, a in batch]
        )
    for (prompt, adapter), result in zip(batch, results):
        assert_same_or_near_tie(result.token_ids, *expected[prompt, adapter])


def test_memory_for_the_adapters_is_taken_before_the_kv_cache_is_sized(lora_model_dir, monkeypatch):
    """max_cpu_loras adapters of the largest rank fit what is set aside for them, and that much
    less goes to the KV cache."""
    from lmserve.rolling_batch.model import kv_cache
    from lmserve.rolling_batch.model.runner_setup import RuntimeOptions, build_runner

    budget = 64 * 2**20
    monkeypatch.setattr(kv_cache, "memory_budget", lambda *args: budget)
    blocks = {}
    for enable_lora in (False, True):
        options = RuntimeOptions(
            dtype="fp32", max_model_len=4096, max_rolling_batch_size=1024, enable_lora=enable_lora
        )
        runner, _, _ = build_runner(lora_model_dir, options, TensorParallelGroup())
        blocks[enable_lora] = runner.num_blocks
    lora = runner.lora
    bytes_per_block = kv_cache.CacheShape(2, 2, 16, 16, torch.float32).bytes_per_block
    assert blocks[False] == budget // bytes_per_block
    assert blocks[True] == (budget - lora.cache_bytes) // bytes_per_block
    largest = max(adapter.num_bytes for adapter in lora.loaded.values())
    assert largest <= lora.cache_bytes / lora.max_cpu_loras
