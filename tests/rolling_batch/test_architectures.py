"""Every native architecture and its options against HF on tiny random weights: Qwen2's
Q/K/V biases, Mistral, Llama with biases, untied embeddings and llama3 rope scaling. Variants
the native modules do not run fail with a message naming what is supported."""

from __future__ import annotations

import pytest
import torch
import transformers

from lmserve.kernels import cpu_native
from lmserve.rolling_batch import LLM
from lmserve.rolling_batch.core.step import SequenceChunk
from lmserve.rolling_batch.model.families import model_class_for
from lmserve.rolling_batch.model.layers.norm_and_rotary import rope_frequencies
from lmserve.rolling_batch.model.layers.parallel import TensorParallelGroup
from lmserve.rolling_batch.model.runner_setup import RuntimeOptions, build_runner

from ..conftest import TEST_CACHE_DIR
from ..hf_reference import assert_same_or_near_tie, hf_greedy_alone
from .tiny_families import COMMON, assert_steps_match_hf
from .tiny_families import save_tiny as save_family

# Grouped-query attention in every variant here: 3 query heads a KV head.
KV_HEADS = dict(num_key_value_heads=2)
VARIANTS = {
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=False)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=None)),
    # head_dim 16, not 48 / 6: the explicit head_dim Qwen3 checkpoints have.
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=16, tie_word_embeddings=False)),
    # GeGLU, scaled embeddings, (1 + w) norms, head_dim 16 (not 48 / 6).
    "gemma": ("GemmaConfig", "GemmaForCausalLM", dict(head_dim=16, pad_token_id=0)),
    # Gemma 2: norms before and after each sublayer, query_pre_attn_scalar, soft-capped
    # scores and logits (caps small enough to bite), windows on alternate layers (past the
    # prompt's length here: test_sliding_window_past_the_window_matches_hf runs them).
    "gemma2": (
        "Gemma2Config",
        "Gemma2ForCausalLM",
        dict(
            head_dim=16,
            pad_token_id=0,
            query_pre_attn_scalar=20,
            attn_logit_softcapping=0.3,
            final_logit_softcapping=3.0,
        ),
    ),
    # Gemma 3: q/k norms, local and global layers with rotary bases (and scaling) of their own.
    "gemma3": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        dict(
            head_dim=16,
            pad_token_id=0,
            layer_types=["sliding_attention", "full_attention"],
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                "full_attention": {"rope_type": "linear", "rope_theta": 1e6, "factor": 8.0},
            },
        ),
    ),
    # Falcon's three query_key_value layouts, LayerNorm with bias, plain GELU MLP.
    "falcon-7b": ("FalconConfig", "FalconForCausalLM", dict(multi_query=True)),
    "falcon-40b": (
        "FalconConfig",
        "FalconForCausalLM",
        dict(new_decoder_architecture=True, num_kv_heads=2, bias=True),
    ),
    "falcon-sequential": (
        "FalconConfig",
        "FalconForCausalLM",
        dict(multi_query=False, parallel_attn=False, bias=True, tie_word_embeddings=False),
    ),
    # GPT-NeoX (Pythia): per-head fused query_key_value, parallel residual with two norms (or
    # sequential), a quarter of each head rotated, untied embed_out.
    "gpt-neox": (
        "GPTNeoXConfig",
        "GPTNeoXForCausalLM",
        dict(
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 1e4,
                "partial_rotary_factor": 0.25,
            }
        ),
    ),
    "gpt-neox-sequential": (
        "GPTNeoXConfig",
        "GPTNeoXForCausalLM",
        dict(
            use_parallel_residual=False,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 1e4,
                "partial_rotary_factor": 0.5,
            },
        ),
    ),
    # Fused qkv_proj and gate_up_proj in the checkpoint; Phi-4-mini's partial rotation.
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(pad_token_id=0)),
    "phi3-partial-rotary": (
        "Phi3Config",
        "Phi3ForCausalLM",
        dict(
            pad_token_id=0,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.5,
            },
        ),
    ),
    # Mixtures of experts (4 experts, top 2): Mixtral's w1/w2/w3 names, renormalised weights;
    # Qwen2-MoE's Q/K/V biases, gated shared expert, a dense layer (mlp_only_layers), weights
    # not renormalised; Qwen3-MoE's q/k norms and head_dim.
    "mixtral": (
        "MixtralConfig",
        "MixtralForCausalLM",
        dict(num_local_experts=4, num_experts_per_tok=2, tie_word_embeddings=False),
    ),
    "qwen2-moe": (
        "Qwen2MoeConfig",
        "Qwen2MoeForCausalLM",
        dict(
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=40,
            mlp_only_layers=[1],
            tie_word_embeddings=False,
        ),
    ),
    "qwen3-moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        dict(
            head_dim=16,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            norm_topk_prob=True,
            tie_word_embeddings=False,
        ),
    ),
    "llama-biases-untied-llama3-rope": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(
            attention_bias=True,
            mlp_bias=True,
            tie_word_embeddings=False,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 50000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
        ),
    ),
}


