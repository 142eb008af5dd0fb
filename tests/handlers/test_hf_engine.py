"""The engine=Python model on a tiny random Llama: a batch of prompts with different lengths
and different max_new_tokens gives each row what it would get alone. Log-probs a request asks
for (top alternatives per generated token, the prompt's own) match the model run directly on
the unpadded sequence, are cut as the tokens are, and change nothing generated."""

from __future__ import annotations

import math

import pytest
import torch

from lmserve.handlers.python_engine.dynamic_batcher import PendingRequest
from lmserve.handlers.python_engine.hf_engine import HFEngine
from lmserve.handlers.python_engine.hf_work import HFGenerateWork
from lmserve.rolling_batch.ipc import protocol
from lmserve.rolling_batch.ipc.protocol import GenerationParams
from lmserve.rolling_batch.model.weights.loader import resolve_dtype

PROMPTS = [[1, 504, 3575], [28120, 30, 339, 5248, 253, 1114, 519], [7042]]


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return HFEngine.load(str(tiny_model_dir), "fp32")


def test_batched_rows_equal_their_runs_alone(engine):
    prompts = PROMPTS
    params = [GenerationParams(max_new_tokens=n, ignore_eos=True) for n in (5, 9, 2)]
    batched = engine.generate(prompts, params)
    for prompt, row_params, row in zip(prompts, params, batched):
        (alone,) = engine.generate([prompt], [row_params])
        assert row.token_ids == alone.token_ids
        assert len(row.token_ids) == row_params.max_new_tokens
        assert row.finish_reason == "length"
        assert all(lp <= 0 for lp in row.log_probs)
        assert row.log_probs == pytest.approx(alone.log_probs, abs=1e-4)


def test_eos_ends_a_row_unless_ignored(engine):
    # Find a prompt whose greedy continuation hits EOS, by forcing EOS to be the argmax.
    bias = torch.zeros(engine.model.config.vocab_size)
    bias[2] = 1e4
    head = engine.model.lm_head
    original = head.bias
    head.bias = torch.nn.Parameter(bias)
    try:
        (stopped,) = engine.generate(
            [[1, 2, 3]], [GenerationParams(max_new_tokens=5, top_logprobs=3)]
        )
        (ignored,) = engine.generate(
            [[1, 2, 3]], [GenerationParams(max_new_tokens=5, ignore_eos=True)]
        )
    finally:
        head.bias = original
    assert stopped.token_ids == [2] and stopped.finish_reason == "eos_token"
    assert ignored.token_ids == [2] * 5 and ignored.finish_reason == "length"
    # The alternatives are cut where the tokens are.
    (alternatives,) = stopped.top_logprobs
    assert len(alternatives) == 3 and alternatives[0][0] == 2


def test_seeded_sampling_repeats(engine):
    params = [GenerationParams(max_new_tokens=6, do_sample=True, temperature=1.5, seed=7)]
    first = engine.generate([[1, 2, 3]], params)
    again = engine.generate([[1, 2, 3]], params)
    assert first[0].token_ids == again[0].token_ids


def test_auto_dtype_follows_the_cpu_and_the_checkpoint_on_gpu(monkeypatch):
    from lmserve.rolling_batch.model.weights import loader

    monkeypatch.setattr(loader, "cpu_has_native_bf16", lambda: False)
    assert resolve_dtype("auto", torch.bfloat16, "cpu") == torch.float32
    monkeypatch.setattr(loader, "cpu_has_native_bf16", lambda: True)
    assert resolve_dtype("auto", torch.float32, "cpu") == torch.bfloat16
    assert resolve_dtype("auto", torch.float16, "cuda") == torch.float16
    assert resolve_dtype("bf16", torch.float32, "cpu") == torch.bfloat16


def reference_log_probs(engine, token_ids: list[int]) -> torch.Tensor:
    """fp32 log-softmax of the model's raw logits at every position of one unpadded sequence."""
    with torch.inference_mode():
        logits = engine.model(torch.tensor([token_ids])).logits[0]
    return logits.float().log_softmax(dim=-1)


def assert_top_equal(top: list, reference: torch.Tensor, k: int) -> None:
    """`top`: per position [(id, log_prob)]; `reference`: [positions, vocab] log-probs."""
    values, ids = reference.topk(k, dim=-1)
    assert len(top) == len(reference)
    for pairs, row_values, row_ids in zip(top, values.tolist(), ids.tolist()):
        assert [token for token, _ in pairs] == row_ids
        assert [value for _, value in pairs] == pytest.approx(row_values, abs=1e-4)


def test_prompt_log_probs_of_a_padded_batch_equal_each_prompt_alone(engine):
    ks = (0, 3, 5)
    params = [GenerationParams(max_new_tokens=2, prompt_logprobs=True, top_logprobs=k) for k in ks]
    params.append(GenerationParams(max_new_tokens=2))  # asks for nothing, in the same batch
    prompts = [*PROMPTS, [1, 2, 3, 4]]
    rows = engine.generate(prompts, params)
    for prompt, k, row in zip(prompts, ks, rows):
        reference = reference_log_probs(engine, prompt)[:-1]
        expected = reference.gather(-1, torch.tensor(prompt[1:]).unsqueeze(-1)).squeeze(-1)
        assert len(row.prompt_log_probs) == len(prompt) - 1
        assert row.prompt_log_probs == pytest.approx(expected.tolist(), abs=1e-4)
        if k == 0:
            assert row.prompt_top_logprobs is None
        else:
            assert_top_equal(row.prompt_top_logprobs, reference, k)
        assert (row.top_logprobs is None) == (k == 0)
    assert rows[2].prompt_log_probs == []  # a one-token prompt has nothing to score
    assert rows[2].prompt_top_logprobs == []
    assert rows[3].prompt_log_probs is None and rows[3].prompt_top_logprobs is None
    assert rows[3].top_logprobs is None


