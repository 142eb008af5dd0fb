"""Build a native model on a device and fill it from an HF checkpoint directory."""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Iterator
from pathlib import Path

import torch

from lmserve.kernels.cpu_native import cpu_has_native_bf16

from ..architectures import REFINED_WEB_TYPES, refined_web_as_falcon
from ..families import model_class_for
from ..families.generic import GenericCausalLM
from ..layers.parallel import TensorParallelGroup
from ..layers.quantized import GROUP_SIZE
from .dummy import fill_random
from .gguf_convert import gguf_source
from .gguf_weights import read_int4_linears, read_int8_matrices, with_file_codes
from .quantized_checkpoint import quantized_linears, read_quantization, unpack_int4

log = logging.getLogger(__name__)

TORCH_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def resolve_dtype(requested: str, checkpoint_dtype: torch.dtype | None, device: str) -> torch.dtype:
    """`auto`: the checkpoint's dtype on GPU; on CPU bf16 where the CPU computes it natively,
    else fp32."""
    if requested != "auto":
        return TORCH_DTYPES[requested]
    if device == "cuda" and checkpoint_dtype is not None:
        return checkpoint_dtype
    return torch.bfloat16 if cpu_has_native_bf16() else torch.float32


def load_hf_config(model_path: str | Path, trust_remote_code: bool = False):
    """transformers' config of the model; Falcon's original RefinedWeb configs as FalconConfig
    (served natively, no remote code needed)."""
    from transformers import AutoConfig, FalconConfig

    raw = Path(model_path) / "config.json"
    if raw.is_file():
        fields = json.loads(raw.read_text(encoding="utf-8"))
        if isinstance(fields, dict) and fields.get("model_type") in REFINED_WEB_TYPES:
            return FalconConfig(**refined_web_as_falcon(fields))
    return AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code)


def iter_checkpoint(model_path: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    for weights in _open_checkpoint(model_path):
        for name in weights.keys():  # noqa: SIM118 - safe_open is not a dict
            yield name, weights.get_tensor(name)


def checkpoint_names(model_path: str | Path) -> Iterator[str]:
    """The checkpoint's tensor names, read from the files' headers only."""
    for weights in _open_checkpoint(model_path):
        yield from weights.keys()


def _open_checkpoint(model_path: str | Path):
    from safetensors import safe_open

    files = sorted(Path(model_path).glob("*.safetensors"))
    if not files:
        raise ValueError(f"{model_path}: no *.safetensors weights (the native runtime reads those)")
    for file in files:
        with safe_open(str(file), framework="pt") as weights:
            yield weights


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def load_model(
    model_path: str | Path,
    hf_config,
    dtype: torch.dtype,
    device: torch.device,
    group: TensorParallelGroup,
    max_model_len: int,
    quantize: str | None = None,
    trust_remote_code: bool = False,
    model_impl: str = "auto",
    load_format: str = "auto",
):
    """`quantize`: option.quantize, None for the checkpoint's own weights (dense, or int4 codes
    when config.json has an AWQ or GPTQ `quantization_config`). `load_format="dummy"`: random
    weights, built on the device, no checkpoint read (weights/dummy.py)."""
    dummy = load_format == "dummy"
    model_class = model_class_for(hf_config) if model_impl != "transformers" else None
    if model_class is None:  # the model's own transformers modules (the generic path)
        if quantize is not None or read_quantization(hf_config, None) is not None:
            raise ValueError("quantized weights are served on the native families only")
        model = GenericCausalLM.from_pretrained(
            model_path, dtype, device, group.world_size, trust_remote_code, dummy
        )
        model.pack_weights()
        return model
    if dummy:
        if read_quantization(hf_config, None) is not None:
            raise ValueError(
                "option.load_format=dummy fills dense weights, not a quantized checkpoint's"
            )
        with _default_dtype(dtype), torch.device(device):
            model = model_class(hf_config, group, max_model_len)
        fill_random(model, getattr(hf_config, "initializer_range", 0.02))
        return _ready(model, device, quantize, quantize)
    checkpoint = read_quantization(hf_config, quantize)
    method = checkpoint.method if checkpoint is not None else quantize
    # Parameters are created in the serving dtype; rotary tables stay fp32 (built explicitly so).
    with _default_dtype(dtype):
        model = model_class(hf_config, group, max_model_len)
    weights = iter_checkpoint(model_path)
    if checkpoint is not None:
        # Checkpoints may leave some linears dense (`modules_to_not_convert`).
        quantized = quantized_linears(checkpoint_names(model_path))
        model.expect_int4(checkpoint.kernel_group_size, quantized)
        weights = unpack_int4(weights, checkpoint)
    elif quantize in ("int4", "int8") and (gguf := gguf_source(model_path)) is not None:
        # What the file holds at the asked width loads as it is (gguf_weights.py).
        int4 = read_int4_linears(gguf, hf_config) if quantize == "int4" else {}
        int8 = read_int8_matrices(gguf, hf_config, linears=quantize == "int8")
        model.expect_int4(GROUP_SIZE, int4)
        int8 = {name: int8[name] for name in model.expect_int8(int8)}
        log.info(
            "%s: %d int4 and %d int8 matrices' codes as %s holds them",
            quantize,
            len(int4),
            len(int8),
            gguf.name,
        )
        weights = with_file_codes(weights, int4, int8)
    model.load_weights(weights)
    return _ready(model, device, quantize if checkpoint is None else None, method)


def _ready(model, device: torch.device, quantize: str | None, method: str | None):
    """The loaded model on its device, its weights packed (quantized at load with `quantize`);
    `method`: how its weights are quantized, for the log."""
    model = model.to(device).eval()
    model.pack_weights(quantize)
    if device.type == "cuda":
        # The dense weights quantization replaced, and its temporaries: the KV cache is sized
        # from the free memory the device reports, which counts torch's cache as used.
        torch.cuda.empty_cache()
    if method is not None:
        _log_quantized(model, method)
    return model


def _log_quantized(model: torch.nn.Module, quantize: str) -> None:
    packed = [getattr(module, "packed", None) for module in model.modules()]
    packed += [model.model.embed_tokens.quantized, model.lm_head_packed]
    for bits in (4, 8):
        # A tied LM head shares the embedding's weight: counted once.
        weights = {id(w): w for w in packed if getattr(w, "bits", None) == bits}.values()
        if not weights:
            continue
        count = sum(w.out_features * w.in_features for w in weights)
        size = sum(w.nbytes for w in weights)
        log.info(
            "%s: %d int%d weights, %.1fM parameters in %.1f MiB (%.3f bytes each; %.1f MiB"
            " as fp32)",
            quantize,
            len(weights),
            bits,
            count / 1e6,
            size / 2**20,
            size / max(count, 1),
            count * 4 / 2**20,
        )
