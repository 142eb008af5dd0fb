"""A local path -> an HF directory every loader reads (config.json, weights, tokenizer).

An HF directory is used as is; a `.gguf` file, or a folder holding only one, is converted once
into the cache. The server's model store (`lmserve.container.model_store`, which also knows S3,
the hub and the model store layout) and the offline API (`LLM(model=...)`) both go through
`as_hf_dir`, so a path is accepted or refused with the same message wherever it is given.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from .architectures import UnservableModel
from .weights.gguf_convert import convert_gguf_once, embedded_gguf

# Sees the model (an HF directory or a .gguf file) before any conversion: architectures.py's
# serving_path, which raises UnservableModel for a model the engine cannot run.
ArchitectureCheck = Callable[[Path], object]

WEIGHT_SUFFIXES = (".safetensors", ".bin")


class ModelSourceError(ValueError):
    """A path that holds no model lmserve can load; the message names the path."""


def holds_model_files(folder: Path) -> bool:
    """The marks of a model at the folder's top: an HF config.json or a .gguf file."""
    return (folder / "config.json").is_file() or any(folder.glob("*.gguf"))


def as_hf_dir(
    path: Path, cache_dir: Path, check: ArchitectureCheck | None = None, needs_weights: bool = True
) -> Path:
    """An HF directory as is; a .gguf file, or a folder holding only one, converted once.
    `check` sees the model first (before any conversion) and raises UnservableModel for one
    the engine cannot run (a ModelSourceError here). `needs_weights=False`
    (option.load_format=dummy): config.json alone is a model."""
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelSourceError(f"{path}: expected a model directory or a .gguf file")
        _check(check, path)
        return convert_gguf_once(path, cache_dir)
    if not path.is_dir():
        raise ModelSourceError(f"{path}: no such file or directory")
    if (path / "config.json").is_file():
        # A half-finished copy would otherwise fail later, inside the engine, with a less
        # helpful message from the loader.
        if needs_weights and not any(p.suffix in WEIGHT_SUFFIXES for p in path.iterdir()):
            raise ModelSourceError(f"{path}: config.json but no *.safetensors or *.bin weights")
        _check(check, path)
        return path
    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) == 1:
        _check(check, ggufs[0])
        return convert_gguf_once(ggufs[0], cache_dir)
    found = ", ".join(p.name for p in sorted(path.iterdir())[:10]) or "nothing"
    raise ModelSourceError(
        f"{path}: not a model (expected config.json with weights, or one .gguf file; found {found})"
    )


def _check(check: ArchitectureCheck | None, path: Path) -> None:
    if check is None:
        return
    try:
        check(path)
    except UnservableModel as error:
        raise ModelSourceError(str(error)) from None


def local_model_path(model: str | Path | None, cache_dir: Path, needs_weights: bool = True) -> Path:
    """The offline API's `model`: None is the embedded SmolLM2, anything else a local path."""
    if model is None:
        return convert_gguf_once(embedded_gguf(), cache_dir)
    return as_hf_dir(Path(model), cache_dir, needs_weights=needs_weights)
