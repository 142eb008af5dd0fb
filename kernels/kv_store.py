"""Write the new tokens' K and V into their cache slots.

Caches are `[num_blocks, block_size, kv_heads, head_dim]`; slot `s` is block `s // block_size`,
offset `s % block_size`. A negative slot means "do not store" (padding).
"""

from __future__ import annotations

import torch

from . import cpu_native


def store_kv_reference(
    key: torch.Tensor,  # [T, kv_heads, head_dim]
    value: torch.Tensor,
    k_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] int
) -> None:
    slots = slot_mapping.long()
    if not bool((slots >= 0).all()):  # padding to skip (the model runner's steps have none)
        keep = slots >= 0
        slots, key, value = slots[keep], key[keep], value[keep]
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots, key.to(k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots, value.to(v_cache.dtype))


def store_kv(key, value, k_cache, v_cache, slot_mapping) -> None:
    if k_cache.is_cuda:
        from .kv_store_triton import store_kv_triton

        store_kv_triton(key, value, k_cache, v_cache, slot_mapping)
    elif (native := cpu_native.native_ops()) is not None:
        native.store_kv(key, value, k_cache, v_cache, slot_mapping)
    else:
        store_kv_reference(key, value, k_cache, v_cache, slot_mapping)
