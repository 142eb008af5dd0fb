"""KV store: new tokens land in their slots and nowhere else; the Triton kernel writes exactly
what the reference writes."""

from __future__ import annotations

import pytest
import torch

from lmserve.kernels.kv_store import store_kv_reference

from . import DEVICE


def caches(num_blocks, block_size, kv_heads, head_dim, dtype, device="cpu"):
    shape = (num_blocks, block_size, kv_heads, head_dim)
    return tuple(torch.zeros(shape, dtype=dtype, device=device) for _ in range(2))


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_reference_writes_each_slot_and_skips_negative_ones(block_size):
    k_cache, v_cache = caches(5, block_size, 3, 4, torch.float32)
    key, value = torch.randn(4, 3, 4), torch.randn(4, 3, 4)
    slots = torch.tensor([0, 2 * block_size + 1 if block_size > 1 else 3, -1, 5 * block_size - 1])
    store_kv_reference(key, value, k_cache, v_cache, slots)
    flat_k, flat_v = k_cache.view(-1, 3, 4), v_cache.view(-1, 3, 4)
    for token, slot in enumerate(slots.tolist()):
        if slot >= 0:
            assert torch.equal(flat_k[slot], key[token]) and torch.equal(flat_v[slot], value[token])
    written = int((slots >= 0).sum())
    assert int((flat_k.abs().sum(dim=(1, 2)) > 0).sum()) == written


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("kv_heads", "head_dim"), [(1, 8), (3, 12)])
def test_triton_kernel_equals_reference(dtype, kv_heads, head_dim):
    from lmserve.kernels.kv_store_triton import store_kv_triton

    # K/V as views into a fused QKV row, the way the attention layer passes them.
    qkv = torch.randn(7, (2 + 2 * kv_heads) * head_dim, device=DEVICE)
    key = qkv[:, 2 * head_dim : (2 + kv_heads) * head_dim].view(7, kv_heads, head_dim)
    value = qkv[:, (2 + kv_heads) * head_dim :].view(7, kv_heads, head_dim)
    slots = torch.tensor([3, 0, -1, 17, 9, -1, 30], dtype=torch.int32, device=DEVICE)
    expected_k, expected_v = caches(4, 8, kv_heads, head_dim, dtype, DEVICE)
    got_k, got_v = caches(4, 8, kv_heads, head_dim, dtype, DEVICE)
    store_kv_reference(key, value, expected_k, expected_v, slots)
    store_kv_triton(key, value, got_k, got_v, slots)
    assert torch.equal(got_k, expected_k) and torch.equal(got_v, expected_v)
