"""The tensor-parallel ranks: `mpiexec -n N python -m mpi4py -m lmserve.rolling_batch.mpi_worker
SETTINGS_JSON`. Every rank loads its shard; rank 0 takes work from the driver over a ZeroMQ
socket and sends each step to the other ranks, which run it in lockstep (their all-reduces
meet rank 0's). Started through `python -m mpi4py`, an exception on any rank aborts the job
instead of leaving the others waiting forever.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import sys
import time

import torch

from . import protocol
from .engine_setup import RuntimeOptions, build_runner
from .layers.parallel import MPIGroup, NcclGroup, TensorParallelGroup
from .offline_generation import generate_greedy
from .step import AdapterSources

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

    def __call__(self, chunks):
        return self.execute_step(chunks).logits

    def execute_step(self, chunks):
        for rank in range(1, self.comm.Get_size()):
            self.comm.send(chunks, dest=rank, tag=_STEP_TAG)
        return self.runner.execute_step(chunks)

    def share_adapters(self, folders: dict[str, str]) -> None:
        for rank in range(1, self.comm.Get_size()):
            self.comm.send(AdapterSources(folders), dest=rank, tag=_STEP_TAG)

    def stop_followers(self) -> None:
        for rank in range(1, self.comm.Get_size()):
            self.comm.send(None, dest=rank, tag=_STEP_TAG)


def follow(runner, comm) -> None:
    """Ranks > 0: run every step rank 0 sends until it sends None (and take the adapters it
    registers or drops between steps)."""
    last_step = time.monotonic()
    while True:
        if not comm.Iprobe(source=0, tag=_STEP_TAG):
            if time.monotonic() - last_step > _BUSY_POLL_S:
                time.sleep(_IDLE_SLEEP_S)
            continue
        message = comm.recv(source=0, tag=_STEP_TAG)
        if message is None:
            return
        if isinstance(message, AdapterSources):
            runner.lora.set_sources(message.folders)
            continue
        runner.execute(message)
        last_step = time.monotonic()


def serve_driver(runner, broadcaster: StepBroadcaster, address: str, limits) -> None:
    """Rank 0 for the offline LLM: answer the driver's requests until it says shutdown."""
    import zmq

    sock = zmq.Context.instance().socket(zmq.ROUTER)
    sock.bind(address)
    while True:
        identity, frame = sock.recv_multipart()
        message = protocol.unpack(frame)
        op = message["op"]
        if op == "hello":
            reply = {"ok": True}
        elif op == "generate":
            try:
                token_ids = generate_greedy(
                    broadcaster,
                    runner.num_blocks,
                    runner.block_size,
                    *limits,
                    message["prompts"],
                    message["max_new_tokens"],
                    set(message["eos_token_ids"]),
                    message["ignore_eos"],
                    adapters=message["adapters"],
                    lora=runner.lora,
                    speculative_length=message["speculative_length"],
                )
                reply = {"token_ids": token_ids}
            except ValueError as error:  # refused before any step: the other ranks are idle
                reply = {"error": str(error)}
        elif op == "shutdown":
            broadcaster.stop_followers()
            sock.send_multipart([identity, protocol.pack({"ok": True})])
            sock.close(linger=1000)
            return
        else:
            reply = {"error": f"unknown op {op!r}"}
        sock.send_multipart([identity, protocol.pack(reply)])


def main() -> None:
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    logging.basicConfig(
        level=logging.INFO, format=f"%(asctime)s rank{comm.Get_rank()} %(levelname)s %(message)s"
    )
    settings = json.loads(sys.argv[1])
    group = make_group(comm)
    options = RuntimeOptions(**settings["options"])
    runner, _, max_model_len = build_runner(settings["model_path"], options, group, comm.Get_size())
    if comm.Get_rank() == 0:
        limits = (max_model_len, options.max_rolling_batch_size)
        serve_driver(runner, StepBroadcaster(runner, comm), settings["address"], limits)
    else:
        follow(runner, comm)


if __name__ == "__main__":
    main()