def save_tiny(folder, config_name, model_name, extra, **sizes):
    return save_family(folder, config_name, model_name, extra, **KV_HEADS, **sizes)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("block_size", [1, 16])
def test_variant_matches_hf(variant, block_size, tmp_path):
    hf_model = save_tiny(tmp_path, *VARIANTS[variant])
    options = RuntimeOptions(
        dtype="fp32", max_model_len=64, block_size=block_size, max_rolling_batch_size=2
    )
    runner, _, _ = build_runner(tmp_path, options, TensorParallelGroup())
    assert_steps_match_hf(runner, hf_model, variant)


@pytest.mark.parametrize(
    ("variant", "paged"),
    [
        ("qwen3", True),
        ("qwen3", False),
        ("phi3-partial-rotary", True),
        ("gemma", True),
        ("gemma2", False),
        ("gemma3", True),
        ("gpt-neox", False),
        ("falcon-40b", True),
        ("falcon-7b", False),
        ("mixtral", True),
        ("qwen2-moe", False),
    ],
)
def test_over_two_ranks_gives_hf_greedy_tokens(variant, paged, tmp_path, smollm2_dir):
    """3 query heads and 1 KV head a rank, paged and contiguous: Qwen3's per-head q/k norms
    whole on each rank; Phi-3's fused checkpoint matrices split, then sharded by head; each
    expert's columns split (unevenly: 40 shared-expert columns a rank of 20, 32 of 16)."""
    hf_model = save_tiny(tmp_path, *VARIANTS[variant])
    transformers.AutoTokenizer.from_pretrained(smollm2_dir).save_pretrained(tmp_path)  # LLM's
    hf_model.generation_config.eos_token_id = None  # random weights: run the whole length
    prompts = [[5, 17, 250, 3, 99, 42, 7, 8, 9, 10, 11], list(range(100, 140))]
    settings = dict(model=tmp_path, dtype="fp32", max_model_len=64, cache_dir=TEST_CACHE_DIR)
    with LLM(tensor_parallel_degree=2, paged_attention=paged, **settings) as llm:
        results = llm.generate(prompts, max_new_tokens=10, ignore_eos=True)
    for prompt, result in zip(prompts, results):
        expected, logits = hf_greedy_alone(hf_model, prompt, 10)
        assert_same_or_near_tie(result.token_ids, expected, logits, eos_ids=())


def test_architectures_without_a_native_module_go_the_generic_path():
    """GPT-2 has no module here: the loader takes the generic path (test_generic_path.py)."""
    assert model_class_for(transformers.GPT2Config(architectures=["GPT2LMHeadModel"])) is None
    llama = model_class_for(transformers.LlamaConfig(architectures=["LlamaForCausalLM"]))
    assert llama.__name__ == "LlamaForCausalLM"


def test_unsupported_rope_type_is_refused():
    config = transformers.LlamaConfig(
        **COMMON, rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}
    )
    with pytest.raises(ValueError, match="rope_type='dynamic'.*supported: default"):
        rope_frequencies(config, 8)


WINDOWED = {
    # Every layer slides (Mistral, Phi-3-mini).
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=4)),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(pad_token_id=0, sliding_window=5)),
    # Qwen2: the layers from max_window_layers up slide, the others see everything.
    "qwen2": (
        "Qwen2Config",
        "Qwen2ForCausalLM",
        dict(use_sliding_window=True, sliding_window=4, max_window_layers=1),
    ),
    # Gemma 2 and 3: the first layer local (windowed), the second global.
    "gemma2": (
        "Gemma2Config",
        "Gemma2ForCausalLM",
        dict(head_dim=16, pad_token_id=0, sliding_window=4, attn_logit_softcapping=2.0),
    ),
    "gemma3": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        dict(head_dim=16, sliding_window=4, layer_types=["sliding_attention", "full_attention"]),
    ),
}


