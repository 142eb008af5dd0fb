"""What a host must share with the leader to run the leader's ranks, and the check of every
worker host before the ranks start:

    python -m lmserve.container.host_probe MODEL_DIR    (run on a worker host; prints JSON)

lmserve's version, the Python the ranks start with, and the model's files (name and size each,
and the content of the small ones, config.json among them, by hash). The leader runs the probe
on each worker host through the same launcher mpiexec uses (`HYDRA_LAUNCHER_EXEC`, else ssh)
and compares; a host that cannot be reached, or differs, stops start-up with its name. Torch-free.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

from .cluster import Cluster, ClusterError

_HASHED_BELOW = 1 << 20  # bytes: configs and tokenizers are hashed, weights compared by size
_PROBE_TIMEOUT_S = 60


def probe(model_dir: Path) -> dict:
    files = {}
    for path in sorted(model_dir.rglob("*")):
        if path.is_file():
            size = path.stat().st_size
            digest = (
                hashlib.sha256(path.read_bytes()).hexdigest()[:16] if size < _HASHED_BELOW else ""
            )
            files[path.relative_to(model_dir).as_posix()] = f"{size} {digest}".strip()
    return {
        "lmserve": importlib.metadata.version("lmserve"),
        "python": sys.executable,
        "model": files,
    }


def check_hosts(cluster: Cluster, model_dir: Path, environ=os.environ) -> None:
    """Raises ClusterError naming every worker host that cannot be reached or differs."""
    expected = probe(model_dir)
    launcher = environ.get("HYDRA_LAUNCHER_EXEC") or "ssh"
    extra = shlex.split(environ.get("HYDRA_LAUNCHER_EXTRA_ARGS", ""))  # e.g. -p 2022
    command = shlex.join([sys.executable, "-m", "lmserve.container.host_probe", str(model_dir)])
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
        problems += _differences(host, expected, json.loads(result.stdout.splitlines()[-1]))
    if problems:
        raise ClusterError(
            f"the hosts of {cluster.source} cannot run this model's ranks:\n  "
            + "\n  ".join(problems)
        )


def _differences(host: str, expected: dict, found: dict) -> list[str]:
    problems = []
    for key in ("lmserve", "python"):
        if found.get(key) != expected[key]:
            problems.append(
                f"host {host}: {key} {found.get(key)!r}, the leader's {expected[key]!r}"
            )
    ours, theirs = expected["model"], found.get("model", {})
    differing = sorted(
        name for name in ours.keys() | theirs.keys() if ours.get(name) != theirs.get(name)
    )
    if differing:
        shown = ", ".join(differing[:5]) + (" ..." if len(differing) > 5 else "")
        problems.append(f"host {host}: the model's files differ from the leader's ({shown})")
    return problems


if __name__ == "__main__":
    print(json.dumps(probe(Path(sys.argv[1]))))
