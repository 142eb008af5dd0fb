"""Attention and KV-cache kernels: a Triton kernel for CUDA, a C++ kernel for CPU
(`cpu_native`, which also holds the fused norm, rotary and activation ops), and a pure-torch
reference with the same signature (the CPU fallback, and what the kernels are tested against).
The dispatchers below pick by device."""

from .kv_store import store_kv
from .paged_attention import paged_attention

__all__ = ["paged_attention", "store_kv"]