@pytest.mark.parametrize("variant", sorted(WINDOWED))
@pytest.mark.parametrize("block_size", [1, 16])
def test_sliding_window_past_the_window_matches_hf(variant, block_size, tmp_path):
    """Prompt chunks and decodes whose contexts outgrow the window: HF's windowed logits."""
    hf_model = save_tiny(tmp_path, *WINDOWED[variant])
    options = RuntimeOptions(
        dtype="fp32", max_model_len=64, block_size=block_size, max_rolling_batch_size=2
    )
    runner, _, _ = build_runner(tmp_path, options, TensorParallelGroup())
    windows = [layer.self_attn.sliding_window for layer in runner.model.model.layers]
    expected_windows = {"qwen2": [None, 4], "gemma2": [4, None], "gemma3": [4, None]}
    assert windows == expected_windows.get(variant, [WINDOWED[variant][2]["sliding_window"]] * 2)
    if cpu_native.native_ops() is not None and variant in ("mistral", "qwen2"):
        assert runner.model.model.native_stack is not None  # the C++ stack slides too
    logits, sequence = assert_steps_match_hf(runner, hf_model, variant, decodes=2)
    # The same weights seeing every key answer otherwise: the window is what matched.
    config_name, model_name, extra = WINDOWED[variant]
    windowless = {
        k: v for k, v in extra.items() if k not in ("sliding_window", "use_sliding_window")
    }
    no_window = 1024 if variant.startswith("gemma") else None  # Gemma's HF needs a number
    full = save_tiny(
        tmp_path / "full", config_name, model_name, {**windowless, "sliding_window": no_window}
    )
    with torch.inference_mode():
        assert not torch.allclose(logits, full(torch.tensor([sequence])).logits[0, -1], atol=1e-3)


def test_a_window_as_long_as_the_context_is_plain_attention(tmp_path):
    save_tiny(tmp_path, "MistralConfig", "MistralForCausalLM", dict(sliding_window=64))
    options = RuntimeOptions(dtype="fp32", max_model_len=64, max_rolling_batch_size=1)
    runner, _, _ = build_runner(tmp_path, options, TensorParallelGroup())
    assert all(layer.self_attn.sliding_window is None for layer in runner.model.model.layers)


