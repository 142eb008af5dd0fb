"""The token ids that end generation, one answer for every engine and the offline API.

transformers' `generate` stops at `model.generation_config.eos_token_id`, which `from_pretrained`
reads from generation_config.json, or from config.json when that file is absent. Two cases
go beyond it, both towards what the checkpoint means: a generation_config.json that names no
eos_token_id falls back to config.json's (generate would never stop at EOS), and a checkpoint
whose configs name none falls back to the tokenizer's eos token (as TGI and vLLM do).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

log = logging.getLogger(__name__)

CONFIG_FILES = ("generation_config.json", "config.json")  # the first naming an EOS wins


def eos_token_ids(
    model_path: str | Path, tokenizer=None, trust_remote_code: bool = False
) -> set[int]:
    """The EOS ids of the HF directory `model_path` (empty if nothing names one).

    `tokenizer` is used only when neither config names an EOS; pass it if already loaded,
    else it is loaded here in that case.
    """
    for name in CONFIG_FILES:
        eos = _config_value(Path(model_path) / name, "eos_token_id")
        if eos is not None and eos != []:
            return {eos} if isinstance(eos, int) else set(eos)
    if tokenizer is None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model_path, trust_remote_code=trust_remote_code)
    fallback = tokenizer.eos_token_id
    if fallback is None:
        log.warning(
            "%s: no EOS token in its configs or tokenizer; generation ends only at a"
            " length limit or stop sequence",
            model_path,
        )
        return set()
    return {fallback}


def _config_value(path: Path, key: str):
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8")).get(key)
    except json.JSONDecodeError as error:
        raise ValueError(f"{path}: not valid JSON ({error})") from None
