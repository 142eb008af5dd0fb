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

Each adapter is first read by the rolling batch's own checks (rolling_batch/lora/adapters.py),
so both engines refuse the same adapters (DoRA, trained biases, modules_to_save, too high a
rank, ...) with the same message naming the adapter, at start or when registered through the
management API. Every adapter stays loaded until it is unregistered: its weights are small next
to the model's, a batch uses at most one (option.max_loras is always met), and
option.max_cpu_loras, the rolling batch's cache of adapters, has nothing to bound. PEFT wraps the
model at the first adapter and is taken off again with the last one (a PeftModel left with no
adapter cannot run).
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path

import torch

from lmserve.rolling_batch.lora.adapters import TARGETS, AdapterError, load_adapter

log = logging.getLogger(__name__)


def attach_adapters(
    model, sources: dict[str, Path], max_rank: int
) -> tuple[torch.nn.Module, dict[str, str]]:
    """(the model with the adapters `sources` ({served name: folder}) on it through PEFT,
    {served name: PEFT's name for it}); the model as it was when there are none."""
    shapes = adaptable_linears(model)
    for name, source in sources.items():
        # Checked before PEFT reads anything: a refused adapter fails start-up by its name.
        load_adapter(name, source, max_rank, shapes, model.dtype)
    # PEFT keeps adapters in a ModuleDict, whose keys may not hold a "." (a served name such as
    # "llama-3.1-sql" may): PEFT knows each adapter by its position instead.
    peft_names = {name: peft_adapter_name(index) for index, name in enumerate(sources)}
    for name, source in sources.items():
        model = _load_into(model, source, peft_names[name])
    log.info(
        "LoRA: %d adapter(s) loaded through PEFT: %s", len(sources), ", ".join(sources) or "none"
    )
    return model, peft_names


def peft_adapter_name(number: int) -> str:
    """PEFT's name for the `number`th adapter loaded (numbers are never reused)."""
    return f"adapter{number}"


def add_adapter(model, name: str, folder: Path, max_rank: int, peft_name: str):
    """The model with the adapter in `folder` on it as `peft_name`, checked as at start first:
    raises AdapterError, the model unchanged, when it cannot be served."""
    load_adapter(name, folder, max_rank, adaptable_linears(model), model.dtype)
    try:
        return _load_into(model, folder, peft_name)
    except Exception as error:  # noqa: BLE001 - what PEFT cannot read is the adapter's fault
        if peft_name in getattr(model, "peft_config", {}):
            model.delete_adapter(peft_name)  # half loaded
        raise AdapterError(name, f"PEFT could not load it: {error}") from None


def remove_adapter(model, peft_name: str):
    """The model without the adapter `peft_name`: the plain model again when it was the last."""
    if list(model.peft_config) == [peft_name]:
        return model.unload()  # PEFT's layers off, nothing merged
    with warnings.catch_warnings():
        # PEFT warns when the active adapter goes; every batch sets its own anyway.
        warnings.filterwarnings("ignore", "Adapter .* was active which is now deleted")
        model.delete_adapter(peft_name)
    return model


def adaptable_linears(model) -> dict[str, tuple[int, int]]:
    """{HF module name: (out, in)} of the model's linears an adapter may modify: for the Llama
    family exactly `lora.adapters.linear_shapes(config)`, read off the model so another
    architecture's adapters are refused by the checks rather than crash them. Under PEFT, read
    off the model it wraps (a linear an adapter modifies is PEFT's layer around it)."""
    if hasattr(model, "peft_config"):
        model = model.get_base_model()
    return {
        name: (module.out_features, module.in_features)
        for name, module in model.named_modules()
        if name.rsplit(".", 1)[-1] in TARGETS
        and isinstance(getattr(module, "base_layer", module), torch.nn.Linear)
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
