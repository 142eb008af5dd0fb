"""What the offline API accepts as `model`: None (the embedded SmolLM2), an HF directory, a
`.gguf` file or a directory holding one (converted once into the cache)."""

from __future__ import annotations

from pathlib import Path

from .gguf_convert import convert_gguf_once, embedded_gguf


def local_model_path(model: str | Path | None, cache_dir: Path) -> Path:
    if model is None:
        return convert_gguf_once(embedded_gguf(), cache_dir)
    path = Path(model)
    if path.is_file() and path.suffix == ".gguf":
        return convert_gguf_once(path, cache_dir)
    if path.is_dir():
        if (path / "config.json").is_file():
            return path
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return convert_gguf_once(ggufs[0], cache_dir)
    raise ValueError(f"model={str(model)!r}: expected an HF model directory or a .gguf file")
