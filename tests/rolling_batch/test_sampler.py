"""The sampler's processing equals HF transformers' logits processors; seeds make sampling
repeat whatever else is in the batch; a row that cannot be sampled fails alone."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import (
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from lmserve.rolling_batch.protocol import GenerationParams
from lmserve.rolling_batch.request import Request
from lmserve.rolling_batch.sampler import Sampler, _penalize_repetition, _warp


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p"),
    [(0.7, 0, 1.0), (1.3, 20, 1.0), (0.9, 0, 0.8), (1.0, 50, 0.5)],
)
def test_warping_equals_hf(temperature, top_k, top_p):
    logits = torch.randn(1, 500, generator=torch.Generator().manual_seed(3)) * 3
    expected = TemperatureLogitsWarper(temperature)(None, logits.clone())
    if top_k:
        expected = TopKLogitsWarper(top_k)(None, expected)
    if top_p < 1:
        expected = TopPLogitsWarper(top_p)(None, expected)
    got = _warp(logits[0].clone(), temperature, top_k, top_p)
    assert torch.equal(torch.isinf(got), torch.isinf(expected[0]))
    kept = ~torch.isinf(got)
    torch.testing.assert_close(got[kept], expected[0][kept])


def test_repetition_penalty_equals_hf():
    logits = torch.randn(1, 100, generator=torch.Generator().manual_seed(4))
    seen = [3, 7, 7, 50, 99]
    expected = RepetitionPenaltyLogitsProcessor(1.3)(torch.tensor([seen]), logits.clone())
    row = logits[0].clone()
    _penalize_repetition(row, seen, 1.3)
    torch.testing.assert_close(row, expected[0])


def request(request_id: str, **params) -> Request:
    return Request(request_id, [1, 2, 3], GenerationParams(**params), 0.0)


def test_seeded_rows_repeat_whatever_else_is_in_the_batch():
    logits = torch.randn(3, 300, generator=torch.Generator().manual_seed(5))
    alone = Sampler(torch.device("cpu"))
    mixed = Sampler(torch.device("cpu"))
    seeded = dict(do_sample=True, temperature=1.5, seed=42)
    (alone_draw,) = alone.sample(logits[:1], [request("a", **seeded)])[0].values()
    batch = [request("x", do_sample=True), request("a", **seeded), request("g")]
    sampled, failed = mixed.sample(logits[[1, 0, 2]], batch)
    assert not failed
    assert sampled[batch[1]] == alone_draw
    assert sampled[batch[2]][0] == int(torch.argmax(logits[2]))  # greedy row


def test_a_row_that_cannot_be_sampled_fails_alone():
    logits = torch.randn(2, 50)
    broken = request("broken", do_sample=True, temperature=1e-40)  # logits overflow to inf
    fine = request("fine")
    sampled, failed = Sampler(torch.device("cpu")).sample(logits, [broken, fine])
    assert [r for r, _ in failed] == [broken]
    assert fine in sampled and broken not in sampled
