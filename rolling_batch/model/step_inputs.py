"""A packed step's inputs as tensors: the chunks' token ids, positions, cache slots, block
tables and the rows the step reads, computed with numpy over whole arrays (no Python loop over
tokens: a 2k-token prompt or 256 decodes cost the same few calls), then handed to the device in
one copy from a pinned staging buffer (a GPU otherwise waits on one small pageable copy per
tensor, every step)."""

from __future__ import annotations

from itertools import chain
from typing import NamedTuple

import numpy as np
import torch

from ..core.step import SequenceChunk

# Bytes: every tensor in the staging buffer starts 16-byte aligned, as Triton specializes a
# kernel on its pointers' 16-byte alignment (one compiled variant, not one per offset).
_ALIGN = 16


class StepArrays(NamedTuple):
    """Host arrays of one step (int64 unless said); row lists index the step's tokens."""

    token_ids: np.ndarray
    positions: np.ndarray
    slots: np.ndarray  # cache slot of each new token
    block_tables: np.ndarray  # int32 [S, widest table], padded with block 0
    seq_lens: np.ndarray  # int32 [S]: tokens cached after the step
    query_start_loc: np.ndarray  # int32 [S + 1]
    logits_rows: np.ndarray  # rows whose logits the step returns, in chunk order
    argmax_rows: np.ndarray  # rows whose greedy token it returns
    output_rows: np.ndarray | None  # the rows the model must output (None: all)


def step_arrays(chunks: list[SequenceChunk], block_size: int) -> StepArrays:
    num_seqs = len(chunks)
    stats = np.array(
        [(len(c.token_ids), c.num_computed, c.num_logits, c.num_argmax) for c in chunks],
        dtype=np.int64,
    )
    lens, computed, num_logits, num_argmax = stats.T
    q_starts = np.zeros(num_seqs + 1, np.int64)
    np.cumsum(lens, out=q_starts[1:])
    num_tokens = int(q_starts[-1])
    token_ids = np.fromiter(chain.from_iterable(c.token_ids for c in chunks), np.int64, num_tokens)
    tables = np.zeros((num_seqs, max(len(c.block_ids) for c in chunks)), np.int64)
    for row, chunk in enumerate(chunks):
        tables[row, : len(chunk.block_ids)] = chunk.block_ids
    if num_tokens == num_seqs:  # decodes alone: one token a sequence, at its cached length
        seq_of_token, positions = np.arange(num_seqs), computed
        logits_rows, argmax_rows = num_logits.nonzero()[0], num_argmax.nonzero()[0]
    else:
        seq_of_token = np.arange(num_seqs).repeat(lens)
        positions = computed[seq_of_token] + np.arange(num_tokens) - q_starts[seq_of_token]
        logits_rows = _ranges(q_starts[1:], num_logits)
        argmax_rows = _ranges(q_starts[1:], num_argmax)
    slots = tables[seq_of_token, positions // block_size] * block_size + positions % block_size
    output_rows, logits_rows, argmax_rows = _read_rows(chunks, num_tokens, logits_rows, argmax_rows)
    return StepArrays(
        token_ids,
        positions,
        slots,
        tables.astype(np.int32),
        (computed + lens).astype(np.int32),
        q_starts.astype(np.int32),
        logits_rows,
        argmax_rows,
        output_rows,
    )


def _ranges(ends: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """The rows `end - count .. end - 1` of each (end, count), concatenated in order."""
    total = int(counts.sum())
    firsts = np.repeat(ends - counts, counts)
    within = np.arange(total) - np.repeat(np.cumsum(counts) - counts, counts)
    return firsts + within


def _read_rows(chunks: list[SequenceChunk], num_tokens: int, logits_rows, argmax_rows):
    """(the tokens whose outputs the step reads, or None for all; the logits and argmax rows
    among those outputs). A prompt chunk's tokens before its last are never read unless their
    log-probs are asked for, so the model may skip the last layer's work past attention for
    them. A chunk returns logits or a greedy token, never both: the rows are distinct."""
    wanted = len(logits_rows) + len(argmax_rows)
    if wanted == num_tokens or any(chunk.score_targets for chunk in chunks):
        return None, logits_rows, argmax_rows
    output_rows = np.sort(np.concatenate((logits_rows, argmax_rows)))
    return (
        output_rows,
        np.searchsorted(output_rows, logits_rows),
        np.searchsorted(output_rows, argmax_rows),
    )


class DeviceCopier:
    """Host arrays to tensors on the step's device: zero-copy views on a CPU; elsewhere one
    copy of them all, packed into a staging buffer from pinned memory.

    Each step takes a fresh staging buffer from torch's caching host allocator, which hands a
    block out again only once the copies that read it have run: a step of prompt chunks reads
    nothing back, so the host may build the next step's inputs before the GPU has copied
    this one's."""

    def __init__(self, device: torch.device, packed: bool | None = None):
        self.device = device
        self.packed = device.type != "cpu" if packed is None else packed

    def __call__(self, arrays: list[np.ndarray]) -> list[torch.Tensor]:
        if not self.packed:
            return [torch.from_numpy(np.ascontiguousarray(a)) for a in arrays]
        offsets, end = [], 0
        for array in arrays:
            offsets.append(end)
            end += -(-array.nbytes // _ALIGN) * _ALIGN
        staging = torch.empty(max(end, _ALIGN), dtype=torch.uint8,
                              pin_memory=self.device.type == "cuda")  # fmt: skip
        host = staging.numpy()
        for array, offset in zip(arrays, offsets, strict=True):
            flat = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
            host[offset : offset + array.nbytes] = flat
        on_device = staging.to(self.device, non_blocking=True)
        return [
            on_device[offset : offset + a.nbytes].view(_TORCH_TYPES[a.dtype]).view(a.shape)
            for a, offset in zip(arrays, offsets, strict=True)
        ]


_TORCH_TYPES = {np.dtype(np.int64): torch.int64, np.dtype(np.int32): torch.int32}
