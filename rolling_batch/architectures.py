"""Which models the rolling batch serves, decided before anything starts. Torch-free: the
front end refuses a model the engine could not load before it converts, loads or starts
anything, with the architecture named and the alternative.

A model's architecture comes from its config.json (`architectures`, else `model_type`), or for
a GGUF file from its header's `general.architecture`, read without loading the file.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

# HF architecture name -> "module:class" under rolling_batch/models/ that serves it natively.
NATIVE_ARCHITECTURES = {
    "LlamaForCausalLM": "llama:LlamaForCausalLM",
    "MistralForCausalLM": "llama:LlamaForCausalLM",
    "Qwen2ForCausalLM": "llama:LlamaForCausalLM",
    "Qwen3ForCausalLM": "qwen3:Qwen3ForCausalLM",
    "Phi3ForCausalLM": "phi3:Phi3ForCausalLM",
    "GemmaForCausalLM": "gemma:GemmaForCausalLM",
    "FalconForCausalLM": "falcon:FalconForCausalLM",
}
# GGUF's general.architecture -> the HF architecture transformers converts it to (of those it
# converts: not the first Gemma's).
GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "falcon": "FalconForCausalLM",
}
ALTERNATIVE = (
    "engine=Python with option.rolling_batch=disable serves any causal LM transformers loads"
    " (HF generate, dynamic batching)"
)


class UnservableModel(ValueError):
    """A model the rolling batch cannot run; the message names why and the alternative."""


def native_class(architectures: list[str]) -> tuple[str, str]:
    """(the first architecture served natively, its "module:class"), or UnservableModel."""
    for name in architectures:
        if name in NATIVE_ARCHITECTURES:
            return name, NATIVE_ARCHITECTURES[name]
    named = ", ".join(architectures) or "none named"
    supported = ", ".join(sorted(NATIVE_ARCHITECTURES))
    raise UnservableModel(
        f"architecture {named}: the rolling batch (engine=MPI) serves {supported}; {ALTERNATIVE}"
    )


def architectures_of(path: Path) -> list[str]:
    """The architectures of an HF directory (config.json) or a .gguf file (its header)."""
    if path.suffix == ".gguf":
        found = gguf_architecture(path)
        return [GGUF_ARCHITECTURES.get(found, f"{found} (GGUF)")]
    try:
        config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return []  # the loader says what is wrong with the folder
    names = config.get("architectures") or []
    if not names and config.get("model_type"):
        names = [f"{config['model_type']} (model_type)"]
    # A variant the family module refuses is its own name here, refused before anything starts.
    variant = " (alibi)" if config.get("alibi") else ""
    return [f"{name}{variant}" for name in names]


# GGUF value types: struct formats of the fixed-size ones, and the two others.
_GGUF_SCALARS = {
    **{0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?"},
    **{10: "Q", 11: "q", 12: "d"},
}
_GGUF_STRING, _GGUF_ARRAY = 8, 9


def gguf_architecture(path: Path) -> str:
    """`general.architecture` from a GGUF file's header (gguf's own reader parses every
    tensor's entry first: seconds for a model; this reads the key-values up to that one)."""
    try:
        with path.open("rb") as file:
            magic, _version, _num_tensors, num_keys = struct.unpack("<4sIQQ", file.read(24))
            if magic != b"GGUF":
                raise UnservableModel(f"{path}: not a GGUF file")
            for _ in range(num_keys):
                key = _read_string(file)
                (kind,) = struct.unpack("<I", file.read(4))
                if key == "general.architecture" and kind == _GGUF_STRING:
                    return _read_string(file)
                _skip_value(file, kind)
    except (OSError, struct.error) as error:
        raise UnservableModel(f"{path}: unreadable GGUF header ({error})") from None
    raise UnservableModel(f"{path}: its GGUF header names no general.architecture")


def _read_string(file) -> str:
    (length,) = struct.unpack("<Q", file.read(8))
    return file.read(length).decode("utf-8", errors="replace")


def _skip_value(file, kind: int) -> None:
    if kind == _GGUF_STRING:
        _read_string(file)
    elif kind == _GGUF_ARRAY:
        element, count = struct.unpack("<IQ", file.read(12))
        if element in _GGUF_SCALARS:
            file.seek(count * struct.calcsize("<" + _GGUF_SCALARS[element]), 1)
        else:
            for _ in range(count):
                _skip_value(file, element)
    elif kind in _GGUF_SCALARS:
        file.seek(struct.calcsize("<" + _GGUF_SCALARS[kind]), 1)
    else:
        raise UnservableModel(f"GGUF header: unknown value type {kind}")
