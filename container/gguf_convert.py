"""GGUF file -> an HF directory (config, safetensors, tokenizer), once, into the cache.

transformers dequantizes GGUF to fp32 on every load (~16 s for SmolLM2-135M) and its
`save_pretrained` refuses a model that still carries the GGUF quantizer; dropping the quantizer
config first gives a plain checkpoint that every later start (and every process: engine ranks,
front-end tokenizer) loads directly. Runs as a child process so the supervisor never imports
torch: `python -m lmserve.container.gguf_convert SRC.gguf DEST_DIR`.
"""

from __future__ import annotations

import argparse
import os
import shutil
from pathlib import Path


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
    os.replace(partial, destination)  # a crash mid-save never leaves a half directory in use


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("gguf", type=Path)
    parser.add_argument("destination", type=Path)
    args = parser.parse_args()
    convert(args.gguf, args.destination)


if __name__ == "__main__":
    main()
