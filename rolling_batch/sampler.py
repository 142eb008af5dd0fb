"""Batched sampling on rank 0: repetition penalty, then greedy or temperature/top-k/top-p
sampling, with HF transformers' semantics. Each request draws from its own generator, seeded
by its `seed`, so the same seed and prompt give the same text whatever else is in the batch.
Log-probs are of the chosen token under the processed distribution (as HF's `scores`)."""

from __future__ import annotations

import random

import torch

from .request import Request


class Sampler:
    def __init__(self, device: torch.device):
        self.device = device
        self._generators: dict[str, torch.Generator] = {}

    def forget(self, request_id: str) -> None:
        self._generators.pop(request_id, None)

    def sample(self, logits: torch.Tensor, requests: list[Request]):
        """`logits`: fp32 `[len(requests), vocab]`, row i for requests[i]. Returns
        ({request: (token, log_prob)}, [(request, error)]): a row that cannot be sampled (say
        its temperature overflows the logits) fails alone."""
        sampled: dict[Request, tuple[int, float]] = {}
        failed: list[tuple[Request, Exception]] = []
        for row, request in enumerate(requests):
            try:
                sampled[request] = self._sample_row(logits[row].clone(), request)
            except RuntimeError as error:
                failed.append((request, error))
        return sampled, failed

    def _sample_row(self, row: torch.Tensor, request: Request) -> tuple[int, float]:
        params = request.params
        if params.repetition_penalty != 1.0:
            _penalize_repetition(row, request.all_token_ids, params.repetition_penalty)
        if params.do_sample:
            scores = _warp(row, params.temperature, params.top_k, params.top_p)
            probs = torch.softmax(scores, dim=-1)
            token = int(torch.multinomial(probs, 1, generator=self._generator(request)))
        else:
            scores = row
            token = int(torch.argmax(scores))
        return token, float(torch.log_softmax(scores, dim=-1)[token])

    def _generator(self, request: Request) -> torch.Generator:
        generator = self._generators.get(request.request_id)
        if generator is None:
            seed = request.params.seed
            generator = torch.Generator(device=self.device)
            generator.manual_seed(seed if seed is not None else random.getrandbits(63))
            self._generators[request.request_id] = generator
        return generator


def _penalize_repetition(row: torch.Tensor, token_ids: list[int], penalty: float) -> None:
    """HF's RepetitionPenaltyLogitsProcessor: seen tokens' logits shrink towards zero."""
    seen = torch.tensor(sorted(set(token_ids)), device=row.device)
    values = row[seen]
    row[seen] = torch.where(values < 0, values * penalty, values / penalty)


def _warp(row: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """Temperature, then top-k, then top-p (nucleus), filtered entries to -inf."""
    scores = row / temperature
    if 0 < top_k < scores.shape[-1]:
        threshold = torch.topk(scores, top_k).values[-1]
        scores = scores.masked_fill(scores < threshold, float("-inf"))
    if top_p < 1.0:
        sorted_scores, order = torch.sort(scores, descending=False)
        cumulative = torch.softmax(sorted_scores, dim=-1).cumsum(dim=-1)
        remove_sorted = cumulative <= 1 - top_p
        remove_sorted[-1] = False  # always keep the most likely token
        remove = torch.zeros_like(remove_sorted).scatter(0, order, remove_sorted)
        scores = scores.masked_fill(remove, float("-inf"))
    return scores
