"""A model dir's requirements.txt installed at start-up into a per-model overlay: what it adds
is importable by the engine, what the serving environment already has is not installed again,
a second start reuses the overlay, and a failing install is a clear error."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from lmserve.container.requirements_install import RequirementsError, install_requirements


def local_package(folder, name="lmserve_test_greeting"):
    """A package directory pip can install without the network, depending on msgspec (which
    the serving environment has)."""
    (folder / name).mkdir(parents=True)
    (folder / name / "__init__.py").write_text("def greet(who):\n    return f'hello, {who}'\n")
    (folder / "pyproject.toml").write_text(
        textwrap.dedent(
            f"""
            [build-system]
            requires = ["setuptools"]
            build-backend = "setuptools.build_meta"
            [project]
            name = "{name.replace("_", "-")}"
            version = "1.0"
            dependencies = ["msgspec"]
            """
        )
    )


def test_no_requirements_file_installs_nothing(tmp_path):
    assert install_requirements(tmp_path, tmp_path / "cache") is None


def test_requirements_install_into_an_overlay_the_engine_can_import(tmp_path, caplog):
    model_dir = tmp_path / "model"
    local_package(model_dir / "greeting")
    (model_dir / "requirements.txt").write_text("./greeting\n")
    site_packages = install_requirements(model_dir, tmp_path / "cache")
    installed = sorted(p.name for p in site_packages.iterdir())
    assert "lmserve_test_greeting" in installed
    assert not any(name.startswith("msgspec") for name in installed)  # the server's own copy
    run = subprocess.run(
        [sys.executable, "-c", "import lmserve_test_greeting as g; print(g.greet('you'))"],
        env={"PYTHONPATH": str(site_packages)},
        capture_output=True,
        text=True,
        check=True,
    )
    assert run.stdout.strip() == "hello, you"
    caplog.clear()
    with caplog.at_level("INFO"):
        assert install_requirements(model_dir, tmp_path / "cache") == site_packages
    assert "installed before" in caplog.text


def test_a_failing_install_names_the_file_and_pips_reason(tmp_path):
    (tmp_path / "requirements.txt").write_text("./no_such_package_dir\n")
    with pytest.raises(RequirementsError, match="requirements.txt failed to install") as error:
        install_requirements(tmp_path, tmp_path / "cache")
    assert "no_such_package_dir" in str(error.value)
    assert not list((tmp_path / "cache" / "requirements").iterdir())  # nothing half-installed
