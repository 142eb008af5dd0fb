"""option.quantize=int4 on the embedded GGUF (SmolLM2-135M Q4_1, its embedding Q8_0) serves the
file's own codes. The Q4_1 linears are read from the file
(rolling_batch/model/weights/gguf_weights.py): their codes, scales and zeros are the file's
weights exactly until the kernel rounds the scale d and the zero m + 8d to bf16. Quantizing the
converted fp32 weights again (what a model converted before the file was recorded gets) also
gives back every Q4_1 code, with d within 2^-8; and every Q8_0 code and scale of the embedding
exactly (fp32 scales)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from safetensors import safe_open

from lmserve.rolling_batch.model.layers.quantized import quantize_int4, quantize_int8
from lmserve.rolling_batch.model.weights.gguf_convert import embedded_gguf, gguf_source
from lmserve.rolling_batch.model.weights.gguf_weights import read_int4_linears, read_int8_matrices
from lmserve.rolling_batch.model.weights.loader import load_hf_config

# GGUF names whose rows keep HF's order (llama.cpp permutes Q and K rows for its rotary).
HF_NAMES = {
    "ffn_down": "mlp.down_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
}


@pytest.fixture(scope="module")
def gguf_tensors():
    from gguf import GGUFReader

    return {t.name: t for t in GGUFReader(str(embedded_gguf())).tensors}


def hf_weight(smollm2_dir, name: str) -> torch.Tensor:
    for file in sorted(smollm2_dir.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as weights:
            if name in weights.keys():  # noqa: SIM118 - safe_open is not a dict
                return weights.get_tensor(name).float()
    raise KeyError(name)


def f16(column: np.ndarray) -> np.ndarray:
    return column.copy().view(np.float16).astype(np.float32)[:, 0]


@pytest.mark.parametrize("layer", [0, 29])
@pytest.mark.parametrize("kind", sorted(HF_NAMES))
def test_q4_1_codes_come_back_exactly(smollm2_dir, gguf_tensors, layer, kind):
    tensor = gguf_tensors[f"blk.{layer}.{kind}.weight"]
    assert tensor.tensor_type.name == "Q4_1"
    blocks = np.asarray(tensor.data).reshape(-1, 20)  # fp16 d, fp16 m, 16 bytes of nibbles
    scale, low = f16(blocks[:, 0:2]), f16(blocks[:, 2:4])
    nibbles = blocks[:, 4:]
    file_codes = np.concatenate([nibbles & 15, nibbles >> 4], axis=1)  # values j and j + 16

    codes, scales, zeros = quantize_int4(
        hf_weight(smollm2_dir, f"model.layers.{layer}.{HF_NAMES[kind]}.weight")
    )

    assert np.array_equal(codes.numpy().reshape(-1, 32), file_codes)
    scales, zeros = scales.numpy().reshape(-1), zeros.numpy().reshape(-1)
    assert np.all(np.abs(scales - scale) <= np.abs(scale) * 2**-8 * 1.01)
    # zero = m + 8 * (the rounded scale), itself rounded: off by 8 scale roundings at most,
    # plus its own.
    expected_zeros = low + 8 * scale
    bound = (8 * np.abs(scale) + np.abs(expected_zeros)) * 2**-8 * 1.01
    assert np.all(np.abs(zeros - expected_zeros) <= bound)


def test_q8_0_embedding_codes_and_scales_come_back_exactly(smollm2_dir, gguf_tensors):
    tensor = gguf_tensors["token_embd.weight"]
    assert tensor.tensor_type.name == "Q8_0"
    blocks = np.asarray(tensor.data).reshape(-1, 34)  # fp16 d, 32 int8 codes
    codes, scales = quantize_int8(hf_weight(smollm2_dir, "model.embed_tokens.weight"))
    assert np.array_equal(codes.numpy().reshape(-1, 32), blocks[:, 2:].copy().view(np.int8))
    assert np.array_equal(scales.numpy().reshape(-1), f16(blocks[:, 0:2]))


def test_the_embedding_read_from_the_file_is_its_q8_0_blocks(smollm2_dir, gguf_tensors):
    """SmolLM2's only Q8_0 tensor is its embedding, tied to the LM head: read once."""
    matrices = read_int8_matrices(embedded_gguf(), load_hf_config(smollm2_dir), linears=True)
    assert sorted(matrices) == ["model.embed_tokens"]
    codes, scales = matrices["model.embed_tokens"]
    blocks = np.asarray(gguf_tensors["token_embd.weight"].data).reshape(-1, 34)
    assert codes.dtype == torch.int8 and codes.shape == (49152, 576)
    assert np.array_equal(codes.numpy().reshape(-1, 32), blocks[:, 2:].copy().view(np.int8))
    assert np.array_equal(scales.numpy().reshape(-1), f16(blocks[:, 0:2]))


