"""How lmserve starts another Python process: this interpreter, in safe-path mode.

`python -m module` and `python -c` put the current directory first on `sys.path`. Started from a
checkout of lmserve, that is the repository root, whose top-level folders (kernels/, container/,
properties/, ...) then shadow installed packages of the same names: transformers imports Hugging
Face's `kernels`, and gets lmserve's folder instead. `-P` (Python 3.11+) leaves the current
directory off `sys.path`; lmserve's own modules are reached as `lmserve.*` through the installed
package, from any directory. Torch-free: every process that starts another imports it."""

from __future__ import annotations

import sys


def python_command(*arguments: str) -> list[str]:
    """This interpreter's command line for `arguments` (`"-m", "module", ...`), safe-path."""
    return [sys.executable, "-P", *arguments]
