"""LoRA adapters with engine=Python: the tiny Llama with three PEFT adapters (different targets,
ranks and scalings, rsLoRA among them). A batch per adapter, and base-model batches between
them, give HF + PEFT's greedy tokens and prompt log-probs; a request naming an adapter that is
not served is refused before it is queued (404 naming it, 400 with LoRA off); an adapter lmserve
does not serve fails start-up, named."""

from __future__ import annotations

import json
import logging
import shutil

import pytest
import torch

from lmserve.handlers.python_engine.hf_engine import HFEngine
from lmserve.handlers.python_engine.hf_lora import adaptable_linears
from lmserve.handlers.python_engine.hf_work import HFGenerateWork
from lmserve.handlers.python_engine.process import load_hf_work, python_engine_shell
from lmserve.properties.config import load_config
from lmserve.rolling_batch.ipc import protocol
from lmserve.rolling_batch.ipc.protocol import GenerationParams
from lmserve.rolling_batch.ipc.runtime import Runtime
from lmserve.rolling_batch.lora.adapters import linear_shapes
from lmserve.rolling_batch.model.weights.loader import load_hf_config

from ..hf_reference import VARIED_PROMPTS, assert_same_or_near_tie, hf_greedy_alone
from ..lora_adapters import TINY_ADAPTERS, peft_model, tiny_model_with_adapters

MAX_NEW_TOKENS = 10
PROMPTS = VARIED_PROMPTS[:4]
# Each adapter's batch after another's, and the base model's after an adapter's: an adapter
# left active (or not switched on) shows in the tokens.
ORDER = ["attn", None, "everything", "mlp-rs", None, "attn"]


@pytest.fixture(scope="module")
def lora_model_dir(smollm2_dir, tmp_path_factory):
    return tiny_model_with_adapters(tmp_path_factory.mktemp("tiny-lora"), smollm2_dir)


