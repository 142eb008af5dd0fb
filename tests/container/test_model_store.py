"""Where the model comes from: the model dir itself or its one model subfolder (DJL's model
store), the embedded default when nothing is configured, a local path (absolute or relative to
the model dir) or an HF hub id from the local cache, with clear errors otherwise."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from lmserve.container.cli import main
from lmserve.container.model_store import (
    EMBEDDED_NAME,
    ModelStoreError,
    resolve_model,
    served_model_dir,
)
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


def test_config_alone_is_a_model_with_dummy_weights(tiny_model_dir, tmp_path):
    folder = tmp_path / "config-only"
    folder.mkdir()
    for name in ("config.json", "tokenizer.json"):
        shutil.copy(tiny_model_dir / name, folder / name)
    config = config_for(None, HF_MODEL_ID=str(folder), OPTION_LOAD_FORMAT="dummy")

    model = resolve_model(config, None, tmp_path / "cache")

    assert model.path == folder
    assert model.serving.native == "llama:LlamaForCausalLM"


def test_dummy_weights_for_a_quantized_checkpoints_config_are_refused(tiny_model_dir, tmp_path):
    folder = tmp_path / "awq"
    folder.mkdir()
    config = json.loads((tiny_model_dir / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": 32}
    (folder / "config.json").write_text(json.dumps(config))
    config = config_for(None, HF_MODEL_ID=str(folder), OPTION_LOAD_FORMAT="dummy")

    with pytest.raises(ModelStoreError, match="load_format=dummy fills dense weights") as error:
        resolve_model(config, None, tmp_path / "cache")
    assert "option.quantize=int4" in str(error.value)


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


def fake_hf_dir(folder: Path) -> Path:
    """What resolve_model checks of an HF folder (it loads nothing): config.json and weights."""
    folder.mkdir(parents=True)
    (folder / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    (folder / "model.safetensors").write_bytes(b"")
    return folder


def resolve_as_the_cli_does(model_dir: Path, cache_dir: Path, **environ: str):
    config = config_for(served_model_dir(model_dir), **environ)
    return resolve_model(config, model_dir, cache_dir)


@pytest.mark.parametrize("extra", [[], [".DS_Store"]], ids=["empty", "hidden-file"])
def test_model_dir_with_nothing_in_it_serves_the_embedded_smollm2(tmp_path, cache_dir, extra):
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    for name in extra:
        (model_dir / name).write_text("")

    assert resolve_as_the_cli_does(model_dir, cache_dir).name == EMBEDDED_NAME
    assert resolve_model(config_for(None), None, cache_dir).name == EMBEDDED_NAME


def test_model_dir_with_files_but_no_model_is_refused_never_served_as_smollm2(tmp_path):
    model_dir = write_properties(tmp_path / "model", {"engine": "Python"})
    (model_dir / "README.md").write_text("deployment notes")
    (model_dir / "code").mkdir()
    (model_dir / "code" / "inference.py").write_text("")

    with pytest.raises(ModelStoreError) as error:
        resolve_as_the_cli_does(model_dir, tmp_path / "cache")

    message = str(error.value)
    assert f"model dir {model_dir}: no model in it (found README.md, code;" in message
    assert "option.model_id" in message and "HF_MODEL_ID" in message


def test_model_dir_with_a_users_handler_is_the_handlers_folder(tmp_path):
    # DJL hands a model.py its own folder as model_dir; it loads what it wants from there.
    model_dir = write_properties(tmp_path / "echo", {"engine": "Python"})
    (model_dir / "model.py").write_text("def handle(inputs):\n    return None\n")
    (model_dir / "requirements.txt").write_text("")

    resolved = resolve_as_the_cli_does(model_dir, tmp_path / "cache")

    assert (resolved.path, resolved.name, resolved.source) == (model_dir, "echo", str(model_dir))


def test_entry_point_file_other_than_model_py(tmp_path):
    model_dir = tmp_path / "echo"
    model_dir.mkdir()
    (model_dir / "my_handler.py").write_text("def handle(inputs):\n    return None\n")

    with pytest.raises(ModelStoreError, match="no model in it"):
        resolve_as_the_cli_does(model_dir, tmp_path / "cache")
    resolved = resolve_as_the_cli_does(
        model_dir, tmp_path / "cache", OPTION_ENTRYPOINT="my_handler.py"
    )
    assert resolved.path == model_dir


def test_djl_builtin_llm_handler_still_needs_a_model(tmp_path):
    properties = {"option.entryPoint": "djl_python.huggingface"}
    model_dir = write_properties(tmp_path / "model", properties)
    (model_dir / "README.md").write_text("")

    with pytest.raises(ModelStoreError, match="no model in it"):
        resolve_as_the_cli_does(model_dir, tmp_path / "cache")


def test_missing_model_dir_is_refused(tmp_path):
    with pytest.raises(ModelStoreError, match="no-such-dir: no such directory"):
        resolve_model(config_for(None), tmp_path / "no-such-dir", tmp_path / "cache")


def test_model_in_one_subfolder_is_served_under_the_folder_name(tmp_path):
    model_dir = tmp_path / "model"
    model = fake_hf_dir(model_dir / "mymodel")

    resolved = resolve_as_the_cli_does(model_dir, tmp_path / "cache")

    assert (resolved.path, resolved.name, resolved.source) == (model, "mymodel", str(model))


def test_subfolder_model_beside_the_model_dirs_own_serving_properties(tmp_path):
    model_dir = write_properties(tmp_path / "model", {"batch_size": 4})
    model = fake_hf_dir(model_dir / "mymodel")

    assert served_model_dir(model_dir) == model_dir  # the top-level file configures the server
    resolved = resolve_as_the_cli_does(model_dir, tmp_path / "cache")

    assert (resolved.path, resolved.name) == (model, "mymodel")


def test_subfolder_with_its_own_serving_properties_is_configured_by_it(tmp_path, elsewhere):
    # DJL's model store: each model folder carries its own serving.properties.
    model_dir = tmp_path / "model"
    subfolder = write_properties(model_dir / "mymodel", {"batch_size": 4, "option.model_id": "w"})
    weights = fake_hf_dir(subfolder / "w")

    assert served_model_dir(model_dir) == subfolder
    assert config_for(served_model_dir(model_dir)).batch_size == 4
    resolved = resolve_as_the_cli_does(model_dir, tmp_path / "cache")

    assert resolved.path == weights  # the relative model_id resolved against the subfolder
    assert resolved.name == "mymodel"


def test_subfolder_with_serving_properties_but_no_model_is_refused(tmp_path):
    model_dir = tmp_path / "model"
    subfolder = write_properties(model_dir / "mymodel", {"batch_size": 4})

    with pytest.raises(ModelStoreError) as error:
        resolve_as_the_cli_does(model_dir, tmp_path / "cache")

    assert f"{subfolder}: not a model" in str(error.value)
    assert "found serving.properties" in str(error.value)


def test_several_model_subfolders_are_refused_with_how_to_choose(tmp_path):
    model_dir = tmp_path / "model"
    fake_hf_dir(model_dir / "llama")
    write_properties(model_dir / "qwen", {"option.model_id": "acme/qwen"})
    (model_dir / "notes").mkdir()  # not a model: never listed as one

    assert served_model_dir(model_dir) == model_dir
    with pytest.raises(ModelStoreError) as error:
        resolve_as_the_cli_does(model_dir, tmp_path / "cache")

    message = str(error.value)
    assert f"model dir {model_dir} holds 2 models (llama, qwen)" in message
    assert "one per server" in message
    assert "option.model_id=<name>" in message and "OPTION_MODEL_ID=<name>" in message


def test_several_model_subfolders_and_a_model_id_naming_one(tmp_path, elsewhere):
    model_dir = tmp_path / "model"
    fake_hf_dir(model_dir / "llama")
    qwen = fake_hf_dir(model_dir / "qwen")

    resolved = resolve_as_the_cli_does(model_dir, tmp_path / "cache", OPTION_MODEL_ID="qwen")

    assert (resolved.path, resolved.name) == (model_dir / "qwen", "qwen")
    assert resolved.path.resolve() == qwen.resolve()


def test_a_model_at_the_top_wins_over_subfolders(tiny_model_dir, tmp_path):
    model_dir = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model_dir)
    fake_hf_dir(model_dir / "draft")

    resolved = resolve_as_the_cli_does(model_dir, tmp_path / "cache")

    assert (resolved.path, resolved.name) == (model_dir, "model")


def test_lmserve_config_reads_the_subfolders_serving_properties(tmp_path, capsys):
    model_dir = tmp_path / "model"
    write_properties(model_dir / "mymodel", {"batch_size": 7})

    with pytest.raises(SystemExit) as exited:
        main(["config", "--model-dir", str(model_dir)])

    assert exited.value.code == 0
    (line,) = [line for line in capsys.readouterr().out.splitlines() if line.startswith("batch_")]
    assert line.split()[1:3] == ["7", "serving.properties"]


def test_serve_refuses_several_models_before_starting_anything(tmp_path, caplog):
    model_dir = tmp_path / "model"
    fake_hf_dir(model_dir / "llama")
    fake_hf_dir(model_dir / "qwen")

    with pytest.raises(SystemExit) as exited:
        main(["serve", "--model-dir", str(model_dir)])

    assert exited.value.code == 2
    assert "holds 2 models (llama, qwen)" in caplog.text


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


def gguf_header(path: Path, architecture: str) -> Path:
    """A GGUF file's header as llama.cpp writes one, with a string array and a number before
    general.architecture (the reader skips values of every kind to reach it)."""
    import struct

    def string(text: str) -> bytes:
        return struct.pack("<Q", len(text)) + text.encode()

    keys = [
        string("general.tags") + struct.pack("<IIQ", 9, 8, 2) + string("a") + string("bc"),
        string("general.file_type") + struct.pack("<II", 4, 15),
        string("general.architecture") + struct.pack("<I", 8) + string(architecture),
    ]
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, len(keys)) + b"".join(keys))
    return path


def test_the_gguf_architecture_is_read_from_the_header():
    from lmserve.rolling_batch.model.architectures import gguf_architecture
    from lmserve.rolling_batch.model.weights.gguf_convert import embedded_gguf

    assert gguf_architecture(embedded_gguf()) == "llama"


def test_a_gguf_the_rolling_batch_cannot_run_is_refused_before_conversion(tmp_path):
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    gguf_header(model_dir / "falcon-7b.Q4_K_M.gguf", "falcon")
    cache = tmp_path / "cache"
    with pytest.raises(ModelStoreError) as refused:
        resolve_as_the_cli_does(model_dir, cache)
    message = str(refused.value)
    assert "falcon (GGUF)" in message and "LlamaForCausalLM" in message
    assert "engine=Python with option.rolling_batch=disable" in message
    assert not (cache / "gguf").exists()  # nothing converted


def test_an_hf_model_the_rolling_batch_cannot_run_is_refused_at_start_up(tmp_path, caplog):
    model_dir = fake_hf_dir(tmp_path / "model")
    config = '{"architectures": ["T5ForConditionalGeneration"], "model_type": "t5"}'
    (model_dir / "config.json").write_text(config)
    with pytest.raises(SystemExit) as exited:
        main(["serve", "--model-dir", str(model_dir)])
    assert exited.value.code == 2
    assert "T5ForConditionalGeneration (generic path): an encoder-decoder model" in caplog.text
    # engine=Python serves it through transformers: nothing to refuse there.
    python = resolve_as_the_cli_does(
        model_dir, tmp_path / "cache", OPTION_ENGINE="Python", OPTION_ROLLING_BATCH="disable"
    )
    assert python.path == model_dir


def test_a_truncated_or_corrupt_gguf_is_refused_naming_the_file(tmp_path):
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    gguf = gguf_header(model_dir / "model.gguf", "llama")
    whole = gguf.read_bytes()
    gguf.write_bytes(whole[:40])
    with pytest.raises(ModelStoreError, match="model.gguf: unreadable GGUF header"):
        resolve_as_the_cli_does(model_dir, tmp_path / "cache")
    # A key's length of 2^62 bytes: refused, never allocated.
    gguf.write_bytes(whole[:24] + (1 << 62).to_bytes(8, "little") + whole[32:])
    with pytest.raises(ModelStoreError, match="a GGUF header string of"):
        resolve_as_the_cli_does(model_dir, tmp_path / "cache")


@pytest.mark.parametrize(
    ("config", "named"),
    [
        ('{"architectures": ["FalconForCausalLM"], "alibi": true}', "FalconForCausalLM (alibi)"),
        (  # dynamic NTK scaling, in the older config key
            '{"architectures": ["LlamaForCausalLM"], "rope_scaling": {"type": "dynamic"}}',
            "LlamaForCausalLM (rope_type=dynamic)",
        ),
    ],
)
def test_a_variant_the_family_cannot_run_is_refused_by_name(tmp_path, config, named):
    model_dir = fake_hf_dir(tmp_path / "model")
    (model_dir / "config.json").write_text(config)
    with pytest.raises(ModelStoreError) as refused:
        resolve_as_the_cli_does(model_dir, tmp_path / "cache")
    assert f"architecture {named}: the rolling batch" in str(refused.value)
    (model_dir / "config.json").write_text('{"architectures": ["FalconForCausalLM"]}')
    assert resolve_as_the_cli_does(model_dir, tmp_path / "cache").path == model_dir
