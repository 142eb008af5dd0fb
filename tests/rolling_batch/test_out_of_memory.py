"""Which errors are out of memory (a real CPU allocation failure among them: torch raises a plain
RuntimeError for it), and which request of a step that ran out of memory is blamed."""

from __future__ import annotations

import pytest
import torch

from lmserve.rolling_batch.core.request import Request
from lmserve.rolling_batch.core.step import SequenceChunk
from lmserve.rolling_batch.engine.out_of_memory import (
    failure_status,
    is_out_of_memory,
    largest_chunk,
)
from lmserve.rolling_batch.ipc.protocol import GenerationParams


def allocation_failure() -> Exception:
    """The error of a real allocation no machine grants (1 PiB, beyond any address space)."""
    try:
        torch.empty(2**50, dtype=torch.uint8)
    except Exception as error:  # noqa: BLE001 - whatever torch raises is the point
        return error
    raise AssertionError("1 PiB was allocated")


@pytest.mark.parametrize(
    "error",
    [
        allocation_failure(),
        torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
        MemoryError(),
        RuntimeError("CUDA error: out of memory"),
    ],
    ids=["cpu-allocator", "cuda-allocator", "python", "cuda-runtime"],
)
def test_out_of_memory_is_507(error):
    assert is_out_of_memory(error) and failure_status(error) == 507


@pytest.mark.parametrize(
    "error", [RuntimeError("mat1 and mat2 shapes cannot be multiplied"), ValueError(), KeyError()]
)
def test_other_failures_are_424(error):
    assert not is_out_of_memory(error) and failure_status(error) == 424


def request(name: str) -> Request:
    return Request(name, [1], GenerationParams(), 0.0)


def chunk(num_tokens: int) -> SequenceChunk:
    return SequenceChunk(tuple(range(num_tokens)), 0, (0,), True)


def test_the_largest_chunk_is_blamed_and_the_newest_of_equals():
    old, new, long = request("old"), request("new"), request("long")
    running = [old, long, new]
    # The step's order may differ from the running order (the scheduler groups by adapter).
    assert largest_chunk([new, long, old], [chunk(1), chunk(9), chunk(1)], running) == (long, 9)
    assert largest_chunk([new, old], [chunk(1), chunk(1)], running) == (new, 1)
