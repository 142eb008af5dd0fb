"""Where the model comes from: the model dir itself, the embedded default, a local path (absolute
or relative to the model dir) or an HF hub id from the local cache, with clear errors otherwise."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from lmserve.container.model_store import EMBEDDED_NAME, ModelStoreError, resolve_model
from lmserve.properties.config import ServingConfig, load_config

from ..servers import write_properties

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def config_for(model_dir: Path | None, **environ: str) -> ServingConfig:
    return load_config(model_dir, environ=environ).config


@pytest.fixture
def elsewhere(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A working directory unrelated to any model, so relative paths resolve only as intended."""
    folder = tmp_path / "cwd"
    folder.mkdir()
    monkeypatch.chdir(folder)
    return folder


@pytest.fixture
def hub_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty huggingface_hub cache, with the hub unreachable (offline mode)."""
    import huggingface_hub.constants

    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    # huggingface_hub reads both once at import; snapshot_download and its HTTP session look
    # them up on the constants module at call time (is_offline_mode() returns HF_HUB_OFFLINE).
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    return cache


def add_to_hub_cache(cache: Path, repo_id: str, files: dict[str, Path]) -> Path:
    """What a past `snapshot_download(repo_id)` leaves behind: the snapshot and refs/main."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    for name, source in files.items():
        (snapshot / name).symlink_to(source)  # the hub cache links snapshots to blobs
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)  # no newline, as huggingface_hub writes it
    return snapshot


def model_files(folder: Path) -> dict[str, Path]:
    return {p.name: p for p in folder.iterdir() if p.is_file()}


def test_model_dir_holding_a_model_is_the_model(tiny_model_dir, tmp_path):
    model = resolve_model(config_for(tiny_model_dir), tiny_model_dir, tmp_path / "cache")

    assert model.path == tiny_model_dir
    assert model.name == tiny_model_dir.name
    assert model.source == str(tiny_model_dir)
    assert not (tmp_path / "cache").exists()  # an HF folder is used in place, never copied


def test_no_model_anywhere_serves_the_embedded_smollm2(tmp_path, cache_dir, smollm2_dir):
    model_dir = write_properties(tmp_path / "model", {"engine": "Python"})

    model = resolve_model(config_for(model_dir), model_dir, cache_dir)

    assert model.name == EMBEDDED_NAME == "SmolLM2-135M-Instruct"
    assert model.path == smollm2_dir  # the one conversion, reused
    assert (model.path / "config.json").is_file()
    assert (model.path / "model.safetensors").is_file()
    assert model.source.startswith("embedded ") and model.source.endswith(".gguf")


def test_absolute_model_id(tiny_model_dir, tmp_path, elsewhere):
    model_dir = write_properties(tmp_path / "model", {"option.model_id": tiny_model_dir})

    model = resolve_model(config_for(model_dir), model_dir, tmp_path / "cache")

    assert model.path == tiny_model_dir
    assert model.name == tiny_model_dir.name
    assert model.source == str(tiny_model_dir)


def test_absolute_model_id_from_hf_model_id_without_model_dir(tiny_model_dir, tmp_path):
    model = resolve_model(
        config_for(None, HF_MODEL_ID=f"{tiny_model_dir}/"), None, tmp_path / "cache"
    )

    assert model.path == tiny_model_dir
    assert model.name == tiny_model_dir.name


@pytest.mark.parametrize("model_id", ["weights/tiny", "./weights/tiny"])
def test_model_id_relative_to_the_model_dir(tiny_model_dir, tmp_path, elsewhere, model_id):
    model_dir = write_properties(tmp_path / "model", {"option.model_id": model_id})
    shutil.copytree(tiny_model_dir, model_dir / "weights" / "tiny")

    model = resolve_model(config_for(model_dir), model_dir, tmp_path / "cache")

    assert model.path.resolve() == (model_dir / "weights" / "tiny").resolve()
    assert (model.path / "model.safetensors").is_file()
    assert model.name == "tiny"


@pytest.mark.parametrize("model_id", ["/no/such/model", "./no-such-model", "no-such.gguf"])
def test_missing_path_names_option_model_id(tmp_path, elsewhere, hub_cache, model_id):
    model_dir = write_properties(tmp_path / "model", {"option.model_id": model_id})

    with pytest.raises(ModelStoreError) as error:
        resolve_model(config_for(model_dir), model_dir, tmp_path / "cache")

    message = str(error.value)
    assert f"option.model_id={model_id!r}" in message
    assert "no such file or directory" in message


