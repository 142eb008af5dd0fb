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

from lmserve.rolling_batch.core.request import Request
from lmserve.rolling_batch.engine.sampler import Sampler, _filter_rows, _penalize_rows, _RowState
from lmserve.rolling_batch.ipc.protocol import GenerationParams


def _penalize_repetition(row: torch.Tensor, token_ids: list[int], penalty: float) -> None:
    """One row, in place, through the batched penalty."""
    request = Request("row", list(token_ids), GenerationParams(repetition_penalty=penalty), 0.0)
    row.copy_(_penalize_rows(row[None], [request], [_RowState(request, row.device)])[0])


def _warp(row: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """One row through the batched temperature, top-k and top-p filters."""
    return _filter_rows(row[None], [temperature], [top_k], [top_p])[0][0]


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


def hf_processed(row: torch.Tensor, seen: list[int], params: GenerationParams) -> torch.Tensor:
    """HF's processors for one row, the reference the batched sampler must equal."""
    scores = row[None].clone()
    if params.repetition_penalty != 1.0:
        processor = RepetitionPenaltyLogitsProcessor(params.repetition_penalty)
        scores = processor(torch.tensor([seen]), scores)
    if params.do_sample:
        scores = TemperatureLogitsWarper(params.temperature)(None, scores)
        if params.top_k:
            scores = TopKLogitsWarper(params.top_k)(None, scores)
        if params.top_p < 1:
            scores = TopPLogitsWarper(params.top_p)(None, scores)
    return scores[0]


def assert_same_scores(got: torch.Tensor, expected: torch.Tensor) -> None:
    assert torch.equal(torch.isinf(got), torch.isinf(expected))
    kept = ~torch.isinf(got)
    torch.testing.assert_close(got[kept], expected[kept])


MIXED = [
    dict(),
    dict(do_sample=True, temperature=0.7, top_p=0.9, seed=1),
    dict(repetition_penalty=1.3),
    dict(do_sample=True, top_k=40, repetition_penalty=0.8, seed=2),
    dict(do_sample=True, temperature=1.2, top_k=300, top_p=0.95),
    dict(do_sample=True, temperature=2.0, top_p=0.9, seed=3),
    dict(do_sample=True, top_k=10**9),  # more than the vocabulary: no filtering
]


def test_batched_processing_equals_hf_row_by_row():
    vocab = 6000
    generator = torch.Generator().manual_seed(6)
    # Peaked rows find their nucleus among the first candidates, flat ones need the sort.
    scales = torch.tensor([8.0, 6.0, 1.0, 3.0, 0.05, 0.01, 2.0])[:, None]
    logits = torch.randn(len(MIXED), vocab, generator=generator) * scales
    batch = [request(f"r{i}", **params) for i, params in enumerate(MIXED)]
    for r in batch:
        r.output_ids = torch.randint(0, vocab, (30,), generator=generator).tolist()
    states = [Sampler(torch.device("cpu"))._state(r) for r in batch]
    penalized = _penalize_rows(logits, batch, states)
    for row, r in enumerate(batch):
        expected = hf_processed(logits[row], r.all_token_ids, r.params)
        got = penalized[row]
        if r.params.do_sample:
            p = r.params
            got = _filter_rows(penalized[row : row + 1], [p.temperature], [p.top_k], [p.top_p])[0]
            got = got[0]
        assert_same_scores(got, expected)
    drawn = [i for i, r in enumerate(batch) if r.params.do_sample]
    warped, probs = _filter_rows(
        penalized[drawn],
        [batch[i].params.temperature for i in drawn],
        [batch[i].params.top_k for i in drawn],
        [batch[i].params.top_p for i in drawn],
    )
    for row, i in enumerate(drawn):
        assert_same_scores(
            warped[row], hf_processed(logits[i], batch[i].all_token_ids, batch[i].params)
        )
    # The sampler draws from the same distribution, unnormalized.
    torch.testing.assert_close(probs / probs.sum(-1, keepdim=True), torch.softmax(warped, -1))


def test_log_probs_are_under_the_processed_distribution():
    logits = torch.randn(3, 200, generator=torch.Generator().manual_seed(8)) * 4
    batch = [
        request("g"),
        request("s", do_sample=True, top_k=5, seed=1),
        request("p", repetition_penalty=1.5),
    ]
    sampled, failed = Sampler(torch.device("cpu")).sample(logits, batch)
    assert not failed
    for row, r in enumerate(batch):
        token, log_prob, _ = sampled[r]
        expected = torch.log_softmax(hf_processed(logits[row], r.all_token_ids, r.params), dim=-1)
        assert log_prob == pytest.approx(float(expected[token]), abs=1e-5)
        if not r.params.do_sample:
            assert token == int(torch.argmax(hf_processed(logits[row], r.all_token_ids, r.params)))
    assert sampled[batch[1]][0] in torch.topk(logits[1], 5).indices.tolist()


def test_top_logprobs_are_the_most_likely_of_the_processed_distribution():
    logits = torch.randn(4, 300, generator=torch.Generator().manual_seed(9)) * 3
    batch = [
        request("greedy", top_logprobs=5),
        request("top-k", do_sample=True, top_k=3, top_logprobs=6, seed=2),  # 3 survive
        request("top-p", do_sample=True, top_p=0.7, temperature=0.8, top_logprobs=20, seed=3),
        request("none", do_sample=True, seed=4),
    ]
    sampled, failed = Sampler(torch.device("cpu")).sample(logits, batch)
    assert not failed and sampled[batch[3]].top_logprobs is None
    for row, r in enumerate(batch[:3]):
        expected = torch.log_softmax(hf_processed(logits[row], r.all_token_ids, r.params), dim=-1)
        finite = int(torch.isfinite(expected).sum())
        values, tokens = torch.topk(expected, min(r.params.top_logprobs, finite))
        top = sampled[r].top_logprobs
        assert [token for token, _ in top] == tokens.tolist()
        assert [value for _, value in top] == pytest.approx(values.tolist(), abs=1e-5)
        # The chosen token's own log-prob is the one its list gives it.
        assert dict(top).get(sampled[r].token, sampled[r].log_prob) == pytest.approx(
            sampled[r].log_prob, abs=1e-5
        )
    assert len(sampled[batch[1]].top_logprobs) == 3


def generate(batch_of_step, steps: int, vocab: int = 1000) -> dict[str, list[int]]:
    """Runs `steps` steps of one sampler; `batch_of_step(step)` gives that step's requests.
    Each request's logits depend only on its own tokens, as a model's would."""
    sampler = Sampler(torch.device("cpu"))
    for step in range(steps):
        batch = batch_of_step(step)
        rows = []
        for r in batch:
            seed = hash((r.request_id, tuple(r.output_ids))) % 2**31
            rows.append(torch.randn(vocab, generator=torch.Generator().manual_seed(seed)) * 3)
        sampled, failed = sampler.sample(torch.stack(rows), batch)
        assert not failed
        for r in batch:
            r.output_ids.append(sampled[r][0])
    return {r.request_id: r.output_ids for r in batch_of_step(steps - 1)}


def test_seeded_text_does_not_depend_on_the_rest_of_the_batch():
    """Three compositions of the same seeded requests: alone, with others in varying order,
    with neighbours joining and leaving between steps."""
    seeded = {
        "top-p": dict(do_sample=True, temperature=0.9, top_p=0.8, seed=11),
        "top-k": dict(do_sample=True, top_k=20, repetition_penalty=1.2, seed=12),
        "plain": dict(do_sample=True, temperature=1.4, seed=13),
    }
    alone = {}
    for name, params in seeded.items():
        lone = request(name, **params)
        alone.update(generate(lambda step, lone=lone: [lone], steps=8))
    mine = [request(name, **params) for name, params in seeded.items()]
    others = [request(f"o{i}", **params) for i, params in enumerate(MIXED)]

    def shuffled(step):
        batch = mine + others[: step % len(others)]
        return batch[step % 3 :] + batch[: step % 3]

    assert generate(shuffled, steps=8) == alone


def test_draws_follow_the_distribution():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05, 0.0])
    logits = torch.log(probs)[None]
    r = request("d", do_sample=True, seed=0)
    sampler = Sampler(torch.device("cpu"))
    counts = torch.zeros(5)
    for _ in range(4000):
        ((token, _, _),) = sampler.sample(logits, [r])[0].values()
        counts[token] += 1
    torch.testing.assert_close(counts / 4000, probs, atol=0.025, rtol=0)
    assert counts[4] == 0


