"""The LoRA adapter management API at engine=Python, through the engine loop with the tiny Llama
and real PEFT adapters: answered as the rolling engine answers it (list, register, 400 for an
adapter that cannot be served, 409 for a taken name, unregister, 404 for an unknown one); a
registered adapter answers as HF + PEFT does; an unregistered one is refused to new requests at
once and taken off the model once no queued request names it; the last one gone leaves the plain
model. Requests admitted and tokens generated are counted per adapter."""

from __future__ import annotations

import json
import shutil
import time

import pytest
from peft import PeftModel

from lmserve.handlers.python_engine.hf_engine import HFEngine
from lmserve.handlers.python_engine.hf_lora import adaptable_linears
from lmserve.handlers.python_engine.hf_work import HFGenerateWork
from lmserve.handlers.python_engine.process import python_engine_shell
from lmserve.rolling_batch.engine.shell import EngineShell
from lmserve.rolling_batch.ipc import protocol
from lmserve.rolling_batch.lora.adapters import linear_shapes
from lmserve.rolling_batch.model.weights.loader import load_hf_config

from ..hf_reference import assert_same_or_near_tie, hf_greedy_alone
from ..lora_adapters import (
    TINY_ADAPTERS,
    peft_model,
    save_adapter,
    save_late_adapter,
    tiny_model_with_adapters,
)
from .test_hf_engine_lora import MAX_NEW_TOKENS, RecordingSocket, copy_model, generate, runtime_for

PROMPT = "Write a haiku about the sea."


@pytest.fixture(scope="module")
def model_dir(smollm2_dir, tmp_path_factory):
    return tiny_model_with_adapters(tmp_path_factory.mktemp("tiny-lora"), smollm2_dir)


@pytest.fixture(scope="module")
def prompt_ids(model_dir) -> list[int]:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)(PROMPT)["input_ids"]


@pytest.fixture(scope="module")
def late(model_dir, tmp_path_factory):
    return save_late_adapter(model_dir, tmp_path_factory.mktemp("late"))


@pytest.fixture(scope="module")
def reference(model_dir, late, prompt_ids):
    """{adapter (None: the base model): (HF + PEFT's greedy tokens for PROMPT, logits)}."""
    models = {
        None: peft_model(model_dir, None),
        "attn": peft_model(model_dir, "attn"),
        "late": peft_model(model_dir, "late", folder=late),
    }
    return {name: hf_greedy_alone(m, prompt_ids, MAX_NEW_TOKENS) for name, m in models.items()}


@pytest.fixture
def engine(model_dir):
    """A fresh engine each test: registering changes it."""
    return HFEngine.load(str(model_dir), "fp32", enable_lora=True)


def loop_for(engine) -> EngineShell:
    runtime = runtime_for("/nowhere", {})
    return python_engine_shell(runtime, HFGenerateWork(engine), RecordingSocket())


def ask(loop, action: str, **fields):
    """The loop's one answer to an adapter management command."""
    loop.socket.events.clear()
    loop.handle(b"front", protocol.AdapterCommand(f"cmd-{action}", action, **fields))
    (answer,) = loop.socket.events
    return answer


def run_all(loop) -> dict:
    """Runs every queued batch; {request id: its answer} of everything sent meanwhile."""
    while batch := loop.core.batcher.next_batch(float("inf")):
        loop.core.run_batch(batch, loop.outbox)
        loop.outbox.flush()
    loop.retire_unused_adapters()
    return {event.id: event for event in loop.socket.events}


def send_generate(loop, request_id: str, ids, adapter):
    loop.socket.events.clear()
    loop.handle(b"front", generate(request_id, ids, adapter))


def assert_error(event, status: int, *parts: str):
    assert isinstance(event, protocol.ErrorEvent), event
    assert event.status == status, event.message
    for part in parts:
        assert part in event.message


