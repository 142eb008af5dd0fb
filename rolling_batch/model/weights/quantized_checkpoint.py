"""AWQ and GPTQ checkpoints (HF `quantization_config`) read as int4 codes, scales and zeros.

Both formats store, for each decoder linear, 4-bit codes q with a zero point z and an fp16
scale s for each group of input features (w = (q - z) * s), eight codes to an int32:

- AWQ (AutoAWQ's GEMM layout, `version: gemm`): `qweight` [in, out / 8] and `qzeros`
  [in / group, out / 8] packed along the output features in AWQ's interleaved order (nibble i
  of word j holds output 8j + (0, 2, 4, 6, 1, 3, 5, 7)[i]); `scales` [in / group, out].
- GPTQ (AutoGPTQ's layout): `qweight` [in / 8, out] packed along the input features in order
  (nibble i of word j holds input 8j + i); `qzeros` [groups, out / 8] along the outputs in
  order, holding z - 1 in the original format (`checkpoint_format: gptq_v2` holds z);
  `scales` [groups, out]; `g_idx` [in], each input's group.

The int4 linears (layers/quantized.py) compute w = (q - 8) * scale + zero, so the codes are
kept as they are and zero = (8 - z) * s. The kernel holds scales and zeros in bf16: the
checkpoint's fp16 scales lose 3 bits of mantissa there (a relative 2^-9 at most), as every
other int4 scale does. Nothing is dequantized on the way.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

from ..architectures import CHECKPOINT_METHODS
from ..layers.quantized import GROUP_SIZE, KERNEL_GROUP_SIZES

_AWQ_COLUMN_NIBBLE = (0, 4, 1, 5, 2, 6, 3, 7)  # output 8j + c sits in nibble [c] of word j
_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)
_PARTS = {"awq": ("qweight", "qzeros", "scales"), "gptq": ("qweight", "qzeros", "scales", "g_idx")}


@dataclass(frozen=True)
class QuantizedCheckpoint:
    method: str  # "awq" or "gptq"
    group_size: int  # inputs a scale covers in the checkpoint; -1: a whole row (GPTQ)
    zero_offset: int  # added to the stored zero points (1 for the original GPTQ format)

    @property
    def kernel_group_size(self) -> int:
        """Groups as the int4 kernel takes them. A checkpoint group the kernel has no size for
        (a whole row, 512 inputs) repeats its scale and zero over several kernel groups: the
        same weights exactly."""
        if self.group_size == -1:
            return GROUP_SIZE
        return next(size for size in KERNEL_GROUP_SIZES if self.group_size % size == 0)


def quantization_config(hf_config) -> dict:
    """config.json's `quantization_config` ({} for a dense checkpoint)."""
    config = getattr(hf_config, "quantization_config", None)
    if config is not None and not isinstance(config, dict):
        config = config.to_dict()
    return config or {}


def read_quantization(hf_config, requested: str | None) -> QuantizedCheckpoint | None:
    """The checkpoint's int4 format from config.json's `quantization_config`, or None for a
    dense checkpoint; checked against `option.quantize` (`requested`)."""
    config = quantization_config(hf_config)
    method = config.get("quant_method")
    if method is None:
        if requested in CHECKPOINT_METHODS:
            raise ValueError(
                f"option.quantize={requested} loads a checkpoint quantized with {requested},"
                " but config.json has no quantization_config; use option.quantize=int4 or"
                " int8 to quantize this one at load"
            )
        return None
    method = str(method).lower()
    if requested is not None and requested != method:
        raise ValueError(
            f"option.quantize={requested}, but the checkpoint is already quantized with"
            f" {method} (config.json quantization_config); set option.quantize={method} or"
            " leave it unset"
        )
    return _checked_format(method, config)


def _checked_format(method: str, config: dict) -> QuantizedCheckpoint:
    def refuse(what: str) -> ValueError:
        return ValueError(f"quantization_config: {what}; lmserve serves 4-bit AWQ (GEMM) and GPTQ")

    if method not in CHECKPOINT_METHODS:
        raise refuse(f"quant_method {method!r} is not served")
    bits = config.get("bits", config.get("w_bit"))
    if bits != 4:
        raise refuse(f"bits={bits}")
    group_size = config.get("group_size", config.get("q_group_size"))
    if not isinstance(group_size, int) or not (group_size == -1 or group_size % 32 == 0):
        raise refuse(f"group_size={group_size} (the int4 kernel takes multiples of 32, or -1)")
    if method == "awq":
        version = str(config.get("version", "gemm")).lower()
        if version != "gemm" or not config.get("zero_point", True):
            raise refuse(f"AWQ version={version} zero_point={config.get('zero_point')}")
        if group_size == -1:
            raise refuse("AWQ with group_size=-1")
        return QuantizedCheckpoint(method, group_size, 0)
    # transformers' GPTQConfig says `checkpoint_format`; GPTQModel's configs say `format`.
    checkpoint_format = str(config.get("checkpoint_format", config.get("format", "gptq"))).lower()
    if checkpoint_format not in ("gptq", "gptq_v2"):
        raise refuse(f"GPTQ checkpoint_format={checkpoint_format}")
    return QuantizedCheckpoint(method, group_size, 1 if checkpoint_format == "gptq" else 0)