def test_linears_read_from_the_file_are_its_q4_1_weights_in_hf_row_order(smollm2_dir):
    assert gguf_source(smollm2_dir) == embedded_gguf().resolve()
    linears = read_int4_linears(embedded_gguf(), load_hf_config(smollm2_dir))
    assert len(linears) == 30 * 7
    for layer in (0, 29):
        for kind in (*HF_NAMES.values(), "self_attn.q_proj", "self_attn.k_proj"):
            codes, scales, zeros = linears[f"model.layers.{layer}.{kind}"]
            hf = hf_weight(smollm2_dir, f"model.layers.{layer}.{kind}.weight")
            # Q and K rows back in HF's order: the codes of HF's (un-permuted) weight.
            assert torch.equal(codes, quantize_int4(hf)[0])
            expand = lambda t: t.repeat_interleave(32, dim=1)  # noqa: E731
            weight = (codes.float() - 8) * expand(scales) + expand(zeros)
            # d q + m computed as (q - 8) d + (m + 8d): fp32 roundings of the sums only.
            assert bool(((weight - hf).abs() <= expand(scales) * 2e-6).all())


def test_q4_linears_of_a_written_file_come_back_as_its_weights(tmp_path):
    """A GGUF written here with gguf's own writer: its Q4_0, Q4_1 (quantized by gguf) and Q4_K
    (random blocks: any bytes are a valid one) linears read back as the weights gguf's own
    dequantizer gives; Q, K and V, one matmul in the native model, stay with the converted
    weights when one of them is of another type."""
    from gguf import GGMLQuantizationType, GGUFWriter, quants

    types = {
        "ffn_down": GGMLQuantizationType.Q4_0,
        "attn_output": GGMLQuantizationType.Q4_1,
        "ffn_gate": GGMLQuantizationType.Q4_K,
        "ffn_up": GGMLQuantizationType.Q4_K,
        "attn_q": GGMLQuantizationType.Q4_0,
        "attn_k": GGMLQuantizationType.Q4_0,
        "attn_v": GGMLQuantizationType.Q8_0,
    }
    generator = np.random.default_rng(0)
    packed = {kind: _gguf_blocks(generator, qtype, quants) for kind, qtype in types.items()}
    path = tmp_path / "written.gguf"
    writer = GGUFWriter(str(path), arch="llama")
    for kind, data in packed.items():
        writer.add_tensor(f"blk.0.{kind}.weight", data, raw_dtype=types[kind])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    config = SimpleNamespace(num_attention_heads=4, num_key_value_heads=2)
    linears = read_int4_linears(path, config)

    hf_names = {
        "ffn_down": "mlp.down_proj",
        "attn_output": "self_attn.o_proj",
        "ffn_gate": "mlp.gate_proj",
        "ffn_up": "mlp.up_proj",
    }
    assert sorted(linears) == sorted(f"model.layers.0.{name}" for name in hf_names.values())
    for kind, name in hf_names.items():
        codes, scales, zeros = linears[f"model.layers.0.{name}"]
        expected = torch.from_numpy(quants.dequantize(packed[kind], types[kind]))
        expand = lambda t: t.repeat_interleave(32, dim=1)  # noqa: E731
        weight = (codes.float() - 8) * expand(scales) + expand(zeros)
        bound = (expand(scales).abs() * 8 + expand(zeros).abs()) * 2e-7 + 1e-7
        assert bool(((weight - expected).abs() <= bound).all()), kind


