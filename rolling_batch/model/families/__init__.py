"""Model implementations, chosen by the HF config's `architectures` from the table in
rolling_batch/model/architectures.py (which the front end checks before anything starts): a native
module where the family has one, else the generic path over transformers' own modules."""

from __future__ import annotations

import importlib

from ..architectures import native_class


def model_class_for(config):
    """The native class for the config's architecture, or None for the generic path."""
    names = list(getattr(config, "architectures", None) or [])
    if not names and getattr(config, "model_type", None):
        names = [f"{config.model_type} (model_type)"]
    native = native_class(names)
    if native is None:
        return None
    module, name = native[1].split(":")
    return getattr(importlib.import_module(f".{module}", __name__), name)
