"""The generic path (rolling_batch/model/families/generic.py): families with no native module run as
their own transformers modules over lmserve's paged attention, giving HF's logits and greedy
tokens; what it cannot run is refused before anything starts, naming why and the alternative."""

from __future__ import annotations

import pytest
import torch
import transformers

from lmserve.rolling_batch import LLM
from lmserve.rolling_batch.core.step import SequenceChunk
from lmserve.rolling_batch.model.architectures import (
    GENERIC_TESTED,
    NATIVE_ARCHITECTURES,
    EngineRequest,
    ServingPath,
    UnservableModel,
    serving_path,
)
from lmserve.rolling_batch.model.families.generic import GenericCausalLM
from lmserve.rolling_batch.model.layers.parallel import TensorParallelGroup
from lmserve.rolling_batch.model.runner_setup import RuntimeOptions, build_runner

from ..conftest import TEST_CACHE_DIR
from ..hf_reference import assert_same_or_near_tie, hf_greedy_alone
from .tiny_families import COMMON, assert_steps_match_hf, save_tiny

# Families with no native module, each with what sets it apart from Llama.
FAMILIES = {
    # Parallel residual, partial rotary, fused interleaved QKV.
    "gpt-neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", dict(rotary_pct=0.5)),
    # q/k norms over all heads, norms after attention and MLP.
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", dict(num_key_value_heads=2)),
    # Embedding, residual and attention multipliers, logits divided by logits_scaling.
    "granite": (
        "GraniteConfig",
        "GraniteForCausalLM",
        dict(
            num_key_value_heads=2,
            embedding_multiplier=2.0,
            residual_multiplier=0.5,
            attention_multiplier=0.3,
            logits_scaling=4.0,
        ),
    ),
    # Biased LayerNorms and projections, plain GELU MLP; a sliding window the prompt outgrows.
    "starcoder2": (
        "Starcoder2Config",
        "Starcoder2ForCausalLM",
        dict(num_key_value_heads=2, sliding_window=4),
    ),
    # Soft-capped attention scores and logits, a window on alternate layers, pre and post norms.
    "gemma2": (
        "Gemma2Config",
        "Gemma2ForCausalLM",
        dict(num_key_value_heads=2, head_dim=16, sliding_window=4, attn_logit_softcapping=2.0),
    ),
    # Local (windowed) and global layers with their own rope bases, q/k norms.
    "gemma3": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        dict(
            num_key_value_heads=2,
            head_dim=16,
            sliding_window=4,
            layer_types=["sliding_attention", "full_attention"],
        ),
    ),
    # Parallel attention and MLP, logits multiplied by logit_scale.
    "cohere": ("CohereConfig", "CohereForCausalLM", dict(num_key_value_heads=2, logit_scale=0.5)),
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("paged", [True, False])
def test_family_gives_hf_logits_through_the_paged_cache(family, paged, tmp_path):
    """A prompt in two chunks, then a decode token: each step's last logits are HF's."""
    hf_model = save_tiny(tmp_path, *FAMILIES[family])
    options = RuntimeOptions(
        dtype="fp32",
        max_model_len=64,
        block_size=4,
        paged_attention=paged,
        max_rolling_batch_size=2,
        model_impl="transformers",  # Gemma 2 and 3 have native modules too
    )
    runner, _, _ = build_runner(tmp_path, options, TensorParallelGroup())
    assert isinstance(runner.model, GenericCausalLM)
    assert_steps_match_hf(runner, hf_model, family)


@pytest.mark.parametrize(
    ("family", "drafts"), [("gpt-neox", None), ("granite", "[ngram]"), ("gemma3", None)]
)
def test_batched_generation_gives_hf_greedy_tokens(family, drafts, tmp_path, smollm2_dir):
    """Prompts of different lengths generated together (one packed row a step, each with its
    own positions) through the offline LLM: each gets HF's greedy tokens run alone; with
    n-gram drafts too (a repetitive prompt, checked several tokens a step)."""
    hf_model = save_tiny(tmp_path, *FAMILIES[family])
    transformers.AutoTokenizer.from_pretrained(smollm2_dir).save_pretrained(tmp_path)
    hf_model.generation_config.eos_token_id = None  # random weights: run the whole length
    prompts = [[5, 17, 250, 3, 99, 42, 7, 8, 9, 10, 11], list(range(100, 140)), [7, 8, 9] * 8]
    settings = dict(model=tmp_path, dtype="fp32", max_model_len=64, cache_dir=TEST_CACHE_DIR)
    with LLM(**settings, model_impl="transformers", speculative_draft_model=drafts) as llm:
        results = llm.generate(prompts, max_new_tokens=12, ignore_eos=True)
    for prompt, result in zip(prompts, results):
        expected, logits = hf_greedy_alone(hf_model, prompt, 12)
        assert_same_or_near_tie(result.token_ids, expected, logits, eos_ids=())


