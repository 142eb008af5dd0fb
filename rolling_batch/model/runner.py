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
from .layers.attention import AttentionMetadata

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
            hidden = self.model(input_ids, positions, self.kv_caches, meta)
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
        block_size = self.block_size
        token_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        q_starts = [0]
        seq_lens: list[int] = []
        logits_rows: list[int] = []
        argmax_rows: list[int] = []
        for chunk in chunks:
            for offset, token in enumerate(chunk.token_ids):
                position = chunk.num_computed + offset
                token_ids.append(token)
                positions.append(position)
                slots.append(
                    chunk.block_ids[position // block_size] * block_size + position % block_size
                )
            q_starts.append(len(token_ids))
            seq_lens.append(chunk.num_computed + len(chunk.token_ids))
            logits_rows += range(len(token_ids) - chunk.num_logits, len(token_ids))
            argmax_rows += range(len(token_ids) - chunk.num_argmax, len(token_ids))
        output_rows, logits_rows, argmax_rows = _read_rows(
            chunks, len(token_ids), logits_rows, argmax_rows
        )
        width = max(len(chunk.block_ids) for chunk in chunks)
        tables = [list(chunk.block_ids) + [0] * (width - len(chunk.block_ids)) for chunk in chunks]

        def tensor(values) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64, device=self.device)

        block_tables = tensor(tables).to(torch.int32)
        seq_lens_tensor = tensor(seq_lens).to(torch.int32)
        query_start_loc = tensor(q_starts).to(torch.int32)
        plan = None
        if self.device.type == "cpu" and cpu_native.native_ops() is None:  # every layer uses it
            plan = ReferencePlan.build(block_tables, seq_lens_tensor, query_start_loc, block_size)
        meta = AttentionMetadata(
            slot_mapping=tensor(slots),
            block_tables=block_tables,
            seq_lens=seq_lens_tensor,
            query_start_loc=query_start_loc,
            max_query_len=max(len(chunk.token_ids) for chunk in chunks),
            max_seq_len=max(seq_lens),
            reference_plan=plan,
            output_rows=None if output_rows is None else tensor(output_rows),
        )
        return tensor(token_ids), tensor(positions), meta, tensor(logits_rows), tensor(argmax_rows)


def _read_rows(chunks: list[SequenceChunk], num_tokens: int, logits_rows, argmax_rows):
    """(the tokens whose outputs the step reads, or None for all; the logits and argmax rows
    among those outputs). A prompt chunk's tokens before its last are never read unless their
    log-probs are asked for, so the model may skip the last layer's work past attention for
    them."""
    wanted = len(logits_rows) + len(argmax_rows)
    if wanted == num_tokens or any(chunk.score_targets for chunk in chunks):
        return None, logits_rows, argmax_rows
    output_rows = sorted(logits_rows + argmax_rows)
    row_of = {token: row for row, token in enumerate(output_rows)}
    return output_rows, [row_of[t] for t in logits_rows], [row_of[t] for t in argmax_rows]
