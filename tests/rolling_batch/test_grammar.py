"""Structured output in the engines, on SmolLM2's real vocabulary: whatever a model prefers,
a constrained request's text follows its grammar (regex, JSON schema), the grammar's end ends
the answer, rows without a grammar in the same batch are untouched, n-gram drafts are cut to
what the grammar allows, and engine=Python's `generate` masks its rows the same way."""

from __future__ import annotations

import json
import math
import re
import time
import uuid

import jsonschema
import pytest
import torch
import zmq

from lmserve.handlers.agents.structured_output import json_schema_grammar, tgi_grammar
from lmserve.handlers.python_engine.hf_engine import HFEngine
from lmserve.handlers.tokenizer import Tokenizer
from lmserve.rolling_batch.core.block_manager import BlockManager
from lmserve.rolling_batch.core.grammar import GrammarCompiler, GrammarError
from lmserve.rolling_batch.core.request import Request
from lmserve.rolling_batch.core.scheduler import Scheduler
from lmserve.rolling_batch.core.speculation import NgramDrafter
from lmserve.rolling_batch.engine.rolling_core import RollingBatchCore
from lmserve.rolling_batch.engine.sampler import Sampler
from lmserve.rolling_batch.engine.shell import EngineShell
from lmserve.rolling_batch.ipc import protocol
from lmserve.rolling_batch.ipc.protocol import GenerationParams
from lmserve.rolling_batch.model.runner import StepLogits

