"""No Python process lmserve starts has the repository root on sys.path, whatever directory it
runs in: the root's top-level folders (kernels/, container/, properties/, ...) would shadow
installed packages of the same names. transformers imports Hugging Face's `kernels` when it
loads its activations, so a shadowed `kernels` fails the GGUF conversion and the engine.

The server runs as a user runs it, the `lmserve` command from the repository root, with no
PYTHONSAFEPATH of the test suite's own. Installed beside it: the real `kernels` (a dependency
of transformers) and a decoy package named like each other top-level folder. A
`sitecustomize` in the decoys' folder records, for every Python process of the server's tree
(the converter, the engine ranks, gunicorn and its workers), whether an import ever ran with
the repository root on sys.path."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import requests

from ..conftest import REPO_ROOT, TEST_CACHE_DIR
from ..servers import alive, command_line, descendants, free_port, wait_until

pytestmark = pytest.mark.slow

TOP_LEVEL_FOLDERS = ("container", "handlers", "rolling_batch", "kernels", "properties", "tests")

# Runs at every interpreter's start (it is first on PYTHONPATH). An audit hook sees each import
# with the sys.path it searches: a process whose imports ever searched the repository root (or
# the current directory, standing for it) writes a line naming itself and the entry.
SITECUSTOMIZE = """
import json, os, sys

_ROOT = {root!r}
_RECORD = {record!r}
_seen = {{}}

def _searched(path_entries):
    for entry in path_entries:
        resolved = os.path.realpath(entry or os.getcwd())
        if resolved == _ROOT:
            return entry
    return None

def _hook(event, args):
    if event != "import" or _seen.get(os.getpid()) == "shadowed":
        return
    shadowing = _searched(sys.path)
    verdict = "shadowed" if shadowing is not None else "clean"
    if _seen.get(os.getpid()) == verdict:
        return
    _seen[os.getpid()] = verdict
    with open("/proc/self/cmdline", "rb") as own:
        command = own.read().replace(b"\\0", b" ").decode(errors="replace")
    line = {{"pid": os.getpid(), "command": command, "verdict": verdict, "entry": shadowing}}
    with open(_RECORD, "a") as record:
        record.write(json.dumps(line) + "\\n")

sys.addaudithook(_hook)
"""


def decoy_folder(folder: Path, record: Path) -> Path:
    folder.mkdir()
    (folder / "sitecustomize.py").write_text(
        SITECUSTOMIZE.format(root=str(REPO_ROOT.resolve()), record=str(record))
    )
    real_kernels = importlib.util.find_spec("kernels")
    for name in TOP_LEVEL_FOLDERS:
        if name == "kernels" and real_kernels is not None:
            continue  # Hugging Face's, installed with transformers: the real case
        (folder / name).mkdir()
        (folder / name / "__init__.py").write_text(f'"""A decoy installed package: {name}."""\n')
    return folder


def test_shadowing_is_checked_where_the_checkout_would_shadow(tmp_path: Path):
    """The probe itself: `python -c` from the root, without safe-path mode, is caught, and its
    `import kernels` finds the checkout's folder, not the installed package."""
    record = tmp_path / "record.jsonl"
    decoys = decoy_folder(tmp_path / "decoys", record)
    env = {**os.environ, "PYTHONPATH": str(decoys)}
    env.pop("PYTHONSAFEPATH", None)
    probe = "import kernels, container; print(kernels.__file__); print(container.__file__)"
    found = subprocess.run(
        [sys.executable, "-c", probe], cwd=REPO_ROOT, env=env, capture_output=True, text=True
    )
    assert found.stdout.splitlines() == [
        str(REPO_ROOT / "kernels" / "__init__.py"),
        str(REPO_ROOT / "container" / "__init__.py"),
    ]
    verdicts = [json.loads(line)["verdict"] for line in record.read_text().splitlines()]
    assert "shadowed" in verdicts


def test_server_from_the_repository_root_converts_and_serves(tmp_path: Path):
    record = tmp_path / "record.jsonl"
    decoys = decoy_folder(tmp_path / "decoys", record)
    # A cache of its own, so the embedded GGUF is converted in this run; the compiled CPU
    # kernels are shared (building them is not what this test is about).
    cache = tmp_path / "cache"
    cache.mkdir()
    if (TEST_CACHE_DIR / "cpu_kernels").is_dir():
        (cache / "cpu_kernels").symlink_to(TEST_CACHE_DIR / "cpu_kernels")
    env = {**os.environ, "PYTHONPATH": str(decoys), "LMSERVE_CACHE_DIR": str(cache)}
    env.pop("PYTHONSAFEPATH", None)
    for name in ("HF_MODEL_ID", "OPTION_MODEL_ID"):
        env.pop(name, None)
    model_dir = tmp_path / "model"  # configuration alone: the embedded default model
    model_dir.mkdir()
    (model_dir / "serving.properties").write_text("option.max_rolling_batch_size=4\n")
    port = free_port()
    lmserve = Path(sys.executable).parent / "lmserve"
    log_path = tmp_path / "server.log"
    with open(log_path, "wb") as log:
        server = subprocess.Popen(
            [str(lmserve), "serve", "--model-dir", str(model_dir),
             "--host", "127.0.0.1", "--port", str(port)],
            cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
    started: set[int] = set()
    try:

        def healthy() -> bool:
            assert server.poll() is None, f"server exited:\n{log_path.read_text()[-4000:]}"
            started.update(descendants(server.pid))
            try:
                return requests.get(f"http://127.0.0.1:{port}/ping", timeout=5).ok
            except requests.RequestException:
                return False

        wait_until(healthy, "the server is healthy", timeout=600, interval=0.3)
        body = {"inputs": "The capital of France is", "parameters": {"max_new_tokens": 8}}
        answer = requests.post(f"http://127.0.0.1:{port}/invocations", json=body, timeout=120)
        assert answer.status_code == 200, answer.text
        assert "Paris" in answer.json()["generated_text"]
        commands = [command_line(pid) for pid in started | descendants(server.pid)]
    finally:
        server.terminate()
        server.wait(timeout=60)
    assert not [pid for pid in started if alive(pid)]

    records = [json.loads(line) for line in record.read_text().splitlines()]
    shadowed = [r for r in records if r["verdict"] == "shadowed"]
    assert not shadowed, f"processes that searched the repository root: {shadowed}"
    # Every kind of process the server starts was watched, the converter included.
    watched = [r["command"] for r in records]
    for kind in ("gguf_convert", "lmserve.rolling_batch.engine.process", "gunicorn"):
        assert any(kind in command for command in watched), (kind, watched, commands)
    assert (cache / "gguf").is_dir(), "the embedded GGUF was converted in this run"