def test_q8_0_matrices_of_a_written_file_come_back_as_its_weights(tmp_path):
    """Q8_0 blocks of random codes and scales (a file of another quantizer need not put a
    group's largest weight at code 127, so quantizing its weights again would move codes):
    read back as gguf's own dequantizer gives them, Q rows in HF's order; the LM head of an
    untied model is read, of a tied one not; a linear whose fused family has another type
    stays with the converted weights."""
    from gguf import GGMLQuantizationType, GGUFWriter, quants

    q8_0 = GGMLQuantizationType.Q8_0
    generator = np.random.default_rng(1)
    names = ["token_embd", "output", "blk.0.attn_q", "blk.0.attn_k", "blk.0.attn_v"]
    names += ["blk.0.ffn_down", "blk.0.ffn_gate"]
    packed = {}
    for name in names:
        blocks = generator.integers(0, 256, size=(64, 8, 34), dtype=np.uint8)
        scales = generator.uniform(0.001, 0.05, size=(64, 8, 1)).astype(np.float16)
        blocks[..., 0:2] = scales.view(np.uint8)
        packed[name] = blocks.reshape(64, 8 * 34)
    path = tmp_path / "q8_0.gguf"
    writer = GGUFWriter(str(path), arch="llama")
    for name, data in packed.items():
        writer.add_tensor(f"{name}.weight", data, raw_dtype=q8_0)
    writer.add_tensor("blk.0.ffn_up.weight", np.zeros((64, 256), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    untied = SimpleNamespace(num_attention_heads=4, num_key_value_heads=4)
    matrices = read_int8_matrices(path, untied, linears=True)
    expected_names = {
        "token_embd": "model.embed_tokens",
        "output": "lm_head",
        "blk.0.attn_q": "model.layers.0.self_attn.q_proj",
        "blk.0.attn_k": "model.layers.0.self_attn.k_proj",
        "blk.0.attn_v": "model.layers.0.self_attn.v_proj",
        "blk.0.ffn_down": "model.layers.0.mlp.down_proj",
    }
    assert sorted(matrices) == sorted(expected_names.values())  # not ffn_gate: ffn_up is F32
    # Q: head h's file row 2i + pair is HF's row pair * 8 + i (16 rows a head).
    hf_rows = torch.arange(64).reshape(4, 8, 2).transpose(1, 2).reshape(-1)
    for name, hf_name in expected_names.items():
        codes, scales = matrices[hf_name]
        weight = codes.float() * scales.repeat_interleave(32, dim=1)
        expected = torch.from_numpy(quants.dequantize(packed[name], q8_0))
        if name in ("blk.0.attn_q", "blk.0.attn_k"):
            expected = expected[hf_rows]
        assert torch.equal(weight, expected), name

    tied = SimpleNamespace(num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True)
    assert sorted(read_int8_matrices(path, tied, linears=False)) == ["model.embed_tokens"]


def _gguf_blocks(generator, qtype, quants) -> np.ndarray:
    """64 rows of 256 weights in `qtype`'s blocks: quantized by gguf where it can, else random
    blocks with small positive fp16 scales."""
    weights = generator.standard_normal((64, 256)).astype(np.float32)
    if qtype.name != "Q4_K":
        return quants.quantize(weights, qtype)
    blocks = generator.integers(0, 256, size=(64, 1, 144), dtype=np.uint8)
    scales = generator.uniform(0.001, 0.05, size=(64, 1, 2)).astype(np.float16)
    blocks[..., 0:4] = scales.view(np.uint8)  # d and dmin
    return blocks.reshape(64, 144)


def test_a_shard_that_would_split_q8_0_groups_takes_the_dense_weight():
    """Rank 0 of 2 with hidden size 32: o_proj's shard holds 16 of the 32 inputs of each
    Q8_0 group, so it loads the converted dense weight (quantized again per shard); the rest
    take the file's codes."""
    from transformers import LlamaConfig

    from lmserve.rolling_batch.model.families.llama import LlamaForCausalLM
    from lmserve.rolling_batch.model.layers.parallel import TensorParallelGroup

    class RankZeroOfTwo(TensorParallelGroup):
        world_size = 2

    config = LlamaConfig(
        hidden_size=32, intermediate_size=128, num_attention_heads=2, num_key_value_heads=2,
        num_hidden_layers=1, vocab_size=64,
    )  # fmt: skip
    model = LlamaForCausalLM(config, RankZeroOfTwo(), 64)
    layer = "model.layers.0"
    names = ["model.embed_tokens", f"{layer}.self_attn.o_proj", f"{layer}.mlp.down_proj"]
    names += [f"{layer}.self_attn.{p}_proj" for p in "qkv"]

    assert model.expect_int8(names) == set(names) - {f"{layer}.self_attn.o_proj"}
    o_proj = model.model.layers[0].self_attn.o_proj
    assert o_proj.weight.shape == (32, 16) and not o_proj.int8_from_checkpoint
    assert model.model.layers[0].mlp.down_proj.int8_codes.shape == (32, 64)
