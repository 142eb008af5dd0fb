"""Decode steps replayed from CUDA graphs: a decode step of an 8B Llama is ~1,000 kernel
launches, about as long to issue from Python as the step's weight reads take at batch 1.

At start-up the model's forward for a decode batch is captured once per batch-size bucket
(1, 2, 4, 8, then steps of 8 and 16 up to max_rolling_batch_size), reading its inputs from
static buffers; a step of decodes alone copies its inputs into the first rows of the buffers,
pads the rest of its bucket with rows that store nothing (slot -1) and read one key, and
replays the graph. Prompt chunks, drafts, scored prompts and LoRA steps run eagerly.

Everything the captured forward decides on the host is fixed at capture: one query token a
sequence, and the longest context (max_model_len), so a window is always applied and the
attention's split over long contexts is the longest context's; both are right for any shorter
one. Each rank captures for itself only at tensor-parallel degree 1 (no collectives inside).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from ..core.step import SequenceChunk
from .layers.attention import AttentionMetadata

log = logging.getLogger(__name__)


def batch_buckets(max_batch: int) -> list[int]:
    """The batch sizes captured: every decode batch pads to the next one (steps of 8 up to
    64, then 16, vLLM's spacing: at most a quarter of a batch's rows past 8 are padding)."""
    sizes = [1, 2, 4] + list(range(8, 64, 8)) + list(range(64, max_batch + 16, 16))
    return sorted({size for size in sizes if size < max_batch} | {max_batch})


class DecodeGraphs:
    def __init__(
        self,
        forward: Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor],
        device: torch.device,
        max_batch: int,
        max_blocks: int,
        max_model_len: int,
    ):
        """`forward(input_ids, positions, meta)`: the model's hidden states of a step."""
        self.forward = forward
        self.device = device
        self.buckets = batch_buckets(max_batch)
        self.max_blocks = max_blocks
        self.max_model_len = max_model_len
        size = self.buckets[-1]
        self.input_ids = torch.zeros(size, dtype=torch.int64, device=device)
        self.positions = torch.zeros(size, dtype=torch.int64, device=device)
        self.slots = torch.full((size,), -1, dtype=torch.int64, device=device)
        self.block_tables = torch.zeros(size, max_blocks, dtype=torch.int32, device=device)
        self.seq_lens = torch.ones(size, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(size + 1, dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}

    def can_replay(self, chunks: list[SequenceChunk], block_width: int) -> bool:
        """Decodes alone, one new token each, no log-probs of the prompt or LoRA adapters,
        within the largest bucket and the captured block-table width."""
        return (
            len(chunks) <= self.buckets[-1]
            and block_width <= self.max_blocks
            and all(
                len(c.token_ids) == 1 and not c.score_targets and c.adapter is None for c in chunks
            )
        )

    def capture(self) -> float:
        """Captures every bucket, largest first (the smaller graphs reuse its memory pool);
        the seconds it took."""
        began = time.monotonic()
        pool = None
        for size in reversed(self.buckets):
            self._run(size)  # compiles the Triton kernels, warms the allocator
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[size] = self._run(size)
            pool = graph.pool()
            self.graphs[size] = graph
        torch.cuda.synchronize(self.device)
        return time.monotonic() - began

    def replay(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """The hidden states of a decode step (`can_replay`), [num_seqs, hidden]; a view of
        the graph's output, valid until the next replay."""
        count = input_ids.shape[0]
        size = next(b for b in self.buckets if b >= count)
        self.load(input_ids, positions, meta, size)
        if size in self.graphs:
            self.graphs[size].replay()
            return self.outputs[size][:count]
        return self._run(size)[:count]  # not captured (a CPU, or capture off): the same rows

    def load(self, input_ids, positions, meta: AttentionMetadata, size: int) -> None:
        """The step's inputs into the buffers' first rows; rows up to `size` pad: they store
        nothing and read one key."""
        count, width = input_ids.shape[0], meta.block_tables.shape[1]
        self.input_ids[:count].copy_(input_ids)
        self.positions[:count].copy_(positions)
        self.slots[:count].copy_(meta.slot_mapping)
        self.slots[count:size].fill_(-1)
        self.block_tables[:count, :width].copy_(meta.block_tables)
        self.seq_lens[:count].copy_(meta.seq_lens)
        self.seq_lens[count:size].fill_(1)

    def _run(self, size: int) -> torch.Tensor:
        meta = AttentionMetadata(
            slot_mapping=self.slots[:size],
            block_tables=self.block_tables[:size],
            seq_lens=self.seq_lens[:size],
            query_start_loc=self.query_start_loc[: size + 1],
            max_query_len=1,
            max_seq_len=self.max_model_len,
        )
        return self.forward(self.input_ids[:size], self.positions[:size], meta)


def try_capture(graphs: DecodeGraphs) -> DecodeGraphs | None:
    """The graphs captured, or None (eager steps) where capture fails: a family whose forward
    syncs with the host (a mixture of experts counts its tokens) cannot be captured."""
    try:
        seconds = graphs.capture()
    except Exception as error:  # noqa: BLE001 - any capture failure leaves eager steps
        log.warning("CUDA graphs off (eager decode steps): capture failed: %s", error)
        return None
    log.info(
        "CUDA graphs: %d decode batch sizes (%s) captured in %.1f s",
        len(graphs.buckets),
        ", ".join(map(str, graphs.buckets)),
        seconds,
    )
    return graphs


def capture_decode_graphs(runner, max_batch: int, max_model_len: int) -> DecodeGraphs | None:
    """`runner`'s decode graphs for batches up to `max_batch`, captured with the kernels the
    dispatchers pick now; None where capture fails."""

    def forward(input_ids, positions, meta):
        return runner.model(input_ids, positions, runner.kv_caches, meta)

    max_blocks = -(-max_model_len // runner.block_size)
    graphs = DecodeGraphs(forward, runner.device, max_batch, max_blocks, max_model_len)
    with torch.inference_mode():
        return try_capture(graphs)
