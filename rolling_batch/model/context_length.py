"""The longest prompt + output a model serves: one answer for the front end (which refuses
requests that do not fit) and the engine (which sizes its positions and KV cache by it).
Torch-free: web workers read it from config.json."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

# Where HF configs of different families keep their context length.
_CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")
_HF_DEFAULT = 2048  # what HF assumes for models that do not say


def context_length(model_config: Mapping[str, Any], max_model_len: int | None) -> int:
    """option.max_model_len, else the model config's own context length."""
    if max_model_len is not None:
        return max_model_len
    for key in _CONTEXT_KEYS:
        if isinstance(model_config.get(key), int):
            return model_config[key]
    return _HF_DEFAULT


def context_length_of(model_path: str | Path, max_model_len: int | None) -> int:
    """The same, read from the model directory's config.json."""
    if max_model_len is not None:
        return max_model_len
    return context_length(json.loads((Path(model_path) / "config.json").read_text()), None)
