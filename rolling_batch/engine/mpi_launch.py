"""How MPI ranks are started: `mpiexec -n N python -m mpi4py -m MODULE ARG`. Through
`python -m mpi4py`, an exception on any rank aborts the whole job instead of leaving the other
ranks waiting. Torch-free (the supervisor imports it)."""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path

from lmserve.properties.python_command import python_command

# glibc hands freed buffers above its mmap threshold back to the OS, and the next step's
# equally large buffers (gathered K/V, activations) page-fault in again, every layer of every
# step: decode attention over 64 x 512 tokens measured 5-10x slower for it here. Keep freed
# memory in the process instead (32 MiB is the largest threshold glibc accepts).
# torch's CPU allocator asks for transparent huge pages for its buffers of 2 MiB and more
# (the packed weights, the KV cache) where the kernel leaves them to madvise, as it does by
# default: fewer TLB misses while a decode step streams the weights (1.06x a step at batch 1,
# benchmarks/log/2026-11-24-lora-speculative-cpp-panels.md, "Huge pages").
_ALLOCATOR_ENV = {
    "MALLOC_MMAP_THRESHOLD_": str(32 << 20),
    "MALLOC_TRIM_THRESHOLD_": str(1 << 36),
    "MALLOC_TOP_PAD_": str(512 << 20),
    "THP_MEM_ALLOC_ENABLE": "1",
}


def engine_environment() -> dict[str, str]:
    """The environment for engine processes: ours, with the allocator kept from returning
    memory to the OS and asking for huge pages (a user's own settings of these win)."""
    return {**_ALLOCATOR_ENV, **os.environ}


def mpiexec_path() -> str:
    """The mpiexec beside this Python (the `mpich` wheel puts it in the venv), else PATH's."""
    beside = Path(sys.executable).parent / "mpiexec"
    found = str(beside) if beside.exists() else shutil.which("mpiexec")
    if found is None:
        raise RuntimeError("tensor_parallel_degree > 1 needs mpiexec: pip install mpich mpi4py")
    return found


def rank_command(
    num_ranks: int, module: str, argument: str, options: Sequence[str] = ()
) -> list[str]:
    """`options`: mpiexec's own (the hosts of a cluster, container/cluster.py)."""
    return [
        mpiexec_path(),
        *options,
        "-n",
        str(num_ranks),
        *python_command("-m", "mpi4py", "-m", module, argument),
    ]