def test_start_up_names_the_generic_path(tmp_path):
    save_tiny(tmp_path, *FAMILIES["olmo2"])
    path = serving_path(tmp_path)
    assert path == ServingPath("Olmo2ForCausalLM", None)
    assert "generic path" in path.describe()


REFUSED = {
    # (config, model, extra, settings, what the message names)
    "tensor parallel": (
        "Olmo2Config",
        "Olmo2ForCausalLM",
        {},
        EngineRequest(tensor_parallel_degree=2),
        "tensor_parallel_degree=1",
    ),
    "quantize": (
        "Olmo2Config",
        "Olmo2ForCausalLM",
        {},
        EngineRequest(quantize="int8"),
        "option.quantize=int8",
    ),
    "lora": (
        "Olmo2Config",
        "Olmo2ForCausalLM",
        {},
        EngineRequest(enable_lora=True),
        "option.enable_lora",
    ),
    "attention sinks": (
        "GptOssConfig",
        "GptOssForCausalLM",
        dict(num_key_value_heads=2, head_dim=16, num_local_experts=4, sliding_window=256),
        EngineRequest(),
        "attention sinks",
    ),
    "no attention interface": ("BloomConfig", "BloomForCausalLM", {}, EngineRequest(), "interface"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_what_the_generic_path_cannot_run_is_refused_before_start(case, tmp_path):
    config_name, model_name, extra, wanted, named = REFUSED[case]
    if config_name == "BloomConfig":  # names its sizes its own way
        config = transformers.BloomConfig(vocab_size=300, hidden_size=48, n_layer=2, n_head=6)
        config.architectures = [model_name]
        transformers.BloomForCausalLM(config).save_pretrained(tmp_path)
    else:
        save_tiny(tmp_path, config_name, model_name, extra)
    with pytest.raises(UnservableModel) as error:
        serving_path(tmp_path, wanted)
    message = str(error.value)
    assert model_name in message and named in message
    assert "engine=Python" in message  # the alternative


def test_attention_sinks_stop_the_load_naming_them():
    """GPT-OSS passes its sinks (s_aux) to the attention function; the paged kernels would
    drop them, so the load stops naming them (as does start-up, by model type)."""
    from lmserve.rolling_batch.model.families import generic

    generic._register()
    config = transformers.GptOssConfig(
        **COMMON, num_key_value_heads=2, head_dim=16, num_local_experts=4, sliding_window=256
    )
    config._attn_implementation = generic.ATTENTION_NAME
    model = transformers.GptOssForCausalLM(config).eval()
    with pytest.raises(ValueError, match="s_aux"):
        GenericCausalLM(model, 64)


def test_the_families_tested_here_are_the_ones_the_readme_lists():
    """Those without a native module (docs/models.md's generic rows; GPT-NeoX, Gemma 2 and 3
    are tested here too, through option.model_impl=transformers: the generic path's partial
    rotation, soft-capping and per-layer rotary bases)."""
    names = {model_name for _, model_name, _ in FAMILIES.values()}
    assert {name for name in names if name not in NATIVE_ARCHITECTURES} == set(GENERIC_TESTED)


def test_model_impl_transformers_runs_a_native_family_on_the_generic_path(tmp_path):
    """option.model_impl (vLLM's): "transformers" serves a Llama through its HF modules, with
    the native module's logits; "native" refuses a family that has no module."""
    hf_model = save_tiny(tmp_path / "llama", "LlamaConfig", "LlamaForCausalLM", {})
    assert serving_path(tmp_path / "llama").native == "llama:LlamaForCausalLM"
    assert serving_path(tmp_path / "llama", EngineRequest(model_impl="transformers")).native is None
    prompt = [5, 17, 250, 3, 99, 42, 7, 8, 9, 10, 11]
    with torch.inference_mode():
        expected = hf_model(torch.tensor([prompt])).logits[0, -1]
    for impl in ("auto", "transformers"):
        options = RuntimeOptions(
            dtype="fp32", max_model_len=64, max_rolling_batch_size=1, model_impl=impl
        )
        runner, _, _ = build_runner(tmp_path / "llama", options, TensorParallelGroup())
        assert isinstance(runner.model, GenericCausalLM) == (impl == "transformers")
        (logits,) = runner.execute([SequenceChunk(tuple(prompt), 0, (0,), True)])
        assert (logits - expected).abs().max() / expected.abs().max() < 1e-4
    save_tiny(tmp_path / "olmo2", *FAMILIES["olmo2"])
    with pytest.raises(UnservableModel, match="option.model_impl=native"):
        serving_path(tmp_path / "olmo2", EngineRequest(model_impl="native"))
