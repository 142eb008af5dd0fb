"""A GGUF's quantized tensors read as the file has them: 4-bit linears (Q4_0, Q4_1, Q4_K) as
int4 codes, scales and zeros, Q8_0 matrices as int8 codes and scales.

For option.quantize on a model converted from GGUF (gguf_convert.py records which file), the
tensors already at the asked width load from the file itself rather than being quantized again
from the converted fp32 weights: with int4 the Q4 decoder linears and a Q8_0 embedding and LM
head (int4 serves those as int8), with int8 every Q8_0 one. A Q8_0 block is an fp16 scale d
and 32 int8 codes, w = d q: the int8 weights' layout, so nothing is rounded on the way.

A Q4_0/Q4_1 block holds 32 weights of a row: an fp16 scale d (Q4_1 also an fp16 min m) and 16
bytes of codes, weight j in the low nibble of byte j and weight j + 16 in the high one; Q4_1
means w = d q + m, Q4_0 w = d (q - 8). The int4 linears compute w = (q - 8) scale + zero, so
scale = d and zero = m + 8d (Q4_1) or 0 (Q4_0). Q4_K's groups of 32 (in blocks of 256,
`_unpack_q4_k`) map the same way. The CPU kernel rounds scale and zero to bf16, once: the only
rounding on the way. llama.cpp stores the Q and K rows permuted for its rotary; the rows move
back into HF's order with their blocks, which changes no value. Other tensor types (Q6_K, F16,
F32, ...) come from the converted checkpoint and are quantized to the asked width: Q6_K's
scale a 16 weights has no exact place in groups of 32.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from ..layers.quantized import GROUP_SIZE

_HF_LINEARS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Linears the native model computes as one matmul: kept as codes together or not at all.
_FUSED = (("attn_q", "attn_k", "attn_v"), ("ffn_gate", "ffn_up"))
_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q4_K": 144, "Q8_0": 34}
_INT4_TYPES = ("Q4_0", "Q4_1", "Q4_K")
_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.weight")
_WHOLE_MATRICES = {"token_embd.weight": "model.embed_tokens", "output.weight": "lm_head"}

Int4Parts = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
Int8Parts = tuple[torch.Tensor, torch.Tensor]


def read_int4_linears(gguf: Path, hf_config) -> dict[str, Int4Parts]:
    """{HF linear name (`model.layers.0.self_attn.q_proj`): (codes [out, in] uint8, scales,
    zeros [out, in / 32] fp32)} for the file's Q4_0, Q4_1 and Q4_K decoder linears."""
    return {
        prefix: _reordered(_unpack_q4(tensor), rows)
        for prefix, tensor, rows in _file_matrices(gguf, hf_config, _INT4_TYPES, True, False)
    }


def read_int8_matrices(gguf: Path, hf_config, linears: bool) -> dict[str, Int8Parts]:
    """{HF name (`model.embed_tokens`, `lm_head`, and with `linears` the decoder's): (codes
    [out, in] int8, scales [out, in / 32] fp32)} for the file's Q8_0 tensors: a block is an
    fp16 scale d and 32 int8 codes q, w = d q, which is the int8 weights' own layout."""
    return {
        prefix: _reordered(_unpack_q8_0(tensor), rows)
        for prefix, tensor, rows in _file_matrices(gguf, hf_config, ("Q8_0",), linears, True)
    }


def _file_matrices(gguf: Path, hf_config, types: tuple[str, ...], linears: bool, whole: bool):
    """(HF name, GGUF tensor, its rows in HF's order) for the file's tensors of `types`: with
    `linears` the decoder's linears whose whole fused family has such a type, with `whole` the
    embedding and an untied LM head."""
    from gguf import GGUFReader

    reader = GGUFReader(str(gguf))
    field = reader.fields["general.architecture"]
    permuted = bytes(field.parts[field.data[0]]).decode() == "llama"
    by_layer: dict[int, dict[str, object]] = {}
    for tensor in reader.tensors:
        if tensor.tensor_type.name not in types:
            continue
        if whole and tensor.name in _WHOLE_MATRICES:
            prefix = _WHOLE_MATRICES[tensor.name]
            if prefix != "lm_head" or not getattr(hf_config, "tie_word_embeddings", False):
                yield prefix, tensor, slice(None)
        match = _NAME.fullmatch(tensor.name)
        if linears and match and match[2] in _HF_LINEARS:
            by_layer.setdefault(int(match[1]), {})[match[2]] = tensor
    for layer, tensors in by_layer.items():
        for kind, tensor in tensors.items():
            family = next((f for f in _FUSED if kind in f), (kind,))
            if all(member in tensors for member in family):
                rows = _hf_row_order(kind, len(tensor.data), hf_config, permuted)
                yield f"model.layers.{layer}.{_HF_LINEARS[kind]}", tensor, rows


def _reordered(parts: tuple[torch.Tensor, ...], rows) -> tuple[torch.Tensor, ...]:
    return tuple(part[rows].contiguous() for part in parts)