def test_list_register_use_and_unregister(engine, late, reference, prompt_ids):
    loop = loop_for(engine)
    listed = ask(loop, "list").adapters
    folders = engine.adapter_folders
    assert listed == [{"name": n, "src": str(folders[n])} for n in TINY_ADAPTERS]

    answer = ask(loop, "register", name="late", src="s3://b/late", path=str(late))
    assert answer.adapters == [{"name": "late", "src": "s3://b/late"}]  # the src as given
    assert [a["name"] for a in ask(loop, "list").adapters] == [*TINY_ADAPTERS, "late"]
    send_generate(loop, "late-1", prompt_ids, "late")
    tokens, logits = reference["late"]
    assert_same_or_near_tie(run_all(loop)["late-1"].token_ids, tokens, logits)
    assert tokens != reference[None][0]  # the adapter matters

    assert_error(ask(loop, "register", name="late", path=str(late)), 409, "'late'")
    assert_error(ask(loop, "register", name="a/b", path=str(late)), 400, "a name is")

    peft_name = engine.adapters["late"]
    gone = ask(loop, "unregister", name="late")
    assert gone.adapters == [{"name": "late", "src": "s3://b/late"}]
    assert "late" not in engine.adapters and peft_name not in engine.model.peft_config
    send_generate(loop, "late-2", prompt_ids, "late")
    assert_error(loop.socket.events[0], 404, "'late'")
    assert_error(ask(loop, "unregister", name="late"), 404, "no LoRA adapter named 'late'")
    assert_error(ask(loop, "rename", name="attn"), 400, "unknown adapter action")
    assert [a["name"] for a in ask(loop, "list").adapters] == list(TINY_ADAPTERS)


def test_an_unregistered_adapter_stays_until_its_queued_requests_leave(
    engine, reference, prompt_ids
):
    """Left through an abort, an expiry or its batch: each one releases the adapter."""
    loop = loop_for(engine)
    send_generate(loop, "aborted", prompt_ids, "mlp-rs")
    send_generate(loop, "expires", prompt_ids, "mlp-rs")
    boundary = time.monotonic()
    send_generate(loop, "runs", prompt_ids, "attn")
    for name in ("attn", "mlp-rs"):
        assert ask(loop, "unregister", name=name).adapters[0]["name"] == name
        send_generate(loop, f"new-{name}", prompt_ids, name)
        assert_error(loop.socket.events[0], 404, repr(name))  # refused at once, never queued
    assert loop.core.batcher.num_queued == 3
    assert [a["name"] for a in ask(loop, "list").adapters] == ["everything"]
    loop.retire_unused_adapters()
    assert {"attn", "mlp-rs"} <= set(engine.adapters)  # queued requests name them

    loop.handle(b"front", protocol.AbortRequest("aborted"))
    loop.retire_unused_adapters()
    assert "mlp-rs" in engine.adapters  # "expires" is still queued
    loop.expire_waiting(boundary + loop.slot_timeout_s)
    assert_error(loop.socket.events[-1], 503, "predict_timeout")
    loop.retire_unused_adapters()
    assert "mlp-rs" not in engine.adapters and "attn" in engine.adapters

    loop.socket.events.clear()
    tokens, logits = reference["attn"]
    assert_same_or_near_tie(run_all(loop)["runs"].token_ids, tokens, logits)
    assert set(engine.adapters) == {"everything"}
    assert list(engine.model.peft_config) == [engine.adapters["everything"]]


def test_an_adapter_that_cannot_be_served_is_refused_and_nothing_changes(
    engine, model_dir, tmp_path, prompt_ids, reference
):
    loop = loop_for(engine)
    big = save_adapter(model_dir, "big", ["q_proj"], 32, 8, False, seed=5, folder=tmp_path / "big")
    assert_error(ask(loop, "register", name="big", path=str(big)), 400, "'big'", "max_lora_rank=16")
    # Past lmserve's checks, refused by PEFT itself: a target the model does not have.
    odd = shutil.copytree(model_dir / "adapters" / "attn", tmp_path / "odd")
    config = json.loads((odd / "adapter_config.json").read_text())
    config["target_modules"] = ["no_such_proj"]
    (odd / "adapter_config.json").write_text(json.dumps(config))
    assert_error(ask(loop, "register", name="odd", path=str(odd)), 400, "'odd'", "PEFT")
    assert set(engine.adapters) == set(TINY_ADAPTERS)
    assert len(engine.model.peft_config) == len(TINY_ADAPTERS)
    assert [a["name"] for a in ask(loop, "list").adapters] == list(TINY_ADAPTERS)
    send_generate(loop, "attn", prompt_ids, "attn")
    tokens, logits = reference["attn"]
    assert_same_or_near_tie(run_all(loop)["attn"].token_ids, tokens, logits)


