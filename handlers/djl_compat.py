"""`import djl_python` for handlers written for DJL Serving, when the real package is absent.

`install()` registers modules named `djl_python`, `djl_python.inputs` and `djl_python.outputs`
that hold lmserve's compatible `Input` and `Output` (handlers/djl_io.py): what a DJL
`model.py` imports. Where the real `djl_python` is installed, it is left alone.
"""

from __future__ import annotations

import importlib.util
import sys
from types import ModuleType

from .djl_io import Input, Output


def install() -> None:
    if "djl_python" in sys.modules or importlib.util.find_spec("djl_python") is not None:
        return
    package = _module("djl_python", Input=Input, Output=Output)
    package.__path__ = []  # a package: `import djl_python.inputs` resolves through sys.modules
    for name, child in (
        ("inputs", _module("djl_python.inputs", Input=Input)),
        ("outputs", _module("djl_python.outputs", Output=Output)),
    ):
        setattr(package, name, child)
        sys.modules[child.__name__] = child
    sys.modules["djl_python"] = package


def _module(name: str, **attributes) -> ModuleType:
    module = ModuleType(name, f"lmserve's stand-in for DJL Serving's {name}")
    for key, value in attributes.items():
        setattr(module, key, value)
    return module
