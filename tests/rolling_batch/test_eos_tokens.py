"""The EOS ids every engine stops at: what transformers' generate stops at, and a sensible answer
where generate would have none."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from lmserve.rolling_batch.model.eos_tokens import eos_token_ids


@pytest.fixture
def checkpoint(tiny_model_dir: Path, tmp_path: Path) -> Path:
    folder = tmp_path / "tiny"
    shutil.copytree(tiny_model_dir, folder)
    return folder


def set_eos(file: Path, eos) -> None:
    values = json.loads(file.read_text())
    if eos is None:
        values.pop("eos_token_id", None)
    else:
        values["eos_token_id"] = eos
    file.write_text(json.dumps(values))


def eos_of_hf_generate(folder: Path) -> set[int]:
    from transformers import AutoModelForCausalLM

    eos = AutoModelForCausalLM.from_pretrained(folder).generation_config.eos_token_id
    return {eos} if isinstance(eos, int) else set(eos)


@pytest.mark.parametrize(
    ("generation_eos", "config_eos", "expected"),
    [([3, 4], 2, {3, 4}), (5, 2, {5}), ("no file", 7, {7})],
    ids=["generation-config-list", "generation-config-wins", "config-json-without-the-file"],
)
def test_same_ids_as_transformers_generate(checkpoint, generation_eos, config_eos, expected):
    set_eos(checkpoint / "config.json", config_eos)
    if generation_eos == "no file":
        (checkpoint / "generation_config.json").unlink()
    else:
        set_eos(checkpoint / "generation_config.json", generation_eos)

    assert eos_token_ids(checkpoint) == expected == eos_of_hf_generate(checkpoint)


def test_generation_config_naming_none_falls_back_to_config_json(checkpoint):
    # transformers' generate would then stop at no EOS at all and run to max_new_tokens.
    set_eos(checkpoint / "generation_config.json", None)
    set_eos(checkpoint / "config.json", 9)

    assert eos_token_ids(checkpoint) == {9}


def test_configs_naming_none_fall_back_to_the_tokenizers_eos(checkpoint):
    from transformers import AutoTokenizer

    (checkpoint / "generation_config.json").unlink()
    set_eos(checkpoint / "config.json", None)
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")

    assert eos_token_ids(checkpoint, tokenizer) == {im_end}
    assert eos_token_ids(checkpoint) == {im_end}  # loads the tokenizer itself


def test_broken_config_names_the_file(checkpoint):
    (checkpoint / "generation_config.json").write_text("{not json")

    with pytest.raises(ValueError, match=r"generation_config\.json: not valid JSON"):
        eos_token_ids(checkpoint)