def test_an_overflowing_row_fails_alone_among_sampled_rows():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(9))
    batch = [
        request("a", do_sample=True, top_p=0.9, seed=1),
        request("broken", do_sample=True, temperature=1e-40),
        request("b", do_sample=True, top_k=3, seed=2),
        request("g"),
    ]
    sampled, failed = Sampler(torch.device("cpu")).sample(logits, batch)
    assert [r.request_id for r, _ in failed] == ["broken"]
    assert set(sampled) == {batch[0], batch[2], batch[3]}
    assert all(0 <= sample.token < 50 for sample in sampled.values())


def test_forget_drops_a_request_state_and_a_reused_id_starts_fresh():
    logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(10))
    sampler = Sampler(torch.device("cpu"))
    first = request("same", do_sample=True, seed=5)
    draw = sampler.sample(logits, [first])[0][first]
    sampler.forget("same")
    assert not sampler._states
    second = request("same", do_sample=True, seed=5)
    assert sampler.sample(logits, [second])[0][second] == draw


def test_a_token_beyond_the_vocabulary_fails_its_row_alone():
    logits = torch.randn(2, 50, generator=torch.Generator().manual_seed(11))
    odd = Request("odd", [3, 70], GenerationParams(repetition_penalty=1.2), 0.0)
    fine = request("fine", repetition_penalty=1.2)
    sampled, failed = Sampler(torch.device("cpu")).sample(logits, [odd, fine])
    assert [r for r, _ in failed] == [odd] and list(sampled) == [fine]


