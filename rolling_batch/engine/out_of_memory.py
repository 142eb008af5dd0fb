"""Out of memory, for both engines: which errors are it, and which request of a failed step to
blame. A request that ran out of memory gets 507 (it may fit when the server is less busy);
any other failure of the model is 424, DJL's "prediction failure".

torch raises torch.OutOfMemoryError on CUDA, but on CPU a plain RuntimeError
("DefaultCPUAllocator: can't allocate memory", torch 2.13); Python's own allocations raise
MemoryError; a CUDA call outside torch's caching allocator (a cuBLAS workspace) fails with
"out of memory" in a RuntimeError.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from ..core.grammar import GrammarError

if TYPE_CHECKING:  # engine=Python imports this module for is_out_of_memory alone
    from ..core.request import Request
    from ..core.step import SequenceChunk

_MESSAGES = ("can't allocate memory", "out of memory")


def is_out_of_memory(error: BaseException) -> bool:
    if isinstance(error, (torch.OutOfMemoryError, MemoryError)):
        return True
    return isinstance(error, RuntimeError) and any(text in str(error) for text in _MESSAGES)


def failure_status(error: BaseException) -> int:
    """The HTTP status of a request the model failed with `error`: 400 for a grammar that
    does not build against the model's vocabulary (the request's fault)."""
    if isinstance(error, GrammarError):
        return 400
    return 507 if is_out_of_memory(error) else 424


def largest_chunk(
    requests: Sequence[Request], chunks: Sequence[SequenceChunk], running: Sequence[Request]
) -> tuple[Request, int]:
    """(the request a step that ran out of memory is blamed on, its tokens in the step): the
    one computing the most tokens (a long prompt's activations, the usual cause), the newest
    of equals (as the scheduler preempts the newest first), so the choice is deterministic.
    `running`: the scheduler's running requests, oldest first; every step request is one."""
    order = {request: index for index, request in enumerate(running)}
    blamed = max(
        zip(requests, chunks), key=lambda pair: (len(pair[1].token_ids), order.get(pair[0], -1))
    )
    return blamed[0], len(blamed[1].token_ids)
