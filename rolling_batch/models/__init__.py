"""Native model implementations, chosen by the HF config's `architectures` from the table in
rolling_batch/architectures.py (which the front end checks before anything starts)."""

from __future__ import annotations

import importlib

from ..architectures import native_class


def model_class_for(config):
    names = list(getattr(config, "architectures", None) or [])
    if not names and getattr(config, "model_type", None):
        names = [f"{config.model_type} (model_type)"]
    _, location = native_class(names)
    module, name = location.split(":")
    return getattr(importlib.import_module(f".{module}", __name__), name)