def test_config_without_weights_is_refused(tiny_model_dir, tmp_path):
    folder = tmp_path / "half-copied"
    folder.mkdir()
    for name in ("config.json", "tokenizer.json"):
        shutil.copy(tiny_model_dir / name, folder / name)

    with pytest.raises(ModelStoreError, match=r"config\.json but no \*\.safetensors") as error:
        resolve_model(config_for(None, HF_MODEL_ID=str(folder)), None, tmp_path / "cache")
    assert str(folder) in str(error.value)


def test_folder_of_random_files_lists_what_it_found(tmp_path):
    folder = tmp_path / "not-a-model"
    folder.mkdir()
    (folder / "README.md").write_text("hello")
    (folder / "notes.txt").write_text("hello")
    (folder / "data").mkdir()

    with pytest.raises(ModelStoreError) as error:
        resolve_model(config_for(None, HF_MODEL_ID=str(folder)), None, tmp_path / "cache")

    message = str(error.value)
    assert str(folder) in message and "not a model" in message
    assert "found README.md, data, notes.txt" in message


def test_model_dir_without_model_files_is_not_mistaken_for_a_model(tmp_path, cache_dir):
    # A model dir with a README but no config.json falls back to the embedded default.
    model_dir = write_properties(tmp_path / "model", {"engine": "Python"})
    (model_dir / "README.md").write_text("deployment notes")

    model = resolve_model(config_for(model_dir), model_dir, cache_dir)

    assert model.name == EMBEDDED_NAME


def test_hub_id_resolves_offline_from_the_hf_cache(tiny_model_dir, tmp_path, hub_cache, elsewhere):
    snapshot = add_to_hub_cache(hub_cache, "acme/tiny", model_files(tiny_model_dir))
    model_dir = write_properties(tmp_path / "model", {"engine": "Python"})

    model = resolve_model(config_for(model_dir, HF_MODEL_ID="acme/tiny"), model_dir, tmp_path)

    assert model.path == snapshot
    assert model.name == "tiny"
    assert model.source == "hub acme/tiny"
    assert (model.path / "config.json").read_bytes() == (
        tiny_model_dir / "config.json"
    ).read_bytes()


def test_hub_id_at_a_pinned_revision(tiny_model_dir, tmp_path, hub_cache, elsewhere):
    snapshot = add_to_hub_cache(hub_cache, "acme/tiny", model_files(tiny_model_dir))
    (hub_cache / "models--acme--tiny" / "refs" / "main").unlink()  # only the commit is known

    config = config_for(None, HF_MODEL_ID="acme/tiny", HF_REVISION=COMMIT)
    assert resolve_model(config, None, tmp_path).path == snapshot

    other = config_for(None, HF_MODEL_ID="acme/tiny", HF_REVISION="f" * 40)
    with pytest.raises(ModelStoreError, match="not in the local HF cache"):
        resolve_model(other, None, tmp_path)


def test_hub_id_not_cached_while_offline(tiny_model_dir, tmp_path, hub_cache, elsewhere):
    add_to_hub_cache(hub_cache, "acme/tiny", model_files(tiny_model_dir))

    with pytest.raises(ModelStoreError) as error:
        resolve_model(config_for(None, HF_MODEL_ID="acme/other"), None, tmp_path)

    message = str(error.value)
    assert "option.model_id='acme/other'" in message
    assert "not in the local HF cache" in message and "HF_HUB_OFFLINE=1" in message
    assert not error.value.__cause__


def test_hub_gguf_repo_is_converted_like_a_local_one(tmp_path, hub_cache, cache_dir, smollm2_dir):
    from lmserve.container.model_store import embedded_gguf

    gguf = embedded_gguf()
    add_to_hub_cache(hub_cache, "acme/smol-GGUF", {gguf.name: gguf})

    model = resolve_model(config_for(None, HF_MODEL_ID="acme/smol-GGUF"), None, cache_dir)

    assert (model.path / "config.json").is_file()
    assert model.path == smollm2_dir  # same file, so the cached conversion is reused
