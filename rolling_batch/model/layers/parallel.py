"""Tensor-parallel groups and the rules for splitting dimensions across ranks.

On CPU the collectives go through MPI on the tensors' numpy views (5-30 us for decode-size
all-reduces here, against ~0.5 ms for torch.distributed's gloo); on CUDA through NCCL.
Splits may be uneven: SmolLM2's 9 query / 3 KV heads do not divide by every degree.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def balanced_split(total: int, parts: int, index: int) -> tuple[int, int]:
    """(start, size) of part `index` when `total` items go to `parts` ranks as evenly as
    possible; the first `total % parts` ranks take one more."""
    base, extra = divmod(total, parts)
    start = index * base + min(index, extra)
    return start, base + (1 if index < extra else 0)


class TensorParallelGroup:
    """A single process: every collective is the identity."""

    rank = 0
    world_size = 1

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def all_gather_last_dim(self, tensor: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        return tensor


class MPIGroup(TensorParallelGroup):
    """The ranks of an `mpiexec` job, CPU tensors. MPI has no bf16/fp16 type: those are
    reduced in fp32 (also more exact) and cast back."""

    def __init__(self, comm):
        from mpi4py import MPI

        self._mpi = MPI
        self.comm = comm
        self.rank = comm.Get_rank()
        self.world_size = comm.Get_size()

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        buffer = tensor.contiguous().float()
        self.comm.Allreduce(self._mpi.IN_PLACE, buffer.numpy())
        return buffer.to(tensor.dtype)

    def all_gather_last_dim(self, tensor: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        rows = tensor.shape[0]
        send = tensor.contiguous().float()
        receive = torch.empty(rows * sum(sizes), dtype=torch.float32)
        counts = [rows * size for size in sizes]
        displacements = [sum(counts[:i]) for i in range(len(counts))]
        self.comm.Allgatherv(
            send.numpy(), [receive.numpy(), counts, displacements, self._mpi.FLOAT]
        )
        shards = torch.split(receive, counts)
        full = torch.cat([s.view(rows, size) for s, size in zip(shards, sizes)], dim=-1)
        return full.to(tensor.dtype)


class NcclGroup(TensorParallelGroup):
    """MPI ranks on GPUs: torch.distributed with NCCL (rank i on GPU i)."""

    def __init__(self, rank: int, world_size: int):
        import torch.distributed as dist

        self._dist = dist
        self.rank = rank
        self.world_size = world_size

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        self._dist.all_reduce(tensor)
        return tensor

    def all_gather_last_dim(self, tensor: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        # NCCL's all_gather wants equal shapes: pad to the largest shard, then trim.
        width = max(sizes)
        padded = torch.nn.functional.pad(tensor, (0, width - tensor.shape[-1])).contiguous()
        gathered = [torch.empty_like(padded) for _ in sizes]
        self._dist.all_gather(gathered, padded)
        return torch.cat([g[..., :size] for g, size in zip(gathered, sizes)], dim=-1)


@dataclass(frozen=True)
class HeadShard:
    """The attention heads one rank computes: query heads [q_start, q_start + num_q) and the
    KV heads they read, [kv_start, kv_start + num_kv). Every local query head group reads one
    local KV head, `num_q // num_kv` query heads per KV head."""

    q_start: int
    num_q: int
    kv_start: int
    num_kv: int


def shard_heads(num_q_heads: int, num_kv_heads: int, world_size: int, rank: int) -> HeadShard:
    """With at most as many ranks as KV heads, KV heads are split (unevenly if need be) and
    query heads follow their KV head. With more ranks, each rank gets one KV head, replicated,
    and a share of that head's query heads; a rank with no query head cannot work."""
    group = num_q_heads // num_kv_heads
    if world_size <= num_kv_heads:
        kv_start, num_kv = balanced_split(num_kv_heads, world_size, rank)
        return HeadShard(kv_start * group, num_kv * group, kv_start, num_kv)
    kv_head = rank * num_kv_heads // world_size
    sharing = [r for r in range(world_size) if r * num_kv_heads // world_size == kv_head]
    if len(sharing) > group:
        raise ValueError(
            f"tensor_parallel_degree={world_size} cannot shard {num_q_heads} query heads /"
            f" {num_kv_heads} KV heads: {len(sharing)} ranks would share a KV head that has only"
            f" {group} query heads; use a degree <= {num_kv_heads} or one that gives every rank"
            " a query head"
        )
    offset, num_q = balanced_split(group, len(sharing), sharing.index(rank))
    return HeadShard(kv_head * group + offset, num_q, kv_head, 1)
