"""AWQ and GPTQ checkpoints made here from a tiny Llama, packed as the formats document it
(AutoAWQ's GEMM layout, AutoGPTQ's layout, rolling_batch/model/weights/quantized_checkpoint.py),
served by the native runtime: logits and greedy tokens against HF transformers on the same weights
dequantized, and clear errors for what is not served.

Tolerance: as for option.quantize=int4 (test_quantized_model.py), the kernel rounds each
linear's input and output to bf16, and here also the checkpoint's fp16 scales and the zeros
(8 - z) * s to bf16. HF with exactly these roundings gives the same logits to 1e-5 of the
largest; against HF in fp32 on the checkpoint's own (q - z) * s they are bounded by 3e-2."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from lmserve.kernels import cpu_native
from lmserve.rolling_batch import LLM
from lmserve.rolling_batch.model.layers import quantized
from lmserve.rolling_batch.model.layers.parallel import TensorParallelGroup
from lmserve.rolling_batch.model.runner_setup import RuntimeOptions, build_runner
from lmserve.rolling_batch.model.weights.loader import load_hf_config, load_model
from lmserve.rolling_batch.model.weights.quantized_checkpoint import read_quantization, unpack_int4

from ..conftest import TEST_CACHE_DIR, save_tiny_llama
from ..hf_reference import VARIED_PROMPTS, assert_same_or_near_tie, hf_greedy_alone
from .test_model_logits import MAX_MODEL_LEN, run_steps
from .test_quantized_model import DECODER_LINEARS, Bf16Linear, worst_relative_error

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of an AWQ word: output 8j + AWQ_ORDER[i]
IN_ORDER = tuple(range(8))


def pack_words(values: torch.Tensor, order) -> torch.Tensor:
    """[rows, n] codes 0..15 -> [rows, n / 8] int32, nibble i of word j holding column
    8j + order[i]."""
    groups = values.to(torch.int64).reshape(values.shape[0], -1, 8)
    words = sum(groups[..., column] << (4 * nibble) for nibble, column in enumerate(order))
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def quantize_groups(weight: torch.Tensor, group_size: int, lowest_zero: int):
    """Asymmetric 4-bit codes of `weight` [out, in]: (codes [out, in], zero points z and fp16
    scales s [out, groups]) with w ~ (q - z) * s."""
    out_features, in_features = weight.shape
    group_size = in_features if group_size == -1 else group_size
    groups = weight.reshape(out_features, -1, group_size)
    low, high = groups.amin(-1).clamp(max=0), groups.amax(-1).clamp(min=0)
    scales = ((high - low) / 15).clamp(min=1e-6).half()
    zero_points = (-low / scales.float()).round().clamp(lowest_zero, 15)
    codes = (groups / scales.float()[..., None] + zero_points[..., None]).round().clamp(0, 15)
    return codes.reshape(out_features, in_features).to(torch.uint8), zero_points.int(), scales


def pack_linear(method: str, codes, zero_points, scales, zero_offset: int, group_size: int):
    """The tensors a checkpoint holds for one linear, from the formats' documented layouts."""
    if method == "awq":
        return {
            "qweight": pack_words(codes.T, AWQ_ORDER),
            "qzeros": pack_words(zero_points.T, AWQ_ORDER),
            "scales": scales.T,
        }
    in_features = codes.shape[1]
    groups = torch.arange(in_features, dtype=torch.int32) // (
        in_features if group_size == -1 else group_size
    )
    return {
        "qweight": pack_words(codes, IN_ORDER).T,
        "qzeros": pack_words(zero_points.T - zero_offset, IN_ORDER),
        "scales": scales.T,
        "g_idx": groups,
    }


