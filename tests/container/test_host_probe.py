"""The start-up check of the hosts a model's ranks span: a host runs only if its lmserve code
(every Python and C++ kernel source of the installed packages, by hash: the version number
never changes), its Python and the files of the model and of the LoRA adapters are the
leader's; and adapters cannot be registered while serving there (only the leader would have
them)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from flask import Flask

from lmserve.container.adapter_routes import add_adapter_routes
from lmserve.container.cluster import Cluster, ClusterError
from lmserve.container.host_probe import (
    check_hosts,
    code_digest,
    code_files,
    differences,
    package_roots,
    probe,
)
from lmserve.properties.config import load_config
from lmserve.rolling_batch.ipc.runtime import Runtime

CLUSTER = Cluster((("leader", 1), ("worker-1", 1)), "DJL_CLUSTER_SIZE=2")
CHANGED = "rolling_batch/engine/sampler.py"


def copy_of_lmserve(folder: Path, changed: str | None = CHANGED) -> Path:
    """lmserve's packages copied as a wheel installs them (`folder/lmserve/<package>`, no
    __pycache__), `changed` edited; returns the folder to put on a host's PYTHONPATH."""
    for name, root in package_roots().items():
        target = folder / "lmserve" / name
        shutil.copytree(root, target, ignore=shutil.ignore_patterns("__pycache__"))
    if changed is not None:
        with open(folder / "lmserve" / changed, "a") as file:
            file.write("\n# this host's own change\n")
    return folder


def fake_launcher(path: Path, setup: str = "") -> dict[str, str]:
    """A launcher called as mpiexec calls ssh (`-x HOST COMMAND`) that runs the command here
    after `setup` (a shell line: the "host's" own environment)."""
    path.write_text(f'#!/bin/sh\nshift 2\n{setup}\nexec sh -c "$*"\n')
    path.chmod(0o755)
    return {"HYDRA_LAUNCHER_EXEC": str(path)}


def test_the_code_digest_covers_every_source_of_the_installed_packages():
    files = code_files(package_roots())
    for name in ("rolling_batch/core/scheduler.py", "rolling_batch/model/layers/linear.py"):
        assert name in files
    assert "kernels/csrc/cpu_ops.cpp" in files  # the C++ kernels the ranks compile
    assert not [name for name in files if "__pycache__" in name or name.endswith(".pyc")]
    assert not [name for name in files if name.startswith("benchmarks/")]
    assert code_digest(files) == code_digest(dict(reversed(files.items())))


def test_a_changed_file_changes_the_digest_and_build_outputs_do_not(tmp_path):
    roots = {"kernels": tmp_path / "kernels"}
    (roots["kernels"] / "csrc").mkdir(parents=True)
    (roots["kernels"] / "ops.py").write_text("x = 1\n")
    (roots["kernels"] / "csrc" / "ops.cpp").write_text("int x;\n")
    before = code_files(roots)
    assert list(before) == ["kernels/csrc/ops.cpp", "kernels/ops.py"]
    for output in ("__pycache__/ops.cpython-311.pyc", "build/ops.o", "ops.so", "build/gen.py"):
        (roots["kernels"] / output).parent.mkdir(exist_ok=True)
        (roots["kernels"] / output).write_text("made by a build")
    assert code_files(roots) == before
    (roots["kernels"] / "csrc" / "ops.cpp").write_text("int y;\n")
    after = code_files(roots)
    assert code_digest(after) != code_digest(before)
    assert [name for name in after if after[name] != before[name]] == ["kernels/csrc/ops.cpp"]


def test_other_code_is_named_with_both_digests(tmp_path):
    leader = probe(tmp_path)
    worker = {**leader, "code": dict(leader["code"], files=dict(leader["code"]["files"]))}
    worker["code"]["files"][CHANGED] = "0" * 16
    worker["code"]["digest"] = code_digest(worker["code"]["files"])
    (problem,) = differences("worker-1", leader, worker)
    assert problem == (
        f"host worker-1: lmserve's code differs from the leader's (digest"
        f" {worker['code']['digest'][:12]} there, {leader['code']['digest'][:12]} here; files:"
        f" {CHANGED}); every host needs the same lmserve"
    )
    older = {key: value for key, value in leader.items() if key != "code"}
    assert "lmserve's code differs" in differences("worker-1", leader, older)[0]
    assert differences("worker-1", leader, leader) == []


def test_a_host_with_other_lmserve_code_is_refused_naming_it_and_the_file(tmp_path):
    """The 'host' runs the probe from a wheel-style copy of lmserve with one file changed."""
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    site = copy_of_lmserve(tmp_path / "site")
    environ = fake_launcher(tmp_path / "fake-ssh", f"export PYTHONPATH={site}")
    with pytest.raises(ClusterError, match=r"host worker-1: lmserve's code differs") as refused:
        check_hosts(CLUSTER, tmp_path / "model", environ)
    assert f"files: {CHANGED});" in str(refused.value)
    (site / "lmserve" / CHANGED).write_bytes(
        (package_roots()["rolling_batch"] / "engine" / "sampler.py").read_bytes()
    )
    check_hosts(CLUSTER, tmp_path / "model", environ)  # the same code, installed elsewhere


def test_start_up_adapters_outside_the_model_dir_are_compared_too(tmp_path):
    model, adapters, copy = tmp_path / "model", tmp_path / "served" / "adapters", tmp_path / "copy"
    model.mkdir()
    (model / "config.json").write_text("{}")
    for folder, rank in ((adapters, 8), (copy, 4)):
        (folder / "tuned").mkdir(parents=True)
        (folder / "tuned" / "adapter_config.json").write_text(f'{{"r": {rank}}}')
    # The "host" sees the copy where the leader has its adapters.
    environ = fake_launcher(
        tmp_path / "fake-ssh", f'set -- "$(echo "$*" | sed s#{adapters}#{copy}#)"'
    )
    with pytest.raises(ClusterError, match=r"host worker-1: the LoRA adapters' files differ"):
        check_hosts(CLUSTER, model, environ, adapters_dir=adapters)
    (copy / "tuned" / "adapter_config.json").write_text('{"r": 8}')
    check_hosts(CLUSTER, model, environ, adapters_dir=adapters)
    check_hosts(CLUSTER, model, environ, adapters_dir=model / "adapters")  # within the model's


class NoEngine:
    def submit(self, command):
        raise AssertionError(f"reached the engine: {command}")


@pytest.mark.parametrize("hosts", [[["10.0.0.1", 1], ["10.0.0.2", 1]], None])
def test_run_time_registration_is_refused_when_ranks_span_hosts(tmp_path, hosts):
    environ = {"OPTION_TENSOR_PARALLEL_DEGREE": "2", "OPTION_ENABLE_LORA": "true"}
    config = load_config(None, environ).config
    runtime = Runtime(config, "m", str(tmp_path), "here", str(tmp_path), hosts=hosts)
    app = Flask(__name__)
    add_adapter_routes(app, runtime, NoEngine())
    answer = app.test_client().post("/models/m/adapters", json={"name": "a", "src": "nowhere"})
    assert answer.status_code == 400
    body = answer.get_json()
    if hosts is None:  # one machine: on to the fields
        assert body["field"] == "src" and "no such folder" in body["message"]
        return
    assert "ranks span 2 hosts (10.0.0.1, 10.0.0.2)" in body["message"]
    assert "adapters/ folder on every host" in body["message"]
