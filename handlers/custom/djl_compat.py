"""`import djl_python` for handlers written for DJL Serving, when the real package is absent.

`install()` registers modules under DJL's names holding lmserve's compatible pieces: what a
DJL `model.py` imports. `djl_python` and `djl_python.inputs` / `.outputs`: `Input`, `Output`
(handlers/custom/djl_io.py); `djl_python.request_io`: the objects formatters get
(handlers/custom/djl_request_io.py); `djl_python.input_parser.input_formatter` and
`djl_python.output_formatter.output_formatter`: the decorators that mark a model.py's
formatters. Where the real `djl_python` is installed, it is left alone.
"""

from __future__ import annotations

import importlib.util
import sys
from types import ModuleType

from . import djl_request_io
from .djl_io import Input, Output

INPUT_FORMATTER_MARK = "is_input_formatter"
OUTPUT_FORMATTER_MARK = "is_output_formatter"


def input_formatter(function):
    """Marks a model.py function as the request formatter (DJL's decorator)."""
    setattr(function, INPUT_FORMATTER_MARK, True)
    return function


def output_formatter(function):
    """Marks a model.py function as the output formatter (DJL's decorator)."""
    setattr(function, OUTPUT_FORMATTER_MARK, True)
    return function


def install() -> None:
    if "djl_python" in sys.modules or importlib.util.find_spec("djl_python") is not None:
        return
    package = _module("djl_python", Input=Input, Output=Output)
    package.__path__ = []  # a package: `import djl_python.inputs` resolves through sys.modules
    request_io = {
        name: getattr(djl_request_io, name)
        for name in ("Token", "Sequence", "TextInput", "TextGenerationOutput")
    }
    for name, child in (
        ("inputs", _module("djl_python.inputs", Input=Input)),
        ("outputs", _module("djl_python.outputs", Output=Output)),
        ("request_io", _module("djl_python.request_io", **request_io)),
        ("input_parser", _module("djl_python.input_parser", input_formatter=input_formatter)),
        (
            "output_formatter",
            _module("djl_python.output_formatter", output_formatter=output_formatter),
        ),
    ):
        setattr(package, name, child)
        sys.modules[child.__name__] = child
    sys.modules["djl_python"] = package


def _module(name: str, **attributes) -> ModuleType:
    module = ModuleType(name, f"lmserve's stand-in for DJL Serving's {name}")
    for key, value in attributes.items():
        setattr(module, key, value)
    return module
