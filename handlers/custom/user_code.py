"""A user's handler code: where it comes from and loading it.

DJL's rules: `option.entryPoint` names a file in the model directory (`model.py`,
`handlers/my.py`), a dotted module on the path, or one of DJL's built-in handlers; without it,
a `model.py` in the model directory is the entry point. DJL's built-in LLM handlers
(`djl_python.huggingface`, `djl_python.lmi_vllm.vllm_async_service`, ...) are lmserve's own LLM
handler here. A user module that defines `handle` replaces the LLM handler.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from . import djl_compat

DEFAULT_ENTRY_POINT = "model.py"
# DJL's built-in handlers of LLMs: lmserve's LLM handler serves in their place.
BUILTIN_LLM_HANDLERS = frozenset(
    {
        "djl_python.huggingface",
        "djl_python.transformers_neuronx",
        "djl_python.deepspeed",
        "djl_python.tensorrt_llm",
        "djl_python.lmi_vllm.vllm_async_service",
        "djl_python.lmi_trtllm.trtllm_async_service",
        "djl_python.vllm",
        "djl_python.lmi_dist",
        "djl_python.rolling_batch",
    }
)


class UserCodeError(RuntimeError):
    """The entry point cannot be found or fails to import; the message says which and why."""


@dataclass(frozen=True)
class EntryPoint:
    """A user module: a file (`path`) or an importable dotted `module` name."""

    name: str  # as the user wrote it, for messages
    path: Path | None = None
    module: str | None = None

    @property
    def location(self) -> str:
        """What another process needs to load it again (`from_location`)."""
        return str(self.path) if self.path is not None else str(self.module)

    @classmethod
    def from_location(cls, location: str) -> EntryPoint:
        if location.endswith(".py"):
            return cls(Path(location).name, path=Path(location))
        return cls(location, module=location)


def defines_handle(entry: EntryPoint) -> bool:
    """Whether the module has a top-level `handle` (then it replaces the LLM handler; else its
    formatters wrap it). Read from the source, without running the user's code; a module whose
    source cannot be found counts as a handler and says what is wrong when it loads."""
    path = entry.path
    if path is None:
        try:
            spec = importlib.util.find_spec(entry.module) if entry.module else None
        except (ImportError, ValueError):  # a parent package that is not there
            return True
        if spec is None or spec.origin is None or not spec.origin.endswith(".py"):
            return True
        path = Path(spec.origin)
    try:
        tree = ast.parse(path.read_text(), str(path))
    except (OSError, SyntaxError, ValueError):
        return True  # loading it reports the problem with the user's own traceback
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == "handle":
            return True
        if isinstance(node, ast.Assign) and any(
            isinstance(target, ast.Name) and target.id == "handle" for target in node.targets
        ):
            return True
    return False


def find_entry_point(entry_point: str | None, model_dir: Path | None) -> EntryPoint | None:
    """The user's module, or None when lmserve's LLM handler serves (no entry point, no
    model.py, or a DJL built-in LLM handler named)."""
    if entry_point is None:
        default = model_dir / DEFAULT_ENTRY_POINT if model_dir is not None else None
        return (
            EntryPoint(DEFAULT_ENTRY_POINT, path=default) if default and default.is_file() else None
        )
    if entry_point in BUILTIN_LLM_HANDLERS:
        return None
    if entry_point.endswith(".py"):
        path = Path(entry_point)
        if not path.is_absolute() and model_dir is not None:
            path = model_dir / path
        if not path.is_file():
            raise UserCodeError(f"option.entryPoint={entry_point!r}: no such file ({path})")
        return EntryPoint(entry_point, path=path)
    if entry_point.startswith("djl_python."):
        known = ", ".join(sorted(BUILTIN_LLM_HANDLERS))
        raise UserCodeError(
            f"option.entryPoint={entry_point!r}: not a DJL handler lmserve provides ({known})"
        )
    return EntryPoint(entry_point, module=entry_point)


def load(entry: EntryPoint, model_dir: Path | None) -> ModuleType:
    """Imports the module with `djl_python` importable and the model directory on sys.path
    (DJL runs handlers from there, so `import helpers` next to model.py works)."""
    djl_compat.install()
    if model_dir is not None and str(model_dir) not in sys.path:
        sys.path.insert(0, str(model_dir))
    try:
        if entry.module is not None:
            return importlib.import_module(entry.module)
        assert entry.path is not None
        spec = importlib.util.spec_from_file_location(entry.path.stem, entry.path)
        if spec is None or spec.loader is None:
            raise UserCodeError(f"{entry.name}: cannot be loaded as a Python module")
        module = importlib.util.module_from_spec(spec)
        sys.modules[entry.path.stem] = module
        spec.loader.exec_module(module)
        return module
    except UserCodeError:
        raise
    except ModuleNotFoundError as error:
        raise UserCodeError(f"{entry.name}: {error} (add it to requirements.txt?)") from error
    except Exception as error:
        raise UserCodeError(f"{entry.name} failed to import: {error!r}") from error