def test_top_logprobs_of_greedy_rows_are_the_topk_of_the_model(engine):
    ks, lengths = (2, 0, 5), (4, 3, 6)
    params = [
        GenerationParams(max_new_tokens=n, ignore_eos=True, top_logprobs=k)
        for k, n in zip(ks, lengths)
    ]
    rows = engine.generate(PROMPTS, params)
    for prompt, k, n, row in zip(PROMPTS, ks, lengths, rows):
        assert len(row.token_ids) == n
        if k == 0:
            assert row.top_logprobs is None
            continue
        # Greedy: no processor touches the logits, so scores are the model's distribution.
        reference = reference_log_probs(engine, prompt + row.token_ids)[len(prompt) - 1 : -1]
        assert_top_equal(row.top_logprobs, reference, k)
        # The chosen token is the most likely one, with the same log-prob.
        for token, log_prob, pairs in zip(row.token_ids, row.log_probs, row.top_logprobs):
            assert pairs[0] == (token, pytest.approx(log_prob, abs=1e-6))


def test_asking_for_log_probs_changes_nothing_generated(engine):
    plain = [GenerationParams(max_new_tokens=n) for n in (5, 9, 2)]
    asking = [
        GenerationParams(max_new_tokens=n, top_logprobs=4, prompt_logprobs=True) for n in (5, 9, 2)
    ]
    before = engine.generate(PROMPTS, plain)
    after = engine.generate(PROMPTS, asking)
    assert [r.token_ids for r in after] == [r.token_ids for r in before]
    assert [r.log_probs for r in after] == [r.log_probs for r in before]
    assert [r.finish_reason for r in after] == [r.finish_reason for r in before]


def test_top_logprobs_come_from_the_filtered_sampling_distribution(engine):
    params = GenerationParams(
        max_new_tokens=5, do_sample=True, top_k=3, seed=11, ignore_eos=True, top_logprobs=6
    )
    (row,) = engine.generate([[1, 504, 3575]], [params])
    assert len(row.top_logprobs) == 5
    for token, log_prob, pairs in zip(row.token_ids, row.log_probs, row.top_logprobs):
        # top_k=3 leaves 3 tokens; the others are -inf and left out.
        assert len(pairs) == 3
        values = [value for _, value in pairs]
        assert values == sorted(values, reverse=True)
        assert math.fsum(math.exp(v) for v in values) == pytest.approx(1.0, abs=1e-5)
        assert dict(pairs)[token] == pytest.approx(log_prob, abs=1e-6)


class Collecting:
    """The engine shell's outbox, as far as a work uses it: keeps the events sent."""

    def __init__(self, events: list):
        self.events = events

    def send(self, identity: bytes, event) -> None:
        self.events.append(event)

    def flush(self) -> None:
        pass


def test_final_events_carry_the_log_probs_asked_for(engine):
    params = [
        GenerationParams(max_new_tokens=3, top_logprobs=2, prompt_logprobs=True),
        GenerationParams(max_new_tokens=3),
    ]
    batch = [
        PendingRequest(f"r{i}", b"front", protocol.GenerateRequest(f"r{i}", p, q), (), 0.0)
        for i, (p, q) in enumerate(zip(PROMPTS[:2], params))
    ]
    sent = []
    assert HFGenerateWork(engine).run(batch, Collecting(sent)) == 2
    # Through the socket's encoding, as the front end gets them.
    asked, plain = protocol.decode_events(protocol.encode(protocol.BatchEvent(sent)))
    expected = engine.generate(PROMPTS[:2], params)[0]
    assert asked.token_ids == expected.token_ids
    assert asked.top_logprobs == expected.top_logprobs
    assert asked.prompt_log_probs == expected.prompt_log_probs
    assert len(asked.prompt_top_logprobs) == len(PROMPTS[0]) - 1
    assert all(len(pairs) == 2 for pairs in asked.prompt_top_logprobs)
    assert plain.top_logprobs is None
    assert plain.prompt_log_probs is None and plain.prompt_top_logprobs is None


def test_prompt_log_probs_taken_in_slices_equal_those_taken_whole(engine, monkeypatch):
    from lmserve.handlers.python_engine import hf_engine

    params = [GenerationParams(max_new_tokens=1, prompt_logprobs=True, top_logprobs=3)] * 2
    whole = engine.generate(PROMPTS[:2], params)
    monkeypatch.setattr(hf_engine, "_PROMPT_ROWS", 2)  # 6 positions: 3 slices
    sliced = engine.generate(PROMPTS[:2], params)
    for a, b in zip(whole, sliced):
        assert a.prompt_log_probs == pytest.approx(b.prompt_log_probs, abs=1e-6)
        assert [[t for t, _ in pairs] for pairs in a.prompt_top_logprobs] == [
            [t for t, _ in pairs] for pairs in b.prompt_top_logprobs
        ]