def dequantized(codes, zero_points, scales, group_size: int, kernel_roundings: bool):
    """The weight a checkpoint stands for: (q - z) * s, or as the kernel computes it,
    (q - 8) * bf16(s) + bf16((8 - z) * s)."""
    expand = lambda t: t.repeat_interleave(codes.shape[1] // t.shape[1], dim=1)  # noqa: E731
    scales = scales.float()
    if not kernel_roundings:
        return (codes.float() - expand(zero_points.float())) * expand(scales)
    zeros = ((8 - zero_points.float()) * scales).bfloat16().float()
    return (codes.float() - 8) * expand(scales.bfloat16().float()) + expand(zeros)


CHECKPOINTS = {
    # name: (quantization_config, zero offset stored)
    "awq-g128": ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemm"}, 0),
    "awq-g64": ({"quant_method": "awq", "bits": 4, "group_size": 64, "zero_point": True}, 0),
    "gptq-g32": ({"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False}, 1),
    "gptq_v2-per-row": (
        {"quant_method": "gptq", "bits": 4, "group_size": -1, "checkpoint_format": "gptq_v2"},
        0,
    ),
    "gptq_v2-g64": ({"quant_method": "gptq", "bits": 4, "group_size": 64, "format": "gptq_v2"}, 0),
}


@pytest.fixture(scope="module")
def base_dir(smollm2_dir, tmp_path_factory) -> Path:
    """A tiny Llama wide enough for groups of 128 (hidden 128, head_dim 32, MLP 256)."""
    folder = tmp_path_factory.mktemp("tiny-llama-128")
    return save_tiny_llama(folder, smollm2_dir, intermediate_size=256, hidden_size=128)


def save_quantized(
    base_dir: Path, folder: Path, name: str, tamper=None, dense: tuple[str, ...] = ()
) -> dict:
    """The base model with its decoder linears (but those in `dense`) in checkpoint `name`'s
    format, saved into `folder`; returns each linear's (codes, zero points, scales)."""
    config, zero_offset = CHECKPOINTS[name]
    group_size = config["group_size"]
    tensors, parts = {}, {}
    for key, tensor in load_file(base_dir / "model.safetensors").items():
        prefix = key.removesuffix(".weight")
        if prefix.rsplit(".", 1)[-1] not in DECODER_LINEARS or prefix in dense:
            tensors[key] = tensor
            continue
        lowest_zero = 1 if zero_offset else 0  # the original GPTQ format stores z - 1 >= 0
        parts[prefix] = quantize_groups(tensor.float(), group_size, lowest_zero)
        packed = pack_linear(config["quant_method"], *parts[prefix], zero_offset, group_size)
        tensors.update({f"{prefix}.{part}": t.contiguous() for part, t in packed.items()})
    if tamper is not None:
        tamper(tensors)
    ignore = shutil.ignore_patterns("*.safetensors")
    shutil.copytree(base_dir, folder, ignore=ignore, dirs_exist_ok=True)
    save_file(tensors, folder / "model.safetensors")
    hf_config = json.loads((folder / "config.json").read_text())
    hf_config["quantization_config"] = config
    (folder / "config.json").write_text(json.dumps(hf_config))
    return parts


@pytest.fixture(scope="module", params=list(CHECKPOINTS))
def checkpoint(request, base_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    return request.param, folder, save_quantized(base_dir, folder, request.param)


def hf_reference(base_dir: Path, parts: dict, group_size: int, kernel_roundings: bool):
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
    modules = dict(model.named_modules())
    for prefix, (codes, zero_points, scales) in parts.items():
        linear = modules[prefix]
        linear.weight.data = dequantized(codes, zero_points, scales, group_size, kernel_roundings)
        if kernel_roundings:
            parent, child = prefix.rsplit(".", 1)
            setattr(modules[parent], child, Bf16Linear(linear))
    return model


def test_unpacking_gives_back_the_codes_scales_and_zeros(checkpoint):
    name, folder, parts = checkpoint
    config = load_hf_config(folder)
    fmt = read_quantization(config, None)
    assert fmt.method == name.split("-")[0].split("_")[0]
    unpacked = dict(unpack_int4(load_file(folder / "model.safetensors").items(), fmt))
    for prefix, (codes, zero_points, scales) in parts.items():
        assert torch.equal(unpacked[f"{prefix}.int4_codes"], codes)
        # A checkpoint group wider than the kernel's repeats its scale and zero.
        repeat = codes.shape[1] // scales.shape[1] // fmt.kernel_group_size
        scales, zeros = scales.float(), (8 - zero_points.float()) * scales.float()
        for part, values in (("scales", scales), ("zeros", zeros)):
            expected = values.repeat_interleave(repeat, dim=1)
            assert torch.equal(unpacked[f"{prefix}.int4_{part}"], expected)


def test_logits_match_hf_on_the_dequantized_checkpoint(checkpoint, base_dir):
    name, folder, parts = checkpoint
    group_size = CHECKPOINTS[name][0]["group_size"]
    options = RuntimeOptions(dtype="fp32", max_model_len=MAX_MODEL_LEN, max_rolling_batch_size=4)
    runner, _, _ = build_runner(folder, options, TensorParallelGroup())
    steps = run_steps(runner, runner.block_size)
    same_arithmetic = hf_reference(base_dir, parts, group_size, kernel_roundings=True)
    assert worst_relative_error(steps, same_arithmetic) < 1e-5
    fp32 = hf_reference(base_dir, parts, group_size, kernel_roundings=False)
    assert worst_relative_error(steps, fp32) < 3e-2


@pytest.mark.parametrize("name", ["awq-g128", "gptq-g32"])
def test_the_gpu_kernel_serves_the_checkpoints_own_weights(name, base_dir, tmp_path, monkeypatch):
    """What a GPU serves: the same codes with the Triton kernel's weights (run on CPU tensors
    by its interpreter) where `quantized.on_cpu` would pick the CPU's. It keeps the fp32
    scales and zeros and multiplies in IEEE fp32: HF's logits on (q - z) * s, to 1e-5."""
    monkeypatch.setattr(quantized, "on_cpu", lambda codes: False)
    parts = save_quantized(base_dir, tmp_path, name)
    options = RuntimeOptions(dtype="fp32", max_model_len=MAX_MODEL_LEN, max_rolling_batch_size=4)
    runner, _, _ = build_runner(tmp_path, options, TensorParallelGroup())
    steps = run_steps(runner, runner.block_size)
    group_size = CHECKPOINTS[name][0]["group_size"]
    fp32 = hf_reference(base_dir, parts, group_size, kernel_roundings=False)
    assert worst_relative_error(steps, fp32) < 1e-5


@pytest.mark.parametrize(("name", "ranks"), [("gptq-g32", 1), ("gptq-g32", 2), ("awq-g64", 2)])
def test_greedy_tokens_match_hf_at_one_and_two_ranks(name, ranks, base_dir, tmp_path):
    """Two ranks: row-parallel shards (o_proj's 64 inputs a rank, down_proj's 128) hold whole
    groups, so each rank's codes are the one-rank model's."""
    parts = save_quantized(base_dir, tmp_path, name)
    group_size = CHECKPOINTS[name][0]["group_size"]
    reference = hf_reference(base_dir, parts, group_size, kernel_roundings=True)
    prompts = VARIED_PROMPTS[:8]
    with LLM(
        tmp_path, tensor_parallel_degree=ranks, dtype="fp32", max_model_len=128,
        cache_dir=TEST_CACHE_DIR,
    ) as llm:  # fmt: skip
        results = llm.generate(prompts, max_new_tokens=16)
        prompt_ids = [llm.tokenizer(p)["input_ids"] for p in prompts]
    # The reference rounds as the int4 kernel does (bf16 activations and products). Without
    # native bf16 (AVX2), steps of 64 rows or more widen the weight to fp32 instead and skip
    # those roundings (quantized._int4_dense_dtype): logits then differ by up to bf16's 2^-9 of
    # their size, so a top-2 gap below 1e-2 is a tie there.
    near_tie = 1e-3 if cpu_native.cpu_has_native_bf16() else 1e-2
    for result, ids in zip(results, prompt_ids):
        expected, logits = hf_greedy_alone(reference, ids, 16)
        assert_same_or_near_tie(result.token_ids, expected, logits, near_tie=near_tie)


def test_linears_the_checkpoint_leaves_dense_stay_dense(base_dir, tmp_path):
    """AWQ and GPTQ configs may name modules not to convert: those come as plain weights."""
    dense = ("model.layers.1.mlp.down_proj", "model.layers.0.self_attn.o_proj")
    parts = save_quantized(base_dir, tmp_path, "gptq-g32", dense=dense)
    assert not set(dense) & set(parts)
    options = RuntimeOptions(dtype="fp32", max_model_len=MAX_MODEL_LEN, max_rolling_batch_size=4)
    runner, _, _ = build_runner(tmp_path, options, TensorParallelGroup())
    steps = run_steps(runner, runner.block_size)
    reference = hf_reference(base_dir, parts, 32, kernel_roundings=True)
    assert worst_relative_error(steps, reference) < 1e-5


class TwoRanks(TensorParallelGroup):
    """Rank 0 of 2, for building the model only (no collective runs)."""

    world_size = 2


def load(folder: Path, quantize=None, group=None):
    return load_model(
        folder,
        load_hf_config(folder),
        torch.float32,
        torch.device("cpu"),
        group or TensorParallelGroup(),
        64,
        quantize,
    )


def test_a_rank_whose_shard_splits_a_group_is_refused_naming_the_layer(base_dir, tmp_path):
    save_quantized(base_dir, tmp_path, "awq-g128")  # o_proj: 64 inputs a rank, groups of 128
    with pytest.raises(ValueError, match=r"o_proj.*\[0, 64\).*groups of 128"):
        load(tmp_path, group=TwoRanks())


def test_act_order_groups_are_refused_naming_the_layer(base_dir, tmp_path):
    def shuffle_groups(tensors):
        key = "model.layers.1.mlp.down_proj.g_idx"
        tensors[key] = tensors[key][torch.randperm(tensors[key].numel())]

    save_quantized(base_dir, tmp_path, "gptq-g32", tamper=shuffle_groups)
    with pytest.raises(ValueError, match=r"layers\.1\.mlp\.down_proj.*desc_act"):
        load(tmp_path)


@pytest.mark.parametrize(
    ("edit", "quantize", "message"),
    [
        ({}, "int4", r"option.quantize=int4.*already quantized with gptq.*option.quantize=gptq"),
        ({}, "awq", r"option.quantize=awq.*already quantized with gptq"),
        ({"bits": 8}, None, r"bits=8.*4-bit AWQ"),
        ({"checkpoint_format": "marlin"}, None, r"checkpoint_format=marlin"),
        ({"quant_method": "bitsandbytes"}, None, r"'bitsandbytes' is not served"),
    ],
)
def test_what_is_not_served_is_refused_by_name(base_dir, tmp_path, edit, quantize, message):
    save_quantized(base_dir, tmp_path, "gptq-g32")
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"].update(edit)
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message):
        load(tmp_path, quantize)


def test_a_checkpoint_method_on_a_dense_checkpoint_is_refused(base_dir):
    with pytest.raises(ValueError, match=r"option.quantize=gptq.*no quantization_config"):
        load(base_dir, "gptq")


def test_engine_python_refuses_a_quantized_checkpoint_by_name(base_dir, tmp_path):
    from lmserve.handlers.python_engine.hf_engine import HFEngine

    save_quantized(base_dir, tmp_path, "awq-g64")
    with pytest.raises(ValueError, match=r"quantized with awq.*engine=MPI"):
        HFEngine.load(str(tmp_path), "fp32")
