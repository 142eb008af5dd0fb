"""What a step of a Llama-shaped model must cost at least on a device: the bytes it reads
(weights once, each sequence's K/V once) over the device's read bandwidth, and its floating-point
operations over its matrix rate, both ceilings measured on the device itself (METHOD.md's two
numbers). A measured step over the larger of the two floors is its share of the roofline."""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass

from .step_floor import ModelShape


@dataclass(frozen=True)
class LlamaShape(ModelShape):
    """step_floor's shape of a step's work, with what a whole model's bytes also need."""

    tied: bool = False  # the LM head is the embedding table

    @classmethod
    def of(cls, config: dict, element_bytes: int = 2) -> LlamaShape:
        """From an HF Llama config.json's fields."""
        shape = ModelShape.from_config(config, element_bytes)
        return cls(**asdict(shape), tied=bool(config.get("tie_word_embeddings", False)))

    @property
    def matmul_params(self) -> int:
        """Weights every token multiplies: the decoder's linears and the LM head."""
        return self.layers * self.layer_weights + self.vocab * self.hidden

    @property
    def num_params(self) -> int:
        norms = (2 * self.layers + 1) * self.hidden
        embedding = 0 if self.tied else self.vocab * self.hidden
        return self.matmul_params + norms + embedding

    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.element_bytes

    def decode_bytes(self, batch: int, context: int) -> int:
        """One decode step of `batch` sequences with `context` cached tokens each: every
        weight read once (the embedding only at the batch's rows), every sequence's K/V once,
        the new K/V written."""
        weights = (self.num_params - (0 if self.tied else self.vocab * self.hidden)) * (
            self.element_bytes
        )
        embedding_rows = batch * self.hidden * self.element_bytes
        return weights + embedding_rows + batch * (context + 1) * self.kv_bytes_per_token()

    def attention_flops(self, query_rows: int, keys_each: float) -> float:
        # QK^T and PV: 2 flops a multiply-add, twice, per head and layer.
        return 4.0 * query_rows * keys_each * self.q_heads * self.head_dim * self.layers

    def decode_flops(self, batch: int, context: int) -> float:
        return 2.0 * self.matmul_params * batch + self.attention_flops(batch, context + 1)

    def prefill_flops(self, prompt: int) -> float:
        """A whole prompt in one step, its last row through the LM head (causal: each row sees
        half the keys on average)."""
        decoder = 2.0 * self.layers * self.layer_weights * prompt
        head = 2.0 * self.vocab * self.hidden
        return decoder + head + self.attention_flops(prompt, (prompt + 1) / 2)


@dataclass(frozen=True)
class Ceilings:
    read_bytes_per_s: float  # the better of a large copy (read + write) and a reduction
    copy_bytes_per_s: float
    matmul_flops_per_s: float  # a large square product in the serving dtype, random data
    matmul_size: int

    def floor_s(self, num_bytes: float, flops: float) -> tuple[float, str]:
        """The step's floor and which ceiling sets it ("memory" or "matmul")."""
        memory, compute = num_bytes / self.read_bytes_per_s, flops / self.matmul_flops_per_s
        return (memory, "memory") if memory >= compute else (compute, "matmul")


def measure_ceilings(device, dtype, buffer_bytes: int, matmul_size: int) -> Ceilings:
    """The device's own ceilings: buffers several times any cache, random data (zeros run
    faster than real data on some devices), medians of timed repeats after a warm-up."""
    copy_rate, read_rate = _memory_rates(device, buffer_bytes)
    matmul = _matmul_seconds(device, dtype, matmul_size)
    return Ceilings(
        read_bytes_per_s=max(copy_rate, read_rate),
        copy_bytes_per_s=copy_rate,
        matmul_flops_per_s=2.0 * matmul_size**3 / matmul,
        matmul_size=matmul_size,
    )


def _memory_rates(device, buffer_bytes: int) -> tuple[float, float]:
    """(copy bytes a second counting reads and writes, reduction bytes read a second); two
    sources alternate so no repeat finds its input in a cache."""
    import torch

    sources = [torch.randn(buffer_bytes // 2, device=device, dtype=torch.bfloat16) for _ in "ab"]
    target = torch.empty_like(sources[0])
    copy = median_seconds(lambda i: target.copy_(sources[i % 2]), device)
    read = median_seconds(lambda i: sources[i % 2].sum(dtype=torch.float32), device)
    return 2 * buffer_bytes / copy, buffer_bytes / read


def _matmul_seconds(device, dtype, size: int) -> float:
    import torch

    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    return median_seconds(lambda _: a @ b, device)


def median_seconds(
    work, device, warmup: int = 3, repeats: int = 10, enough_s: float = 2.0
) -> float:
    """Median wall time of `work(i)`, the device synchronized before and after each call (the
    host clock then brackets the device's work); `repeats` calls, or as many as fit in
    `enough_s` (three at least), so a slow variant does not eat a device run's minutes."""
    import torch

    def sync() -> None:
        if torch.device(device).type == "cuda":
            torch.cuda.synchronize(device)

    for i in range(warmup):
        work(i)
    times: list[float] = []
    for i in range(repeats):
        if len(times) >= 3 and sum(times) > enough_s:
            break
        sync()
        start = time.perf_counter()
        work(i)
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)