def test_the_last_adapter_gone_leaves_the_plain_model(
    model_dir, late, tmp_path, reference, prompt_ids
):
    engine = HFEngine.load(str(copy_model(model_dir, tmp_path)), "fp32", enable_lora=True)
    loop = loop_for(engine)
    assert ask(loop, "list").adapters == []
    for round_ in range(2):  # a second time under a new PEFT name
        assert ask(loop, "register", name="late", path=str(late)).adapters[0]["name"] == "late"
        assert isinstance(engine.model, PeftModel)
        for adapter in ("late", None):
            send_generate(loop, f"{adapter}-{round_}", prompt_ids, adapter)
        answers = run_all(loop)
        for adapter in ("late", None):
            tokens, logits = reference[adapter]
            assert_same_or_near_tie(answers[f"{adapter}-{round_}"].token_ids, tokens, logits)
        ask(loop, "unregister", name="late")
        assert not isinstance(engine.model, PeftModel) and engine.adapters == {}
        send_generate(loop, f"base-{round_}", prompt_ids, None)
        assert run_all(loop)[f"base-{round_}"].token_ids == reference[None][0]


def test_requests_and_tokens_are_counted_per_adapter(engine, prompt_ids):
    loop = loop_for(engine)
    requests = [("a", "attn"), ("b", "attn"), ("c", "mlp-rs"), ("d", None), ("e", "nope")]
    for request_id, adapter in requests:
        loop.handle(b"front", generate(request_id, prompt_ids, adapter))
    stats = loop.stats()
    assert stats["adapter_requests"] == {"attn": 2, "mlp-rs": 1}  # admitted: not "nope"
    assert stats["adapter_tokens"] == {}
    answers = run_all(loop)
    stats = loop.stats()
    assert stats["adapter_requests"] == {"attn": 2, "mlp-rs": 1}
    tokens = {
        "attn": len(answers["a"].token_ids) + len(answers["b"].token_ids),
        "mlp-rs": len(answers["c"].token_ids),
    }
    assert stats["adapter_tokens"] == tokens and tokens["attn"] == 2 * MAX_NEW_TOKENS
    assert loop.adapter_of == {}  # every request left the engine


class LoraOffModel:
    adapters = None  # LoRA off


def test_with_lora_off_the_answers_are_the_rolling_engines():
    loop = loop_for(LoraOffModel())
    assert ask(loop, "list").adapters == []
    assert_error(ask(loop, "register", name="x", path="/x"), 400, "option.enable_lora=false")
    assert_error(ask(loop, "unregister", name="x"), 400, "option.enable_lora=false")


class ModelPyWork:
    """A model.py's work, as far as the loop looks: no `adapters`."""

    request_type = protocol.HandleRequest
    num_failed = 0


def test_a_model_py_takes_no_adapter_commands():
    loop = python_engine_shell(runtime_for("/nowhere", {}), ModelPyWork(), RecordingSocket())
    assert_error(ask(loop, "list"), 501, "AdapterCommand")
    loop.retire_unused_adapters()  # nothing to retire, and no LoRA to ask


def test_the_checked_linears_are_read_through_peft(engine, model_dir):
    """A new adapter is checked against the linears PEFT wraps, as at start."""
    assert isinstance(engine.model, PeftModel)
    assert adaptable_linears(engine.model) == linear_shapes(load_hf_config(model_dir))
