"""LoRA adapters for engine=Python (option.enable_lora): every PEFT adapter in the adapters
folder (`adapters/<name>/` beside serving.properties or in the model dir), put on the HF model
through PEFT once, at start.

A batch runs with one adapter or none: requests batch by `GenerationParams.batch_key()`, which
holds the adapter. So before a batch its adapter becomes PEFT's active one (`set_adapter`), and a
base-model batch runs with the adapters switched off (`disable_adapter()`). PEFT's mixed-batch
`adapter_names=[...]` argument would also do, but it buys nothing when a batch never mixes
adapters, and it costs a gather and scatter of each adapter's rows in every adapted linear of
every step; the active-adapter path is the plain one HF + PEFT users (and the tests' reference)
run. The switch is process state: safe because one thread runs the batches, one at a time.

Each adapter is first read by the rolling batch's own checks (rolling_batch/lora_adapters.py),
so both engines refuse the same adapters (DoRA, trained biases, modules_to_save, too high a
rank, ...) with the same message naming the adapter, at start. Every adapter stays loaded: its
weights are small next to the model's, a batch uses at most one (option.max_loras is always
met), and option.max_cpu_loras, the rolling batch's cache of adapters, has nothing to bound.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path

import torch

from lmserve.rolling_batch.lora_adapters import TARGETS, find_adapters, load_adapter

log = logging.getLogger(__name__)


def attach_adapters(model, folder: Path, max_rank: int) -> tuple[torch.nn.Module, dict]:
    """(the model with every adapter in the adapters folder `folder` through PEFT, {served name:
    PEFT's name for it}); the model as it was when there are none."""
    sources = find_adapters(folder)
    shapes = adaptable_linears(model)
    for name, source in sources.items():
        # Checked before PEFT reads anything: a refused adapter fails start-up by its name.
        load_adapter(name, source, max_rank, shapes, model.dtype)
    # PEFT keeps adapters in a ModuleDict, whose keys may not hold a "." (a served name such as
    # "llama-3.1-sql" may): PEFT knows each adapter by its position instead.
    peft_names = {name: f"adapter{index}" for index, name in enumerate(sources)}
    for name, source in sources.items():
        model = _load_into(model, source, peft_names[name])
    log.info(
        "LoRA: %d adapter(s) in %s loaded through PEFT: %s",
        len(sources),
        folder,
        ", ".join(sources) or "none",
    )
    return model, peft_names


def adaptable_linears(model) -> dict[str, tuple[int, int]]:
    """{HF module name: (out, in)} of the model's linears an adapter may modify: for the Llama
    family exactly `lora_adapters.linear_shapes(config)`, read off the model so another
    architecture's adapters are refused by the checks rather than crash them."""
    return {
        name: (module.out_features, module.in_features)
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear) and name.rsplit(".", 1)[-1] in TARGETS
    }


def _load_into(model, folder: Path, peft_name: str):
    from peft import PeftModel

    # autocast_adapter_dtype=False keeps the adapter in the dtype of the layer it modifies (the
    # serving dtype), as the rolling batch does; PEFT's default upcasts bf16/fp16 ones to fp32.
    if isinstance(model, PeftModel):
        model.load_adapter(folder, adapter_name=peft_name, autocast_adapter_dtype=False)
        return model
    model = PeftModel.from_pretrained(
        model, folder, adapter_name=peft_name, autocast_adapter_dtype=False
    )
    return model.eval()


def active_adapter(model, peft_name: str | None) -> AbstractContextManager:
    """A context that runs its block on the PeftModel `model` with the adapter `peft_name`
    active, or with every adapter off (the base model) when it is None."""
    if peft_name is None:
        return model.disable_adapter()
    return _activated(model, peft_name)


@contextmanager
def _activated(model, peft_name: str) -> Iterator[None]:
    # inference_mode: the adapter's weights stay frozen (no requires_grad switched on). Nothing
    # to undo afterwards: every batch sets the adapter it runs with.
    model.set_adapter(peft_name, inference_mode=True)
    yield