@pytest.fixture(scope="module")
def prompt_ids(lora_model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(lora_model_dir)
    return [tokenizer(prompt)["input_ids"] for prompt in PROMPTS]


@pytest.fixture(scope="module")
def references(lora_model_dir):
    """{adapter (None: the base model): HF + PEFT's model}."""
    return {adapter: peft_model(lora_model_dir, adapter) for adapter in [None, *TINY_ADAPTERS]}


@pytest.fixture(scope="module")
def expected(references, prompt_ids):
    """{(prompt index, adapter): (HF + PEFT's greedy tokens alone, their logits)}."""
    return {
        (index, adapter): hf_greedy_alone(model, ids, MAX_NEW_TOKENS)
        for adapter, model in references.items()
        for index, ids in enumerate(prompt_ids)
    }


@pytest.fixture(scope="module")
def engine(lora_model_dir):
    return HFEngine.load(str(lora_model_dir), "fp32", enable_lora=True)


def test_adapters_change_what_the_model_says(expected):
    """The test adapters matter: each one's greedy tokens differ from the base model's."""
    for adapter in TINY_ADAPTERS:
        changed = [expected[i, adapter][0] != expected[i, None][0] for i in range(len(PROMPTS))]
        assert sum(changed) >= len(PROMPTS) // 2, adapter


def test_batch_per_adapter_matches_peft(engine, prompt_ids, expected):
    """Padded batches of prompts of different lengths, one adapter each, in turns."""
    assert set(engine.adapters) == set(TINY_ADAPTERS)
    for adapter in ORDER:
        params = [GenerationParams(max_new_tokens=MAX_NEW_TOKENS, ignore_eos=True, adapter=adapter)]
        rows = engine.generate(prompt_ids, params * len(prompt_ids))
        for index, row in enumerate(rows):
            tokens, logits = expected[index, adapter]
            assert_same_or_near_tie(row.token_ids, tokens, logits)


def test_prompt_log_probs_come_from_the_batchs_adapter(engine, prompt_ids, references):
    for adapter in ORDER:
        params = GenerationParams(max_new_tokens=1, prompt_logprobs=True, adapter=adapter)
        rows = engine.generate(prompt_ids, [params] * len(prompt_ids))
        for ids, row in zip(prompt_ids, rows):
            with torch.inference_mode():
                logits = references[adapter](torch.tensor([ids])).logits[0, :-1]
            wanted = torch.tensor(ids[1:]).unsqueeze(-1)
            log_probs = logits.float().log_softmax(-1).gather(-1, wanted).squeeze(-1)
            assert row.prompt_log_probs == pytest.approx(log_probs.tolist(), abs=1e-4)


class RecordingSocket:
    """The loop's ROUTER socket, as far as `_send` uses it: keeps what was sent."""

    def __init__(self):
        self.events = []

    def send_multipart(self, frames):
        self.events += protocol.decode_events(frames[1])


def run_requests(engine, requests) -> tuple[dict, int]:
    """({request id: its one event}, how many requests were queued) after the engine=Python
    loop took `requests` and ran every batch they made."""
    runtime = runtime_for("/nowhere", {})
    loop = python_engine_shell(runtime, HFGenerateWork(engine), RecordingSocket())
    for request in requests:
        loop.handle(b"front", request)
    num_queued = loop.core.batcher.num_queued
    while batch := loop.core.batcher.next_batch(float("inf")):
        loop.core.run_batch(batch, loop.outbox)
        loop.outbox.flush()
    events = {event.id: event for event in loop.socket.events}
    assert len(events) == len(loop.socket.events) == len(requests)  # one answer each
    return events, num_queued


def generate(request_id: str, ids: list[int], adapter: str | None) -> protocol.GenerateRequest:
    params = GenerationParams(max_new_tokens=MAX_NEW_TOKENS, ignore_eos=True, adapter=adapter)
    return protocol.GenerateRequest(request_id, ids, params)


def test_unknown_adapter_is_refused_with_404_naming_it(engine, prompt_ids, expected):
    events, num_queued = run_requests(
        engine, [generate("ok", prompt_ids[0], "mlp-rs"), generate("no", prompt_ids[0], "nope")]
    )
    assert num_queued == 1  # refused before it was queued
    assert events["ok"].token_ids == expected[0, "mlp-rs"][0]
    refused = events["no"]
    assert isinstance(refused, protocol.ErrorEvent) and refused.status == 404
    assert "'nope'" in refused.message and "served: attn, everything, mlp-rs" in refused.message
    # Should a request get past the worker, the engine refuses it too: never the base model.
    with pytest.raises(ValueError, match="no LoRA adapter named 'nope'"):
        engine.generate(prompt_ids[:1], [GenerationParams(adapter="nope")])


def test_adapter_with_lora_off_is_refused_with_400(lora_model_dir, prompt_ids, expected):
    engine = HFEngine.load(str(lora_model_dir), "fp32")  # the adapters are there, LoRA is off
    assert engine.adapters is None
    events, num_queued = run_requests(
        engine, [generate("base", prompt_ids[1], None), generate("lora", prompt_ids[1], "attn")]
    )
    assert num_queued == 1
    assert events["base"].token_ids == expected[1, None][0]
    refused = events["lora"]
    assert isinstance(refused, protocol.ErrorEvent) and refused.status == 400
    assert "LoRA is off" in refused.message


def test_adapter_names_peft_refuses_are_served(lora_model_dir, prompt_ids, expected, tmp_path):
    """PEFT's own adapter names may not hold a "."; a served name may ("sql-v1.2")."""
    model_dir = copy_model(lora_model_dir, tmp_path)
    shutil.copytree(lora_model_dir / "adapters" / "attn", model_dir / "adapters" / "sql-v1.2")
    engine = HFEngine.load(str(model_dir), "fp32", enable_lora=True)
    params = GenerationParams(max_new_tokens=MAX_NEW_TOKENS, ignore_eos=True, adapter="sql-v1.2")
    (row,) = engine.generate(prompt_ids[:1], [params])
    assert row.token_ids == expected[0, "attn"][0]


def test_the_worker_loads_the_adapters_the_config_asks_for(lora_model_dir, caplog):
    env = {"OPTION_ENABLE_LORA": "true"}
    caplog.set_level(logging.INFO, "lmserve.handlers.python_engine.hf_lora")
    work, _ = load_hf_work(runtime_for(lora_model_dir, env))
    assert sorted(work.engine.adapters) == sorted(TINY_ADAPTERS)
    assert "3 adapter(s)" in caplog.text and "attn, everything, mlp-rs" in caplog.text
    # option.max_lora_rank reaches the checks: the rank-8 adapters are refused, by name.
    env["OPTION_MAX_LORA_RANK"] = "4"
    with pytest.raises(ValueError, match=r"adapter 'attn': .*rank 8: above .*max_lora_rank=4"):
        load_hf_work(runtime_for(lora_model_dir, env))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"use_dora": True}, "DoRA"),
        ({"bias": "all"}, "bias='all'"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
    ],
)
def test_an_adapter_that_is_not_served_fails_start_up(lora_model_dir, tmp_path, change, message):
    model_dir = copy_model(lora_model_dir, tmp_path)
    folder = shutil.copytree(lora_model_dir / "adapters" / "attn", model_dir / "adapters" / "odd")
    config = json.loads((folder / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(ValueError, match=f"adapter 'odd': .*{message}"):
        HFEngine.load(str(model_dir), "fp32", enable_lora=True)


def test_the_checked_linears_are_the_rolling_batchs(references, lora_model_dir):
    """Read off the model, they are the Llama linears the rolling batch checks against."""
    shapes = linear_shapes(load_hf_config(lora_model_dir))
    assert adaptable_linears(references[None]) == shapes


def copy_model(model_dir, tmp_path):
    """The model without its adapters, in a folder of its own."""
    return shutil.copytree(
        model_dir, tmp_path / "model", ignore=lambda _, names: [n for n in names if n == "adapters"]
    )


def runtime_for(model_dir, env: dict[str, str]) -> Runtime:
    config = load_config(None, environ=env).config
    return Runtime(config, "m", str(model_dir), "test", str(model_dir))
