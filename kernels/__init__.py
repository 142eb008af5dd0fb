"""Attention and KV-cache kernels: a Triton kernel for CUDA and a pure-torch reference with the
same signature for CPU (and for checking the kernel). The dispatchers below pick by device."""

from .kv_store import store_kv
from .paged_attention import paged_attention

__all__ = ["paged_attention", "store_kv"]
