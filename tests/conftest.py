"""Shared fixtures: the real SmolLM2 (converted once from the embedded GGUF) and a tiny
random-weight Llama that uses SmolLM2's tokenizer, for tests that need speed, not quality."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

# Triton kernels run in Triton's interpreter on CPU; the variable must be set before triton is
# first imported. A machine with a GPU runs them for real.
if not os.environ.get("CUDA_VISIBLE_DEVICES") and not Path("/proc/driver/nvidia/gpus").is_dir():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Every Python a test starts (servers, `python -c` probes, their engine ranks) keeps the current
# directory off sys.path, as lmserve's own launches do (properties/python_command.py): run from
# the repository root, its top-level folders would shadow installed packages (`kernels`).
os.environ["PYTHONSAFEPATH"] = "1"

REPO_ROOT = Path(__file__).resolve().parents[1]
# Kept between local runs (gitignored) so the ~20 s GGUF conversion happens once per machine.
TEST_CACHE_DIR = REPO_ROOT / ".cache" / "tests"
# Servers the tests start get this cache too: the C++ CPU kernels are built once for all.
os.environ.setdefault("LMSERVE_CACHE_DIR", str(TEST_CACHE_DIR))
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


@pytest.fixture(scope="session")
def cache_dir() -> Path:
    TEST_CACHE_DIR.mkdir(parents=True, exist_ok=True)
    return TEST_CACHE_DIR


@pytest.fixture(scope="session")
def smollm2_dir(cache_dir: Path) -> Path:
    from lmserve.rolling_batch.model.weights.gguf_convert import convert_gguf_once, embedded_gguf

    return convert_gguf_once(embedded_gguf(), cache_dir)


def save_tiny_llama(
    folder: Path, smollm2_dir: Path | None, intermediate_size: int = 64, dtype=None, hidden_size=32
) -> Path:
    """A random-weight two-layer Llama with SmolLM2's tokenizer, saved as an HF folder: as
    fast as a model gets (`intermediate_size` makes a step as costly as wanted). Without
    `smollm2_dir` it has no tokenizer: for tests that deal in token ids only."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
        tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(config)
    (model if dtype is None else model.to(dtype)).save_pretrained(folder)
    for name in TOKENIZER_FILES if smollm2_dir is not None else ():
        if (smollm2_dir / name).exists():
            shutil.copy(smollm2_dir / name, folder / name)
    return folder


@pytest.fixture(scope="session")
def tiny_model_dir(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), smollm2_dir)


@pytest.fixture(autouse=True, scope="session")
def _offline() -> None:
    # No test may reach a model hub (the Makefile sets it too; this covers a bare `pytest`).
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
