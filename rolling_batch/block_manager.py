"""KV-cache blocks: who owns which. Torch-free.

Paged: blocks of `block_size` tokens handed out as a request grows. Not paged: block_size is
max_model_len, so a request's first block is its whole contiguous slot.
"""

from __future__ import annotations

from .request import Request


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() gives block 0 first

    @property
    def num_free(self) -> int:
        return len(self._free)

    def blocks_to_hold(self, request: Request, num_tokens: int) -> int:
        """Extra blocks `request` needs for its cache to hold `num_tokens` tokens."""
        needed = -(-num_tokens // self.block_size)
        return max(0, needed - len(request.block_ids))

    def can_hold(self, request: Request, num_tokens: int) -> bool:
        return self.blocks_to_hold(request, num_tokens) <= self.num_free

    def grow(self, request: Request, num_tokens: int) -> None:
        for _ in range(self.blocks_to_hold(request, num_tokens)):
            request.block_ids.append(self._free.pop())

    def free(self, request: Request) -> None:
        self._free.extend(reversed(request.block_ids))
        request.block_ids = []

    def check_invariants(self, requests: list[Request]) -> None:
        """No block owned twice or both owned and free; owned + free = all; every owner's
        blocks cover its cached tokens."""
        owned = [block for request in requests for block in request.block_ids]
        assert len(owned) == len(set(owned)), "a block is owned twice"
        assert not set(owned) & set(self._free), "a block is both owned and free"
        assert len(self._free) == len(set(self._free)), "a block is free twice"
        assert len(owned) + len(self._free) == self.num_blocks, "blocks leaked"
        for request in requests:
            capacity = len(request.block_ids) * self.block_size
            assert request.num_computed_tokens <= capacity, f"{request.request_id} overflows"
