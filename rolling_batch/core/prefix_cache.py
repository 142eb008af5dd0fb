"""The prefix cache's table: which blocks hold the K/V of which token chain. Torch-free.

A block's chain is every token up to its end, through one root: the LoRA adapter that computed
it (by name and by a digest of the weights read, so an adapter registered again with other
weights, or whose files changed before they were read again, never meets its old K/V) and the
request's `cache_salt` (tenants who must not share cached prompts send different ones).

A lookup goes by a digest of the chain, but a hit is exact: the entry found must hold the same
tokens and hang under the same parent entry as the asking chain. Entries are numbered once,
never reused, and a child names its parent by that number, so a hit at depth i proves the whole
chain up to i equal, whatever the digests do (vLLM's CVE-2025-25183 was a prompt crafted to
collide with another tenant's cached prefix under Python's hash). The digest is keyed BLAKE2b
with a random per-process key, so collisions cannot be worked out ahead either, not even to
keep another prompt out of the cache: one costs a miss, never a wrong answer. An entry whose
parent was evicted (an orphan: no chain reaches it) gives its digest up to the next chain that
needs it.
"""

from __future__ import annotations

import hashlib
import itertools
import os
from array import array
from dataclasses import dataclass, field
from typing import NamedTuple

_KEY = os.urandom(16)  # this process's: digests mean nothing outside it


class CacheRoot(NamedTuple):
    """Where a request's chain starts: only requests with equal roots share blocks."""

    adapter: str | None  # None: the base model
    weights: str  # the adapter's weights digest ("" for the base model)
    salt: str | None  # the request's cache_salt


def chain_digest(parent: int, tokens: tuple[int, ...]) -> int:
    """The lookup key of a block: its tokens under its parent's key. Not trusted alone."""
    data = parent.to_bytes(8, "little") + array("q", tokens).tobytes()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8, key=_KEY).digest(), "little")


def root_digest(root: CacheRoot) -> int:
    data = repr(tuple(root)).encode()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8, key=_KEY).digest(), "little")


@dataclass(slots=True)
class CachedBlock:
    block: int
    number: int  # this entry's, never reused
    parent: int | CacheRoot  # the parent entry's number; the root for a chain's first block
    tokens: tuple[int, ...]
    digest: int
    root: CacheRoot


@dataclass(slots=True)
class RequestChain:
    """A request's chain as far as it is known: its full blocks' digests, and the numbers of
    the entries holding exactly its tokens (as far as such entries exist)."""

    root: CacheRoot
    digests: list[int] = field(default_factory=list)
    numbers: list[int] = field(default_factory=list)

    def extend(self, token_ids: list[int], block_size: int, num_blocks: int) -> None:
        """Digests for the first `num_blocks` full blocks (a full block's tokens never change)."""
        digests = self.digests
        parent = digests[-1] if digests else root_digest(self.root)
        while len(digests) < num_blocks:
            start = len(digests) * block_size
            parent = chain_digest(parent, tuple(token_ids[start : start + block_size]))
            digests.append(parent)


class PrefixTable:
    def __init__(self):
        self._by_digest: dict[int, CachedBlock] = {}
        self._by_block: dict[int, CachedBlock] = {}
        self._by_number: dict[int, CachedBlock] = {}
        self._numbers = itertools.count()

    def __len__(self) -> int:
        return len(self._by_block)

    def __contains__(self, block: int) -> bool:
        return block in self._by_block

    def entry(self, block: int) -> CachedBlock | None:
        return self._by_block.get(block)

    def find(self, digest: int, parent: int | CacheRoot, tokens: tuple) -> CachedBlock | None:
        """The entry holding exactly `tokens` under `parent`; None on a miss or a collision."""
        entry = self._by_digest.get(digest)
        if entry is None or entry.tokens != tokens or entry.parent != parent:
            return None
        return entry

    def holder(self, digest: int) -> CachedBlock | None:
        return self._by_digest.get(digest)

    def is_live(self, parent: int | CacheRoot) -> bool:
        """Whether a chain can still reach entries under `parent` (a root always can)."""
        return not isinstance(parent, int) or parent in self._by_number

    def add(self, block: int, digest: int, parent, tokens: tuple, root: CacheRoot) -> CachedBlock:
        entry = CachedBlock(block, next(self._numbers), parent, tokens, digest, root)
        self._by_digest[digest] = entry
        self._by_block[block] = entry
        self._by_number[entry.number] = entry
        return entry

    def remove(self, block: int) -> None:
        entry = self._by_block.pop(block)
        del self._by_digest[entry.digest]
        del self._by_number[entry.number]

    def blocks_of_adapter(self, adapter: str) -> list[int]:
        return [block for block, entry in self._by_block.items() if entry.root.adapter == adapter]

    def check_invariants(self) -> None:
        assert len(self._by_digest) == len(self._by_block) == len(self._by_number)
        assert all(self._by_digest[e.digest] is e for e in self._by_block.values())
        assert all(self._by_block[e.block] is e for e in self._by_digest.values())