def quantized_linears(names: Iterable[str]) -> set[str]:
    """The linears (`model.layers.0.self_attn.q_proj`) a checkpoint holds quantized."""
    return {name.removesuffix(".qweight") for name in names if name.endswith(".qweight")}


def unpack_int4(
    weights: Iterator[tuple[str, torch.Tensor]], checkpoint: QuantizedCheckpoint
) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors, with each quantized linear's parts (which may come in any
    order) replaced by `<linear>.int4_codes` [out, in] uint8, `.int4_scales` and `.int4_zeros`
    [out, in / kernel_group_size] fp32, what `PackableLinear.expect_int4` takes."""
    parts = _PARTS[checkpoint.method]
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in weights:
        prefix, _, part = name.rpartition(".")
        if part not in parts:
            yield name, tensor
            continue
        linear = pending.setdefault(prefix, {})
        linear[part] = tensor
        if len(linear) == len(parts):
            del pending[prefix]
            try:
                codes, scales, zeros = _unpack_linear(linear, checkpoint)
            except ValueError as error:
                raise ValueError(f"{prefix}: {error}") from None
            yield f"{prefix}.int4_codes", codes
            yield f"{prefix}.int4_scales", scales
            yield f"{prefix}.int4_zeros", zeros
    if pending:
        prefix, found = next(iter(pending.items()))
        raise ValueError(f"{prefix}: the checkpoint has {sorted(found)} of {list(parts)}")


def _unpack_linear(linear: dict[str, torch.Tensor], checkpoint: QuantizedCheckpoint):
    if checkpoint.method == "awq":
        codes = _awq_columns(linear["qweight"])  # [in, out]
    else:
        packed = linear["qweight"]  # [in / 8, out], nibble i of a word: input 8j + i
        codes = _nibbles(packed.transpose(0, 1)).reshape(packed.shape[1], -1).transpose(0, 1)
    in_features, out_features = codes.shape
    scales = linear["scales"].float()  # [groups, out]
    if scales.shape[1] != out_features:
        raise ValueError(f"scales {tuple(scales.shape)} do not fit {out_features} outputs")
    stored = _awq_columns if checkpoint.method == "awq" else _ordered_columns
    zero_points = stored(linear["qzeros"])[:, :out_features] + checkpoint.zero_offset
    group_size = in_features if checkpoint.group_size == -1 else checkpoint.group_size
    if scales.shape[0] * group_size != in_features:
        raise ValueError(f"{scales.shape[0]} groups of {group_size} for {in_features} inputs")
    if checkpoint.method == "gptq":
        _check_groups_in_order(linear["g_idx"], group_size)
    zeros = (8 - zero_points.float()) * scales
    # Groups as the kernel takes them: a checkpoint group over several repeats its values.
    repeat = group_size // checkpoint.kernel_group_size
    scales, zeros = (t.transpose(0, 1).repeat_interleave(repeat, dim=1) for t in (scales, zeros))
    return codes.transpose(0, 1).to(torch.uint8).contiguous(), scales.contiguous(), zeros


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    """[..., n] int32 -> [..., n, 8] codes, nibble i (bits 4i..4i+3) at index i."""
    return (packed.to(torch.int32).unsqueeze(-1) >> _SHIFTS) & 15


def _ordered_columns(packed: torch.Tensor) -> torch.Tensor:
    return _nibbles(packed).reshape(packed.shape[0], -1)


def _awq_columns(packed: torch.Tensor) -> torch.Tensor:
    return _nibbles(packed)[..., list(_AWQ_COLUMN_NIBBLE)].reshape(packed.shape[0], -1)


def _check_groups_in_order(g_idx: torch.Tensor, group_size: int) -> None:
    """Groups of consecutive inputs. GPTQ's act-order (`desc_act`) may give each group inputs
    scattered over the row, which the kernel's contiguous groups cannot hold."""
    expected = torch.arange(g_idx.numel(), dtype=torch.int64) // group_size
    if not torch.equal(g_idx.to(torch.int64), expected):
        raise ValueError(
            "g_idx puts inputs out of order into groups (desc_act / act-order); lmserve serves"
            " GPTQ checkpoints whose groups are consecutive inputs (desc_act=false)"
        )
