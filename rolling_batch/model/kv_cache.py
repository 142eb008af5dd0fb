"""The KV cache: per layer a K and a V tensor `[num_blocks, block_size, kv_heads, head_dim]`,
sized from a memory budget after the weights are loaded.

With paged attention off, `block_size` is max_model_len: one block holds a whole sequence,
the contiguous reservation the paged layout is compared against. Same code either way.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CacheShape:
    num_layers: int
    num_kv_heads: int  # on this rank
    head_dim: int
    block_size: int
    dtype: torch.dtype

    @property
    def bytes_per_block(self) -> int:
        element = torch.empty((), dtype=self.dtype).element_size()
        per_layer = 2 * self.block_size * self.num_kv_heads * self.head_dim * element
        return self.num_layers * per_layer


def available_cpu_bytes() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("/proc/meminfo has no MemAvailable")


def memory_budget(
    device: torch.device, gpu_memory_utilization: float, cpu_fraction: float, ranks_here: int
) -> int:
    """Bytes this rank may give the KV cache: on GPU what is left of
    `gpu_memory_utilization` x device memory after the weights; on CPU `cpu_fraction` of the
    available RAM, shared by the ranks on this machine."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        used = total - free
        return max(0, int(gpu_memory_utilization * total) - used)
    return int(cpu_fraction * available_cpu_bytes() / ranks_here)


def allocate(shape: CacheShape, num_blocks: int, device: torch.device):
    dims = (num_blocks, shape.block_size, shape.num_kv_heads, shape.head_dim)
    return [
        (
            torch.zeros(dims, dtype=shape.dtype, device=device),
            torch.zeros(dims, dtype=shape.dtype, device=device),
        )
        for _ in range(shape.num_layers)
    ]


def plan_num_blocks(shape: CacheShape, budget_bytes: int, max_useful_blocks: int) -> int:
    """As many blocks as the budget holds, but no more than the batch could ever touch."""
    num_blocks = min(budget_bytes // shape.bytes_per_block, max_useful_blocks)
    if num_blocks < 1:
        raise MemoryError(
            f"the KV cache budget ({budget_bytes / 2**20:.0f} MiB) holds no block of"
            f" {shape.bytes_per_block / 2**20:.1f} MiB; lower max_model_len or raise the budget"
        )
    return num_blocks
