"""Triton kernel for `kv_store.store_kv_reference` (same signature): one program per token."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _store_kv_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    stride_key_token,
    stride_value_token,
    ROW: tl.constexpr,  # kv_heads * head_dim: one token's K (or V), contiguous
    BLOCK: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)  # int64: slot * ROW overflows int32
    offsets = tl.arange(0, BLOCK)
    mask = (offsets < ROW) & (slot >= 0)
    key = tl.load(key_ptr + token.to(tl.int64) * stride_key_token + offsets, mask=mask)
    value = tl.load(value_ptr + token.to(tl.int64) * stride_value_token + offsets, mask=mask)
    tl.store(k_cache_ptr + slot * ROW + offsets, key, mask=mask)
    tl.store(v_cache_ptr + slot * ROW + offsets, value, mask=mask)


def store_kv_triton(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    key, value = key.to(k_cache.dtype), value.to(v_cache.dtype)
    num_tokens, kv_heads, head_dim = key.shape
    assert key.stride(2) == 1 and key.stride(1) == head_dim, "heads must be contiguous per token"
    assert value.stride(2) == 1 and value.stride(1) == head_dim
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    if num_tokens == 0:
        return
    row = kv_heads * head_dim
    _store_kv_kernel[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        key.stride(0),
        value.stride(0),
        ROW=row,
        BLOCK=triton.next_power_of_2(row),
    )