def test_verify_keeps_the_draft_up_to_the_first_disagreement_and_the_choice_after_it():
    """Rows of logits after a request's newest token and after each drafted one: the greedy
    choice at every row, the draft kept while it matches them, then the next choice (with
    the log-probs and alternatives greedy sampling would give one row at a time)."""
    generator = torch.Generator().manual_seed(5)
    logits = torch.randn(7, 50, generator=generator)
    chosen = logits.argmax(-1).tolist()
    mismatch = (chosen[2] + 1) % 50
    asks = GenerationParams(top_logprobs=3)
    first = Request("first", [1, 2], asks, 0.0)
    second = Request("second", [3], GenerationParams(), 0.0)
    drafts = [(first, (chosen[0], chosen[1], mismatch)), (second, (chosen[4], chosen[5]))]
    verified = Sampler(torch.device("cpu")).verify(logits, drafts)
    assert [s.token for s in verified[first]] == chosen[:3]  # two kept, then the choice
    assert [s.token for s in verified[second]] == chosen[4:7]  # all kept, and one more
    log_probs = torch.log_softmax(logits, -1)
    for sample, row in zip(verified[first] + verified[second], [0, 1, 2, 4, 5, 6]):
        assert sample.log_prob == pytest.approx(log_probs[row, sample.token].item(), abs=1e-6)
    assert all(len(s.top_logprobs) == 3 for s in verified[first])
    assert verified[first][2].top_logprobs[0][0] == chosen[2]
    assert all(s.top_logprobs is None for s in verified[second])
