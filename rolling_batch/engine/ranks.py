"""The tensor-parallel ranks of engine=MPI (process.py): their collectives (MPI's on CPU,
NCCL's on GPUs), and the steps rank 0 sends the other ranks, which run them in lockstep (their
all-reduces meet rank 0's)."""

from __future__ import annotations

import logging
import os
import socket
import time

import torch

from ..core.step import AdapterSources
from ..model.layers.parallel import MPIGroup, NcclGroup, TensorParallelGroup

log = logging.getLogger("lmserve.rank")

_STEP_TAG = 11
_BUSY_POLL_S = 0.05  # after a step, poll without sleeping this long (steps come back to back)
_IDLE_SLEEP_S = 0.001  # then sleep between polls: a blocking MPI wait spins a whole core


def ranks_on_this_host(comm) -> int:
    """The ranks sharing this machine's cores and memory (all of them on one host)."""
    from mpi4py import MPI

    return comm.Split_type(MPI.COMM_TYPE_SHARED).Get_size()


def make_group(comm, leader: str | None = None):
    """This rank's collectives: MPI's on CPU, NCCL's on GPUs. `leader`: rank 0's address as
    the other hosts reach it (Runtime.hosts' first), None when every rank is on this host."""
    if not torch.cuda.is_available():
        # This host's cores are shared out between its ranks: more threads than cores (two
        # per rank on 2 cores) measured 5-18x slower under mpiexec here. OMP_NUM_THREADS,
        # when set, is the user's (or a test's: "hosts" sharing one machine) own count.
        cores = len(os.sched_getaffinity(0))
        threads = os.environ.get("OMP_NUM_THREADS", "").strip()
        per_rank = cores // ranks_on_this_host(comm)
        torch.set_num_threads(int(threads) if threads.isdigit() else max(1, per_rank))
        # One rank: no collective to make (MPI would still copy and convert every tensor).
        return MPIGroup(comm) if comm.Get_size() > 1 else TensorParallelGroup()
    import torch.distributed as dist

    port = None
    if comm.Get_rank() == 0:
        # A free port for torch's rendezvous store, which rank 0 serves on every interface.
        with socket.socket() as probe:
            probe.bind(("", 0))
            port = probe.getsockname()[1]
    port = comm.bcast(port, root=0)
    torch.cuda.set_device(comm.Get_rank() % torch.cuda.device_count())
    dist.init_process_group(
        "nccl",
        init_method=rendezvous_address(leader, port),
        rank=comm.Get_rank(),
        world_size=comm.Get_size(),
    )
    return NcclGroup(comm.Get_rank(), comm.Get_size())


def rendezvous_address(leader: str | None, port: int) -> str:
    """Where every rank meets rank 0 to set NCCL up: rank 0's host as the others reach it."""
    host = leader or "127.0.0.1"
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


class StepBroadcaster:
    """Rank 0's `execute`: send the step to every other rank, then run it here too."""

    def __init__(self, runner, comm):
        self.runner = runner
        self.comm = comm

    def execute_step(self, chunks):
        for rank in range(1, self.comm.Get_size()):
            self.comm.send(chunks, dest=rank, tag=_STEP_TAG)
        return self.runner.execute_step(chunks)

    def share_adapters(self, folders: dict[str, str]) -> None:
        for rank in range(1, self.comm.Get_size()):
            self.comm.send(AdapterSources(folders), dest=rank, tag=_STEP_TAG)


def follow(runner, comm) -> None:
    """Ranks > 0: run every step rank 0 sends (and take the adapters it registers or drops
    between steps), until the job ends."""
    last_step = time.monotonic()
    while True:
        if not comm.Iprobe(source=0, tag=_STEP_TAG):
            if time.monotonic() - last_step > _BUSY_POLL_S:
                time.sleep(_IDLE_SLEEP_S)
            continue
        message = comm.recv(source=0, tag=_STEP_TAG)
        if isinstance(message, AdapterSources):
            runner.lora.set_sources(message.folders)
            continue
        runner.execute(message)
        last_step = time.monotonic()
