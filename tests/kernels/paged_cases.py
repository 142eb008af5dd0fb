"""Random paged-KV scenarios: sequences with given (cached tokens, new tokens), their blocks
scattered over the cache in random order, the rest of the cache filled with noise."""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch


@dataclass
class PagedCase:
    query: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    max_query_len: int
    max_seq_len: int

    def args(self, scale: float) -> tuple:
        return (
            self.query,
            self.k_cache,
            self.v_cache,
            self.block_tables,
            self.seq_lens,
            self.query_start_loc,
            scale,
            self.max_query_len,
            self.max_seq_len,
        )

    def to(self, device) -> PagedCase:
        """The same case with its tensors on `device`."""
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        moved = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in values.items()}
        return PagedCase(**moved)


def make_case(
    seqs: list[tuple[int, int]],  # (total tokens incl. new, new tokens)
    block_size: int,
    q_heads: int,
    kv_heads: int,
    head_dim: int,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> PagedCase:
    generator = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-total // block_size) for total, _ in seqs]
    num_blocks = sum(blocks_per_seq) + 3  # spare blocks hold noise nobody may read
    order = torch.randperm(num_blocks, generator=generator).tolist()
    width = max(blocks_per_seq)
    tables = torch.zeros(len(seqs), width, dtype=torch.int32)
    for index, count in enumerate(blocks_per_seq):
        tables[index, :count] = torch.tensor(order[:count], dtype=torch.int32)
        order = order[count:]
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=generator).to(dtype)
    v_cache = torch.randn(shape, generator=generator).to(dtype)
    q_lens = [new for _, new in seqs]
    query = torch.randn(sum(q_lens), q_heads, head_dim, generator=generator).to(dtype)
    starts = torch.tensor([0] + q_lens).cumsum(0).to(torch.int32)
    return PagedCase(
        query,
        k_cache,
        v_cache,
        tables,
        torch.tensor([total for total, _ in seqs], dtype=torch.int32),
        starts,
        max(q_lens),
        max(total for total, _ in seqs),
    )


def share_leading_blocks(case: PagedCase, rows: list[int], num_blocks: int) -> PagedCase:
    """The sequences `rows` read their first `num_blocks` blocks from `rows[0]`'s: a prompt
    prefix shared through the prefix cache (their own copies become unread noise)."""
    for row in rows[1:]:
        case.block_tables[row, :num_blocks] = case.block_tables[rows[0], :num_blocks]
    return case
