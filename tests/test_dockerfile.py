"""The Dockerfile cannot be built here (no Docker engine), so it is linted and read."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_hadolint_passes():
    hadolint = shutil.which("hadolint") or str(Path(__file__).parents[1] / ".venv/bin/hadolint")
    result = subprocess.run([hadolint, str(ROOT / "Dockerfile")], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_image_runs_lmserve_serve_on_8080_and_copies_every_package():
    text = (ROOT / "Dockerfile").read_text()
    assert 'ENTRYPOINT ["lmserve"]' in text and 'CMD ["serve"]' in text
    assert "EXPOSE 8080" in text
    assert "torch==2.13.0" in text
    # The C++ CPU kernels need a compiler in the image and are built at image build time.
    assert "g++" in text and "native_ops()" in text
    # `pip install .` in the image needs every folder pyproject maps into lmserve.*.
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    with open(ROOT / "pyproject.toml", "rb") as file:
        folders = tomllib.load(file)["tool"]["setuptools"]["package-dir"].values()
    assert "benchmarks" in folders
    for folder in folders:
        assert f"COPY {folder} ./{folder}" in text