@pytest.mark.parametrize(
    "variant",
    [
        *["qwen3", "gemma", "gemma3", "phi3", "falcon-7b", "falcon-40b", "gpt-neox"],
        *["mixtral", "qwen3-moe"],
    ],
)
def test_int8_weights_give_hf_logits_on_the_dequantized_weights(variant, tmp_path):
    """option.quantize=int8 on each native family: every linear (each expert's too; routers
    stay as they are), the embedding and the LM head (their inputs a multiple of 32 wide here)
    as HF computes on the same weights quantized and dequantized, whatever the family fuses or
    names them."""
    from lmserve.rolling_batch.model.layers.quantized import dequantize_int8, quantize_int8

    config_name, model_name, extra = VARIANTS[variant]
    sizes = dict(COMMON, **KV_HEADS, hidden_size=64, intermediate_size=96, num_attention_heads=4)
    config = getattr(transformers, config_name)(**sizes, **extra)
    torch.manual_seed(1)
    hf_model = getattr(transformers, model_name)(config).eval()
    hf_model.save_pretrained(tmp_path)
    with torch.no_grad():
        for module in hf_model.modules():
            if isinstance(module, (torch.nn.Linear, torch.nn.Embedding)):
                module.weight.data = dequantize_int8(*quantize_int8(module.weight.data))
        for name, param in hf_model.named_parameters():
            if ".experts." in name:  # [experts, out, in] in transformers' expert modules
                for expert in param.data:
                    expert.copy_(dequantize_int8(*quantize_int8(expert)))
    options = RuntimeOptions(
        dtype="fp32", max_model_len=64, block_size=16, max_rolling_batch_size=2, quantize="int8"
    )
    runner, _, _ = build_runner(tmp_path, options, TensorParallelGroup())
    prompt = [5, 17, 250, 3, 99, 42, 7, 8, 9, 10, 11]
    blocks = tuple(range(runner.num_blocks // 2))
    (logits,) = runner.execute([SequenceChunk(tuple(prompt), 0, blocks, True)])
    with torch.inference_mode():
        expected = hf_model(torch.tensor([prompt])).logits[0, -1]
    error = (logits - expected).abs().max() / expected.abs().max()
    assert error < 1e-4, f"{variant}: relative error {error:.2e}"


def test_a_hidden_size_int8_cannot_group_keeps_the_embedding_dense(tmp_path):
    """48 wide: no linear and no embedding row splits into groups of 32; all stay dense and
    the model serves HF's logits (it once failed reshaping the embedding)."""
    hf_model = save_tiny(tmp_path, *VARIANTS["qwen2"])
    options = RuntimeOptions(
        dtype="fp32", max_model_len=64, block_size=16, max_rolling_batch_size=2, quantize="int8"
    )
    runner, _, _ = build_runner(tmp_path, options, TensorParallelGroup())
    prompt = [5, 17, 250, 3, 99]
    (logits,) = runner.execute([SequenceChunk(tuple(prompt), 0, (0, 1), True)])
    with torch.inference_mode():
        expected = hf_model(torch.tensor([prompt])).logits[0, -1]
    assert (logits - expected).abs().max() / expected.abs().max() < 1e-4


@pytest.mark.parametrize(
    ("variant", "family"),
    [
        ("falcon-7b", "Falcon"),
        ("gpt-neox", "GPT-NeoX"),
        ("mixtral", "Mixtral"),
        ("qwen3-moe", "Qwen3"),
    ],
)
def test_lora_on_a_family_without_it_is_refused_before_start(variant, family, tmp_path):
    from lmserve.rolling_batch.model.architectures import (
        EngineRequest,
        UnservableModel,
        serving_path,
    )

    config_name, model_name, extra = VARIANTS[variant]
    save_tiny(tmp_path, config_name, model_name, extra)
    assert serving_path(tmp_path).native.endswith(f":{model_name}")
    with pytest.raises(UnservableModel, match=f"option.enable_lora is not served on {family}"):
        serving_path(tmp_path, EngineRequest(enable_lora=True))


@pytest.mark.parametrize("variant", ["falcon-7b", "falcon-40b"])
def test_falcons_original_refined_web_checkpoints_are_served_natively(variant, tmp_path):
    """tiiuae's first Falcon uploads: config.json with RWForCausalLM, model_type RefinedWeb
    (40B: n_head_kv) or RefinedWebModel (7B), n_head and n_layer, and remote code transformers
    runs only when trusted; the weights under the same names. Served as Falcon, no code run."""
    import json

    from lmserve.rolling_batch.model.architectures import serving_path

    hf_model = save_tiny(tmp_path, *VARIANTS[variant])
    fields = json.loads((tmp_path / "config.json").read_text())
    refined_web = {
        k: v
        for k, v in fields.items()
        if k not in ("num_kv_heads", "new_decoder_architecture", "multi_query")
    }
    refined_web["n_head"] = refined_web.pop("num_attention_heads")
    refined_web["n_layer"] = refined_web.pop("num_hidden_layers")
    refined_web["architectures"] = ["RWForCausalLM"]
    refined_web["auto_map"] = {"AutoModelForCausalLM": "modelling_RW.RWForCausalLM"}
    if variant == "falcon-40b":
        refined_web.update(model_type="RefinedWeb", n_head_kv=fields["num_kv_heads"])
    else:
        refined_web.update(model_type="RefinedWebModel", multi_query=True)
    (tmp_path / "config.json").write_text(json.dumps(refined_web))
    assert serving_path(tmp_path).native == "falcon:FalconForCausalLM"
    options = RuntimeOptions(
        dtype="fp32", max_model_len=64, block_size=16, max_rolling_batch_size=2
    )
    runner, _, _ = build_runner(tmp_path, options, TensorParallelGroup())
    prompt = [5, 17, 250, 3, 99, 42, 7, 8, 9, 10, 11]
    (logits,) = runner.execute([SequenceChunk(tuple(prompt), 0, (0, 1), True)])
    with torch.inference_mode():
        expected = hf_model(torch.tensor([prompt])).logits[0, -1]
    assert (logits - expected).abs().max() / expected.abs().max() < 1e-4


@pytest.mark.parametrize(
    ("variant", "method"), [("qwen3", "awq"), ("mixtral", "gptq"), ("qwen2", "fp8")]
)
def test_a_quantized_checkpoint_no_loader_reads_is_refused_before_start(variant, method, tmp_path):
    """AWQ and GPTQ checkpoints are read on the Llama-named families; elsewhere, and any other
    method anywhere, stops start-up naming the method and where it is served (it failed
    inside the engine once the server was up)."""
    import json

    from lmserve.rolling_batch.model.architectures import UnservableModel, serving_path

    save_tiny(tmp_path, *VARIANTS[variant])
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": method, "bits": 4, "group_size": 32}
    (tmp_path / "config.json").write_text(json.dumps(config))
    expected = rf"quantized with {method}.*served on LlamaForCausalLM, MistralForCausalLM"
    with pytest.raises(UnservableModel, match=expected):
        serving_path(tmp_path)


def test_pythia_checkpoints_with_saved_attention_masks_load(tmp_path):
    """Pythia's uploads hold each layer's causal-mask buffers (`attention.bias`, bool, and
    `attention.masked_bias`) beside the weights: skipped, the logits HF's."""
    from safetensors.torch import load_file, save_file

    hf_model = save_tiny(tmp_path, *VARIANTS["gpt-neox"])
    weights = load_file(tmp_path / "model.safetensors")
    for layer in range(2):
        prefix = f"gpt_neox.layers.{layer}.attention"
        weights[f"{prefix}.bias"] = torch.tril(torch.ones(64, 64, dtype=torch.bool))[None, None]
        weights[f"{prefix}.masked_bias"] = torch.tensor(-1e9)
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    options = RuntimeOptions(dtype="fp32", max_model_len=64, max_rolling_batch_size=2)
    runner, _, _ = build_runner(tmp_path, options, TensorParallelGroup())
    assert_steps_match_hf(runner, hf_model, "pythia")


LONGROPE = dict(  # (max_position_embeddings 128, from COMMON: the factor 4 of the scaling)
    pad_token_id=0,
    original_max_position_embeddings=32,  # Phi3Config's own field, copied into the rope's
    rope_parameters={
        "rope_type": "longrope",
        "rope_theta": 1e4,
        "original_max_position_embeddings": 32,
        "short_factor": [1.0, 1.5, 2.0, 3.0],
        "long_factor": [2.0, 4.0, 9.0, 20.0],
    },
)


@pytest.mark.parametrize(("max_model_len", "prompt_len"), [(32, 20), (64, 40)])
def test_phi3_longrope_takes_the_factors_of_the_served_context(max_model_len, prompt_len, tmp_path):
    """Phi-3-128k's / Phi-4-mini's LongRoPE: a served context within the original 32 takes
    the short factors, a longer one the long factors, with the attention scaling either way:
    HF's logits on a prompt of that size (HF picks by the sequence's length). A prompt within
    the original context served with the long factors is not HF's short answer: the served
    length decides."""
    hf_model = save_tiny(tmp_path, "Phi3Config", "Phi3ForCausalLM", LONGROPE)
    options = RuntimeOptions(dtype="fp32", max_model_len=max_model_len, max_rolling_batch_size=2)
    runner, _, _ = build_runner(tmp_path, options, TensorParallelGroup())
    prompt = [(7 * i) % 290 + 3 for i in range(prompt_len)]
    assert_steps_match_hf(runner, hf_model, "longrope", prompt=prompt, split=prompt_len)
    if max_model_len > 32:
        short_prompt = prompt[:20]
        blocks = tuple(range(runner.num_blocks // 2))
        (logits,) = runner.execute([SequenceChunk(tuple(short_prompt), 0, blocks, True)])
        with torch.inference_mode():
            short = hf_model(torch.tensor([short_prompt])).logits[0, -1]
        assert not torch.allclose(logits, short, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_every_variant_builds_under_any_default_device(variant):
    """option.load_format=dummy builds the model under the serving device as torch's default
    (weights/loader.py); a table built on one fixed device and mixed with the context's fails.
    The meta device stands for a GPU here: mixing it with the CPU raises the same way."""
    config_name, model_name, extra = VARIANTS[variant]
    config = getattr(transformers, config_name)(**COMMON, **KV_HEADS, **extra)
    config.architectures = [model_name]
    with torch.device("meta"):
        model = model_class_for(config)(config, TensorParallelGroup(), 64)
    assert all(p.is_meta for p in model.parameters())
