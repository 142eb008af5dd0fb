"""Real LoRA adapters made with PEFT for the tests: PEFT folders saved under a model dir's
`adapters/`, with random A and B large enough to change what the model says, and HF + PEFT as
the reference they are held to."""

from __future__ import annotations

from pathlib import Path

import torch

# name -> (target_modules, rank, lora_alpha, use_rslora): different targets, ranks and scalings.
TINY_ADAPTERS = {
    "attn": (["q_proj", "v_proj"], 8, 16, False),
    "everything": ("all-linear", 8, 16, False),
    "mlp-rs": (["k_proj", "o_proj", "up_proj", "down_proj"], 4, 8, True),
}
LATE_ADAPTER = (["q_proj", "k_proj", "down_proj"], 4, 16, False)


def save_adapter(
    model_dir: Path,
    name: str,
    target_modules,
    rank: int,
    alpha: float,
    rslora: bool,
    seed: int,
    folder: Path | None = None,
) -> Path:
    """A PEFT LoRA adapter of the model in `model_dir`, saved in `folder` (by default
    `model_dir/adapters/name`, where the server finds it at start)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = LoraConfig(
        r=rank,
        lora_alpha=alpha,
        target_modules=target_modules,
        use_rslora=rslora,
        init_lora_weights=False,  # random B too: an adapter that changes the output
    )
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir), config)
    folder = folder or model_dir / "adapters" / name
    model.save_pretrained(folder)
    return folder


def save_adapters(model_dir: Path, adapters: dict = TINY_ADAPTERS) -> list[str]:
    for seed, (name, spec) in enumerate(adapters.items(), start=1):
        save_adapter(model_dir, name, *spec, seed=seed)
    return list(adapters)


def save_late_adapter(model_dir: Path, root: Path) -> Path:
    """An adapter for the management API to register while serving, saved outside the model
    dir as `root/late`: alpha large enough for it to change what the tiny model says."""
    return save_adapter(model_dir, "late", *LATE_ADAPTER, seed=11, folder=root / "late")


def tiny_model_with_adapters(folder: Path, smollm2_dir: Path) -> Path:
    """The tiny random Llama, wide enough for the test adapters to change what it says, with
    TINY_ADAPTERS in its adapters/ folder."""
    from .conftest import save_tiny_llama

    save_tiny_llama(folder, smollm2_dir, intermediate_size=96, hidden_size=64)
    save_adapters(folder)
    return folder


def peft_model(model_dir: Path, name: str | None, merged: bool = False, folder=None):
    """HF transformers with the adapter through PEFT (`merged`: folded into the weights), fp32;
    the base model when `name` is None. The adapter is `folder`, by default the model dir's
    adapters/name."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    if name is None:
        return base
    model = PeftModel.from_pretrained(base, folder or model_dir / "adapters" / name).eval()
    return model.merge_and_unload() if merged else model
