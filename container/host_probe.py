"""What a host must share with the leader to run the leader's ranks, and the check of every
worker host before the ranks start:

    python -m lmserve.container.host_probe MODEL_DIR [ADAPTERS_DIR]   (on a worker; prints JSON)

lmserve's code (every source file of its packages, Python and C++ kernels, by hash: the
version number stays 0.1.0 whatever the code), the Python the ranks start with, and the files
of the model and of its LoRA adapters (name and size each, and the content of the small ones,
config.json among them, by hash). The leader runs the probe on each worker host through the
same launcher mpiexec uses (`HYDRA_LAUNCHER_EXEC`, else ssh) and compares; a host that cannot
be reached, or differs, stops start-up with its name. Torch-free.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

from lmserve.properties.python_command import python_command

from .cluster import Cluster, ClusterError

_HASHED_BELOW = 1 << 20  # bytes: configs and tokenizers are hashed, weights compared by size
_PROBE_TIMEOUT_S = 60
# The packages whose code serves (the ranks run rolling_batch, kernels and properties; the
# probe itself runs from container); benchmarks/ only measures.
_PACKAGES = ("properties", "container", "handlers", "rolling_batch", "kernels")
_SOURCE_SUFFIXES = (".py", ".cpp", ".h", ".cu")  # what runs, never what a build made of it
_SKIPPED_DIRS = ("__pycache__", "build")


def probe(model_dir: Path, adapters_dir: Path | None = None) -> dict:
    code = code_files(package_roots())
    found = {
        "code": {"digest": code_digest(code), "files": code},
        "python": sys.executable,
        "model": _folder_files(model_dir),
    }
    if adapters_dir is not None:
        found["adapters"] = _folder_files(adapters_dir)
    return found


def package_roots() -> dict[str, Path]:
    """Where each of lmserve's packages is installed (site-packages for a wheel, the repo's
    folders for an editable install), found as imports find it, without importing it."""
    roots = {}
    for name in _PACKAGES:
        spec = importlib.util.find_spec(f"lmserve.{name}")
        if spec is None or not spec.submodule_search_locations:
            raise ClusterError(f"lmserve.{name} is not installed for {sys.executable}")
        roots[name] = Path(spec.submodule_search_locations[0])
    return roots


def code_files(roots: dict[str, Path]) -> dict[str, str]:
    """{package/relative path: a hash of its content} of every source file under `roots`."""
    files = {}
    for name, root in roots.items():
        for folder, subfolders, names in os.walk(root):
            subfolders[:] = [sub for sub in subfolders if _is_source_folder(sub)]
            for file in names:
                if file.endswith(_SOURCE_SUFFIXES):
                    path = Path(folder) / file
                    key = f"{name}/{path.relative_to(root).as_posix()}"
                    files[key] = hashlib.sha256(path.read_bytes()).hexdigest()[:16]
    return dict(sorted(files.items()))


def _is_source_folder(name: str) -> bool:
    return not (name in _SKIPPED_DIRS or name.startswith(".") or name.endswith(".egg-info"))


def code_digest(files: dict[str, str]) -> str:
    """One hash of the files and their hashes, as `code_files` gives them."""
    listing = "".join(f"{name} {digest}\n" for name, digest in sorted(files.items()))
    return hashlib.sha256(listing.encode()).hexdigest()


def _folder_files(folder: Path) -> dict[str, str]:
    files = {}
    for path in sorted(folder.rglob("*")):
        if path.is_file():
            size = path.stat().st_size
            digest = (
                hashlib.sha256(path.read_bytes()).hexdigest()[:16] if size < _HASHED_BELOW else ""
            )
            files[path.relative_to(folder).as_posix()] = f"{size} {digest}".strip()
    return files


def check_hosts(
    cluster: Cluster, model_dir: Path, environ=os.environ, adapters_dir: Path | None = None
) -> None:
    """Raises ClusterError naming every worker host that cannot be reached or differs.
    `adapters_dir`: the LoRA adapters served from start (option.enable_lora), when they are
    not inside the model dir (then they are compared with it)."""
    if adapters_dir is not None and Path(adapters_dir).is_relative_to(model_dir):
        adapters_dir = None
    expected = probe(model_dir, adapters_dir)
    launcher = environ.get("HYDRA_LAUNCHER_EXEC") or "ssh"
    extra = shlex.split(environ.get("HYDRA_LAUNCHER_EXTRA_ARGS", ""))  # e.g. -p 2022
    arguments = [str(model_dir)] + ([str(adapters_dir)] if adapters_dir is not None else [])
    command = shlex.join(python_command("-m", "lmserve.container.host_probe", *arguments))
    problems = []
    for host in cluster.workers:
        # As hydra calls its launcher: `LAUNCHER -x [EXTRA ARGS] HOST COMMAND` (-x: no X11).
        try:
            result = subprocess.run(
                [launcher, "-x", *extra, host, command],
                capture_output=True,
                text=True,
                timeout=_PROBE_TIMEOUT_S,
                check=False,
            )
        except (OSError, subprocess.TimeoutExpired) as error:
            problems.append(f"host {host}: not reached through {launcher}: {error}")
            continue
        if result.returncode != 0:
            tail = " ".join(result.stderr.strip().splitlines()[-2:])
            problems.append(
                f"host {host}: not reached through {launcher} (exit {result.returncode}): {tail}"
            )
            continue
        problems += differences(host, expected, json.loads(result.stdout.splitlines()[-1]))
    if problems:
        raise ClusterError(
            f"the hosts of {cluster.source} cannot run this model's ranks:\n  "
            + "\n  ".join(problems)
        )


def differences(host: str, expected: dict, found: dict) -> list[str]:
    """What `host`'s probe `found` has other than the leader's (`expected`), a line each."""
    problems = _code_differences(host, expected["code"], found.get("code"))
    if found.get("python") != expected["python"]:
        problems.append(
            f"host {host}: python {found.get('python')!r}, the leader's {expected['python']!r}"
        )
    folders = [("model", "the model's files")]
    if "adapters" in expected:
        folders.append(("adapters", "the LoRA adapters' files"))
    for key, what in folders:
        differing = _differing(expected[key], found.get(key) or {})
        if differing:
            problems.append(f"host {host}: {what} differ from the leader's ({differing})")
    return problems


def _code_differences(host: str, ours: dict, theirs: dict | None) -> list[str]:
    if not isinstance(theirs, dict) or "digest" not in theirs:
        return [f"host {host}: lmserve's code differs from the leader's (it gives no digest)"]
    if theirs["digest"] == ours["digest"]:
        return []
    files = _differing(ours["files"], theirs.get("files") or {})
    return [
        f"host {host}: lmserve's code differs from the leader's (digest {theirs['digest'][:12]}"
        f" there, {ours['digest'][:12]} here{'; files: ' + files if files else ''});"
        " every host needs the same lmserve"
    ]


def _differing(ours: dict, theirs: dict) -> str:
    """The names that differ between two {name: hash} listings, the first five."""
    names = sorted(
        name for name in ours.keys() | theirs.keys() if ours.get(name) != theirs.get(name)
    )
    return ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")


if __name__ == "__main__":
    print(json.dumps(probe(*(Path(argument) for argument in sys.argv[1:3]))))
