"""Runs one packed step of the model: whatever mix of prompt chunks and decode tokens the
caller schedules, described torch-free so it can be sent to every rank."""

from __future__ import annotations

from typing import NamedTuple

import torch

from lmserve.kernels import cpu_native
from lmserve.kernels.paged_attention import ReferencePlan

from ..core.step import SequenceChunk
from ..engine.sampler import top_logprobs_of
from ..lora.manager import LoraManager
from .cuda_graphs import DecodeGraphs
from .layers.attention import AttentionMetadata
from .step_inputs import DeviceCopier, step_arrays

# Prompt rows are scored this many at a time: the fp32 logits of 256 rows of a 49k vocabulary
# are 50 MB, of a whole 2048-token chunk 400 MB.
_SCORE_ROWS = 256


class PromptScores(NamedTuple):
    """A chunk's scored prompt positions: the log-prob of each next prompt token, and the
    most likely alternatives at each position when the chunk asked for them."""

    log_probs: list[float]
    top_logprobs: list[list[tuple[int, float]]] | None


class StepLogits(NamedTuple):
    # fp32 [sum of the chunks' num_logits, vocab], in chunk order (a speculating decode has
    # one row after each drafted token too)
    logits: torch.Tensor
    prompt_scores: dict[int, PromptScores]  # by chunk index, for chunks that ask
    greedy_tokens: tuple[int, ...] = ()  # the argmax_only chunks' tokens, in chunk order


class ModelRunner:
    def __init__(self, model, kv_caches, block_size: int, device: torch.device, lora=None):
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device
        self.lora: LoraManager | None = lora  # option.enable_lora
        self._to_device = DeviceCopier(device)
        # Decode steps replayed from CUDA graphs (cuda_graphs.py), set by build_runner.
        self.graphs: DecodeGraphs | None = None
        if device.type == "cpu":
            cpu_native.native_ops()  # built (first start on a machine) or loaded now, not mid-step

    @property
    def argmax_head(self) -> bool:
        """Whether steps may pick greedy tokens without logits (`argmax_only` chunks)."""
        return getattr(self.model, "greedy_head", None) is not None

    @property
    def num_blocks(self) -> int:
        return self.kv_caches[0][0].shape[0]

    def execute(self, chunks: list[SequenceChunk]) -> torch.Tensor:
        """fp32 logits `[sum of the chunks' num_logits, vocab]`, in chunk order."""
        return self.execute_step(chunks).logits

    @torch.inference_mode()
    def execute_step(self, chunks: list[SequenceChunk]) -> StepLogits:
        """The logits, the greedy tokens of `argmax_only` chunks, and the prompt log-probs of
        the chunks that ask (every rank computes them: the LM head's gather is a collective)."""
        input_ids, positions, meta, logits_rows, argmax_rows = self._prepare(chunks)
        if self.lora is not None:
            self.lora.prepare(chunks)
        # A step of greedy decodes alone: the stack picks the tokens in the same call.
        picked = None
        forward_greedy = getattr(self.model, "forward_greedy", None)
        if forward_greedy is not None and len(argmax_rows) == len(input_ids):
            picked = forward_greedy(input_ids, positions, self.kv_caches, meta)
        if picked is None:
            hidden = self._forward(chunks, input_ids, positions, meta)
        else:
            hidden = picked[0]
        scores = {}
        first_row = 0
        for index, chunk in enumerate(chunks):
            if chunk.score_targets:
                start = first_row + chunk.score_from
                rows = hidden[start : start + len(chunk.score_targets)]
                scores[index] = self._score(rows, chunk.score_targets, chunk.score_top)
            first_row += len(chunk.token_ids)
        greedy = ()
        if picked is not None:  # every row is an argmax row, in order
            greedy = tuple(picked[1].tolist())
        elif len(argmax_rows):
            greedy = tuple(self.model.greedy_tokens(hidden[argmax_rows]).tolist())
        return StepLogits(self.model.compute_logits(hidden[logits_rows]), scores, greedy)

    def _forward(self, chunks, input_ids, positions, meta: AttentionMetadata) -> torch.Tensor:
        graphs = self.graphs
        width = meta.block_tables.shape[1]
        if graphs is not None and meta.output_rows is None and graphs.can_replay(chunks, width):
            return graphs.replay(input_ids, positions, meta)
        return self.model(input_ids, positions, self.kv_caches, meta)

    def _score(self, hidden: torch.Tensor, targets: tuple[int, ...], top: int) -> PromptScores:
        log_probs: list[float] = []
        tops: list | None = [] if top > 0 else None
        for start in range(0, len(targets), _SCORE_ROWS):
            logits = self.model.compute_logits(hidden[start : start + _SCORE_ROWS])
            distribution = torch.log_softmax(logits, dim=-1)
            wanted = torch.tensor(targets[start : start + _SCORE_ROWS], device=logits.device)
            log_probs += distribution.gather(1, wanted[:, None])[:, 0].tolist()
            if tops is not None:
                tops += top_logprobs_of(distribution, top)
        return PromptScores(log_probs, tops)

    def _prepare(self, chunks: list[SequenceChunk]):
        arrays = step_arrays(chunks, self.block_size)
        optional = [] if arrays.output_rows is None else [arrays.output_rows]
        (
            token_ids, positions, slots, block_tables, seq_lens, query_start_loc,
            logits_rows, argmax_rows, *output_rows,
        ) = self._to_device([*arrays[:-1], *optional])  # fmt: skip
        plan = None
        if self.device.type == "cpu" and cpu_native.native_ops() is None:  # every layer uses it
            plan = ReferencePlan.build(block_tables, seq_lens, query_start_loc, self.block_size)
        meta = AttentionMetadata(
            slot_mapping=slots,
            block_tables=block_tables,
            seq_lens=seq_lens,
            query_start_loc=query_start_loc,
            max_query_len=max(len(chunk.token_ids) for chunk in chunks),
            max_seq_len=int(arrays.seq_lens.max()),
            reference_plan=plan,
            output_rows=output_rows[0] if output_rows else None,
        )
        return token_ids, positions, meta, logits_rows, argmax_rows
