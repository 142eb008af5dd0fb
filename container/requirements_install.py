"""A model directory's `requirements.txt`, installed at start-up as DJL Serving does, into a
per-model overlay instead of the serving environment.

The overlay is a virtual environment whose site-packages also sees the serving environment's
(a `.pth` file), so pip counts what is installed there as installed: a requirement that torch
or numpy already satisfies installs nothing, and nothing the server runs on is upgraded or
shadowed. Only what is missing lands in the overlay, which the engine process gets on its
PYTHONPATH. Installed once per content of requirements.txt (the cache key), like the model.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import site
import subprocess
import sys
import venv
from pathlib import Path

from lmserve.properties.python_command import python_command

log = logging.getLogger(__name__)

REQUIREMENTS_FILE = "requirements.txt"
_DONE_MARK = ".installed"


class RequirementsError(RuntimeError):
    pass


def install_requirements(model_dir: Path, cache_dir: Path) -> Path | None:
    """The overlay's site-packages holding what the model dir's requirements.txt added, or
    None when there is no requirements.txt."""
    requirements = model_dir / REQUIREMENTS_FILE
    if not requirements.is_file():
        return None
    key = hashlib.sha256(requirements.read_bytes() + sys.version.encode()).hexdigest()[:16]
    overlay = cache_dir / "requirements" / key
    if (overlay / _DONE_MARK).is_file():
        log.info("%s: installed before, in %s", requirements, overlay)
        return _site_packages(overlay)
    partial = overlay.with_name(f"{key}.{os.getpid()}.tmp")
    shutil.rmtree(partial, ignore_errors=True)
    log.info("installing %s into %s (pip's output follows)", requirements, overlay)
    _create_overlay(partial)
    _pip_install(partial, requirements)
    (partial / _DONE_MARK).write_text(requirements.read_text())
    shutil.rmtree(overlay, ignore_errors=True)  # a concurrent start that lost the race
    os.replace(partial, overlay)
    return _site_packages(overlay)


def _create_overlay(folder: Path) -> None:
    venv.EnvBuilder(with_pip=False, symlinks=True).create(folder)
    # `import site; site.addsitedir(...)` also runs the serving environment's own .pth files.
    lines = [f"import site; site.addsitedir({path!r})" for path in _serving_site_packages()]
    (_site_packages(folder) / "lmserve_serving_env.pth").write_text("\n".join(lines) + "\n")


def _pip_install(overlay: Path, requirements: Path) -> None:
    command = [
        *python_command("-m", "pip"),
        "--python",
        str(overlay / "bin" / "python"),
        "install",
        "--disable-pip-version-check",
        "--no-input",
        "-r",
        str(requirements),
    ]
    # Relative paths in requirements.txt (`./my_package`) are relative to the model dir.
    result = subprocess.run(
        command, cwd=requirements.parent, capture_output=True, text=True, check=False
    )
    for line in result.stdout.splitlines():
        log.info("pip: %s", line)
    if result.returncode != 0:
        shutil.rmtree(overlay, ignore_errors=True)
        raise RequirementsError(
            f"{requirements} failed to install (pip exited with {result.returncode}):\n"
            + result.stderr.strip()[-3000:]
        )


def _site_packages(prefix: Path) -> Path:
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    return prefix / "lib" / version / "site-packages"


def _serving_site_packages() -> list[str]:
    return [path for path in site.getsitepackages() if Path(path).is_dir()]