VOCAB = 49152  # SmolLM2's
EOS = 2
PHONE = r"[0-9]{3}-[0-9]{4}"
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
        "size": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["name", "tags", "size"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def compiler(smollm2_dir):
    return GrammarCompiler(smollm2_dir, {EOS})


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    return Tokenizer(smollm2_dir)


def regex_grammar(pattern: str) -> str:
    return tgi_grammar({"type": "regex", "value": pattern})


def constrained(compiler, grammar: str, **params) -> Request:
    params = GenerationParams(max_new_tokens=40, grammar=grammar, **params)
    request = Request(uuid.uuid4().hex, [1, 2, 3], params, 0.0)
    request.grammar = compiler.state_for(grammar).result()
    return request


def sample_until_done(sampler: Sampler, requests: list[Request], steps: list[torch.Tensor]):
    """Samples the rows together, step after step (row i of a step's logits for requests[i]),
    feeding each grammar its token, until every constrained row's grammar is complete."""
    for logits in steps:
        live = [i for i, r in enumerate(requests) if r.grammar is None or not r.grammar.is_finished]
        if all(requests[i].grammar is None for i in live):
            return
        sampled, failed = sampler.sample(logits[live], [requests[i] for i in live])
        assert not failed
        for request, sample in sampled.items():
            request.output_ids.append(sample.token)
            if request.grammar is not None:
                request.grammar.accept(sample.token)


def test_sampled_rows_follow_their_grammar_and_free_rows_are_untouched(compiler, tokenizer):
    torch.manual_seed(0)
    phone = constrained(compiler, regex_grammar(PHONE), do_sample=True, seed=1)
    record = constrained(compiler, json_schema_grammar(SCHEMA, "schema"))
    free = Request("free", [1, 2, 3], GenerationParams(max_new_tokens=40), 0.0)
    steps = [torch.randn(3, VOCAB) * 5 for _ in range(40)]
    sample_until_done(Sampler(torch.device("cpu")), [phone, record, free], steps)
    assert re.fullmatch(PHONE, tokenizer.decode(phone.output_ids))
    jsonschema.validate(json.loads(tokenizer.decode(record.output_ids)), SCHEMA)
    # The free row took the argmax of its own logits at every step, grammars or not beside it.
    assert free.output_ids == [int(s[2].argmax()) for s in steps[: len(free.output_ids)]]


def test_log_probs_are_of_the_masked_distribution(compiler, tokenizer):
    """What a constrained row reports: its token's log-prob and alternatives under what the
    grammar allows (the distribution it was drawn from), never a forbidden token."""
    for do_sample in (False, True):
        digit = constrained(compiler, regex_grammar("[0-9]"), top_logprobs=12, do_sample=do_sample)
        sampled, failed = Sampler(torch.device("cpu")).sample(torch.randn(1, VOCAB) * 3, [digit])
        sample = sampled[digit]
        alternatives = dict(sample.top_logprobs)  # only the ten digits have a probability
        assert sorted(tokenizer.decode([t]) for t in alternatives) == list("0123456789")
        assert sum(math.exp(p) for p in alternatives.values()) == pytest.approx(1.0, abs=1e-4)
        assert alternatives[sample.token] == pytest.approx(sample.log_prob, abs=1e-5)


def test_the_same_grammar_gives_each_request_its_own_state(compiler):
    grammar = regex_grammar(PHONE)
    first = compiler.state_for(grammar).result()
    second = compiler.state_for(grammar).result()
    first.advance(tuple(first.matcher.compute_ff_tokens() or [19]))  # "0"-ish progress
    assert second.valid_prefix((EOS,)) == 0  # still at the start: EOS is not allowed yet


def test_a_grammar_that_does_not_build_raises_grammar_error(compiler):
    with pytest.raises(GrammarError):
        compiler.state_for('{"grammars": [{"lark_grammar": "start: undefined_rule"}]}').result()


# --- the rolling engine, with a fake model that prefers what the grammar forbids ---------------


def fake_execute(chunks) -> StepLogits:
    rows = sum(c.num_logits for c in chunks)
    logits = torch.zeros(rows, VOCAB)
    logits[:, 1000] = 10.0  # the "model" wants token 1000 ("ily") every time
    return StepLogits(logits, {}, tuple(1000 for c in chunks if c.num_argmax))


@pytest.fixture
def engine_socket():
    context = zmq.Context.instance()
    address = f"inproc://grammar-{uuid.uuid4().hex}"
    router, dealer = context.socket(zmq.ROUTER), context.socket(zmq.DEALER)
    router.bind(address)
    dealer.connect(address)
    yield router, dealer
    router.close(linger=0)
    dealer.close(linger=0)


def run_engine(engine: EngineShell, dealer, count: int) -> dict[str, protocol.Event]:
    """Steps the engine (grammars build in the background) until `count` final answers."""
    finals: dict[str, protocol.Event] = {}
    tokens: dict[str, list[int]] = {}
    deadline = time.monotonic() + 60  # a hang guard only
    while len(finals) < count and time.monotonic() < deadline:
        engine.read_socket()
        engine.turn()
        while dealer.poll(0):
            for event in protocol.decode_events(dealer.recv()):
                tokens.setdefault(event.id, []).extend(getattr(event, "token_ids", []))
                if not isinstance(event, protocol.TokenEvent):
                    finals[event.id] = event
    for request_id, final in finals.items():
        if isinstance(final, protocol.FinalEvent):
            final.token_ids = tokens[request_id]
    return finals


def answers(compiler, tokenizer, engine_socket, drafter) -> dict[str, protocol.Event]:
    router, dealer = engine_socket
    scheduler = Scheduler(BlockManager(64, 16), 8, 256, 512, drafter=drafter, argmax_head=True)
    core = RollingBatchCore(
        fake_execute, scheduler, Sampler(torch.device("cpu")), {EOS}, grammars=compiler
    )
    engine = EngineShell(core, router, 100)
    # A prompt that repeats itself: the drafter proposes its n-grams, "-" where a digit must be.
    prompt = tokenizer.encode("000-0000 000-0000 000-0000", add_special_tokens=False)
    for request_id, grammar in (("phone", regex_grammar(PHONE)), ("free", None)):
        params = GenerationParams(max_new_tokens=12, grammar=grammar, log_probs=False)
        dealer.send(protocol.encode(protocol.GenerateRequest(request_id, prompt, params)))
    finals = run_engine(engine, dealer, 2)
    scheduler.check_invariants()
    return finals


def test_the_engine_answers_within_the_grammar_and_ends_where_it_ends(
    compiler, tokenizer, engine_socket
):
    finals = answers(compiler, tokenizer, engine_socket, drafter=None)
    phone, free = finals["phone"], finals["free"]
    assert re.fullmatch(PHONE, tokenizer.decode(phone.token_ids))
    assert phone.finish_reason == "eos_token"  # the grammar's end, before max_new_tokens
    assert free.token_ids == [1000] * 12 and free.finish_reason == "length"


def test_drafts_are_checked_against_the_grammar(compiler, tokenizer, engine_socket):
    """With n-gram speculation: drafts the grammar forbids are cut, the ones it allows are
    checked under its masks, and the answer is the one decoded token by token."""
    alone = answers(compiler, tokenizer, engine_socket, drafter=None)
    drafter = NgramDrafter(max_draft=4)
    speculated = answers(compiler, tokenizer, engine_socket, drafter)
    assert drafter.num_drafted > 0
    for request_id in ("phone", "free"):
        assert speculated[request_id].token_ids == alone[request_id].token_ids


def test_engine_python_masks_its_constrained_rows(tiny_model_dir, tokenizer):
    engine = HFEngine.load(str(tiny_model_dir), "fp32")
    prompts = [tokenizer.encode("Describe it:"), tokenizer.encode("Hello")]
    free_params = GenerationParams(max_new_tokens=6, ignore_eos=True)
    grammar = json_schema_grammar(SCHEMA, "schema")
    record, free = engine.generate(
        prompts, [GenerationParams(max_new_tokens=60, grammar=grammar), free_params]
    )
    jsonschema.validate(json.loads(tokenizer.decode(record.token_ids)), SCHEMA)
    assert record.finish_reason == "eos_token"
    (alone,) = engine.generate(prompts[1:], [free_params])
    assert free.token_ids == alone.token_ids


def test_engine_python_ends_an_answer_where_its_grammar_ends(tiny_model_dir, tokenizer):
    """As the rolling batch does: a complete answer ends there even with ignore_eos, and a
    free row beside it runs on to max_new_tokens."""
    engine = HFEngine.load(str(tiny_model_dir), "fp32")
    prompts = [tokenizer.encode("Call me at"), tokenizer.encode("Hello")]
    phone = GenerationParams(max_new_tokens=30, ignore_eos=True, grammar=regex_grammar(PHONE))
    free = GenerationParams(max_new_tokens=30, ignore_eos=True)
    answered, running = engine.generate(prompts, [phone, free])
    assert re.fullmatch(PHONE, tokenizer.decode(answered.token_ids))
    assert answered.finish_reason == "eos_token"
    assert len(answered.log_probs) == len(answered.token_ids) < 30
    assert len(running.token_ids) == 30 and running.finish_reason == "length"


def test_engine_python_ends_an_answer_at_an_eos_its_grammar_allows(compiler, tokenizer):
    """A grammar that may end or go on ([0-9]+): an EOS it allows after "42" ends the answer
    there, EOS kept, also with ignore_eos (as in the rolling batch); a row whose grammar still
    runs goes on."""
    from lmserve.handlers.python_engine.hf_grammar import GrammarRows

    digits = [compiler.state_for(regex_grammar("[0-9]+")).result() for _ in range(2)]
    rows = GrammarRows(digits, {EOS})
    for position, token in enumerate(tokenizer.encode("42", add_special_tokens=False), 1):
        rows.take([token, token], position)
    rows.take([EOS, tokenizer.encode("7", add_special_tokens=False)[0]], 3)
    assert rows.ended_at == {0: 3} and rows.grammars[0] is None
    assert rows.grammars[1] is not None