def _blocks(tensor) -> np.ndarray:
    rows = np.asarray(tensor.data)  # [out, blocks x block bytes]
    return rows.reshape(rows.shape[0], -1, _BLOCK_BYTES[tensor.tensor_type.name])


def _unpack_q8_0(tensor) -> Int8Parts:
    blocks = _blocks(tensor)
    codes = np.ascontiguousarray(blocks[..., 2:]).view(np.int8).reshape(blocks.shape[0], -1)
    return torch.from_numpy(codes), torch.from_numpy(_fp16(blocks[..., 0:2]))


def _unpack_q4(tensor) -> Int4Parts:
    kind = tensor.tensor_type.name
    blocks = _blocks(tensor)
    if kind == "Q4_K":
        return _unpack_q4_k(blocks)
    scales = _fp16(blocks[..., 0:2])
    if kind == "Q4_1":
        zeros = _fp16(blocks[..., 2:4]) + 8 * scales
    else:
        zeros = np.zeros_like(scales)
    nibbles = blocks[..., _BLOCK_BYTES[kind] - GROUP_SIZE // 2 :]
    codes = np.concatenate([nibbles & 15, nibbles >> 4], axis=-1).reshape(blocks.shape[0], -1)
    return torch.from_numpy(codes), torch.from_numpy(scales), torch.from_numpy(zeros)


def _unpack_q4_k(blocks: np.ndarray) -> Int4Parts:
    """Q4_K: 256 weights a block, fp16 d and dmin, then 12 bytes holding eight 6-bit scales s
    and mins m (one per 32 weights), then 128 bytes of codes: bytes 32i..32i+31 hold weights
    64i + j in their low nibbles and 64i + 32 + j in their high ones; w = d s q - dmin m. So a
    group of 32 has scale d s and zero 8 d s - dmin m."""
    out_features = blocks.shape[0]
    d, dmin = _fp16(blocks[..., 0:2]), _fp16(blocks[..., 2:4])  # [out, blocks]
    packed = blocks[..., 4:16].astype(np.int32)  # [out, blocks, 12]
    low, high, extra = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    # Groups 0-3 keep 6 bits in bytes 0-3 (scale) and 4-7 (min); groups 4-7 take 4 bits from
    # bytes 8-11 and their top 2 bits from the top bits of bytes 0-3 / 4-7.
    group_scales = np.concatenate([low & 63, (extra & 15) | ((low >> 6) << 4)], axis=-1)
    group_mins = np.concatenate([high & 63, (extra >> 4) | ((high >> 6) << 4)], axis=-1)
    scales = d[..., None] * group_scales  # [out, blocks, 8]
    zeros = 8 * scales - dmin[..., None] * group_mins
    nibbles = blocks[..., 16:].reshape(out_features, -1, 4, 1, 32)
    codes = np.concatenate([nibbles & 15, nibbles >> 4], axis=-2)  # [out, blocks, 4, 2, 32]
    return (
        torch.from_numpy(codes.reshape(out_features, -1)),
        torch.from_numpy(scales.reshape(out_features, -1).astype(np.float32)),
        torch.from_numpy(zeros.reshape(out_features, -1).astype(np.float32)),
    )


def _fp16(pairs: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(pairs).view(np.float16)[..., 0].astype(np.float32)


def _hf_row_order(kind: str, num_rows: int, hf_config, permuted: bool) -> torch.Tensor | slice:
    """HF row r of a Q or K weight is the file's row order[r] (llama.cpp's convert interleaves
    each head's two rotary halves for its `llama` architecture, Mistral included)."""
    if not permuted or kind not in ("attn_q", "attn_k"):
        return slice(None)
    heads = hf_config.num_attention_heads
    if kind == "attn_k":
        heads = getattr(hf_config, "num_key_value_heads", None) or heads
    half = num_rows // heads // 2
    # The file's rows per head are (i, pair) for i < half, pair in (0, 1): HF's row
    # (pair, i) of the head is the file's row 2i + pair.
    return torch.arange(num_rows).reshape(heads, half, 2).transpose(1, 2).reshape(-1)


def with_file_codes(
    weights: Iterator[tuple[str, torch.Tensor]],
    int4: dict[str, Int4Parts],
    int8: dict[str, Int8Parts],
) -> Iterator[tuple[str, torch.Tensor]]:
    """The converted checkpoint's tensors with the dense weights of `int4` and `int8` replaced
    by their codes, scales (and zeros): what `expect_int4` and `expect_int8` make room for."""
    for name, tensor in weights:
        prefix = name.removesuffix(".weight")
        if prefix not in int4 and prefix not in int8:
            yield name, tensor
    for prefix, (codes, scales, zeros) in int4.items():
        yield f"{prefix}.int4_codes", codes
        yield f"{prefix}.int4_scales", scales
        yield f"{prefix}.int4_zeros", zeros
    for prefix, (codes, scales) in int8.items():
        yield f"{prefix}.int8_codes", codes
        yield f"{prefix}.int8_scales", scales
