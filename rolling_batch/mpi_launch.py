"""How MPI ranks are started: `mpiexec -n N python -m mpi4py -m MODULE ARG`. Through
`python -m mpi4py`, an exception on any rank aborts the whole job instead of leaving the other
ranks waiting. Torch-free (the supervisor imports it)."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path


def mpiexec_path() -> str:
    """The mpiexec beside this Python (the `mpich` wheel puts it in the venv), else PATH's."""
    beside = Path(sys.executable).parent / "mpiexec"
    found = str(beside) if beside.exists() else shutil.which("mpiexec")
    if found is None:
        raise RuntimeError("tensor_parallel_degree > 1 needs mpiexec: pip install mpich mpi4py")
    return found


def rank_command(num_ranks: int, module: str, argument: str) -> list[str]:
    return [
        mpiexec_path(),
        "-n",
        str(num_ranks),
        sys.executable,
        "-m",
        "mpi4py",
        "-m",
        module,
        argument,
    ]
