"""LoRA over HTTP with engine=Python (dynamic batches through HF `generate` + PEFT), through a
real `lmserve serve`: requests naming adapters answered as HF + PEFT answers them, the
management API's round trip answered as the rolling engine answers it (list, register a folder
made outside the model dir, use it, 409 for a taken name, unregister, then 404), and the
per-adapter metrics."""

from __future__ import annotations

import pytest
import requests
from transformers import AutoTokenizer

from ..hf_reference import hf_greedy_alone
from ..lora_adapters import (
    TINY_ADAPTERS,
    peft_model,
    save_adapter,
    save_late_adapter,
    tiny_model_with_adapters,
)
from ..servers import Server, write_properties
from .test_lora_server import (
    MAX_NEW_TOKENS,
    PROMPTS,
    adapter_metrics,
    assert_answers,
    generate,
    metric_changes,
    token_ids,
)


@pytest.fixture(scope="module")
def model_dir(smollm2_dir, tmp_path_factory):
    return tiny_model_with_adapters(tmp_path_factory.mktemp("lora-python"), smollm2_dir)


@pytest.fixture(scope="module")
def late(model_dir, tmp_path_factory):
    return save_late_adapter(model_dir, tmp_path_factory.mktemp("late-adapter"))


@pytest.fixture(scope="module")
def reference(model_dir, late):
    """{(prompt, adapter): (HF + PEFT's greedy tokens, their logits)}."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    expected = {}
    for adapter in [None, *TINY_ADAPTERS, "late"]:
        model = peft_model(model_dir, adapter, folder=late if adapter == "late" else None)
        for prompt in PROMPTS:
            ids = tokenizer(prompt)["input_ids"]
            expected[prompt, adapter] = hf_greedy_alone(model, ids, MAX_NEW_TOKENS)
    return expected


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    properties = {
        "engine": "Python",
        "option.rolling_batch": "disable",
        "option.model_id": model_dir,
        "option.dtype": "fp32",  # as HF's reference
        "option.enable_lora": "true",
        "batch_size": 4,
        "max_batch_delay": 100,
    }
    folder = write_properties(tmp_path_factory.mktemp("lora-python") / "model", properties)
    server = Server(folder)
    server.wait_healthy()
    yield server
    assert server.stop() == 0


@pytest.fixture(scope="module")
def adapters_url(server) -> str:
    name = requests.get(f"{server.url}/v1/models", timeout=30).json()["data"][0]["id"]
    return f"{server.url}/models/{name}/adapters"


def test_adapters_and_base_model_match_peft(server, reference):
    assert_answers(server, reference, [None, *TINY_ADAPTERS])
    response = generate(server, PROMPTS[0], "nope")
    assert response.status_code == 404
    assert "'nope'" in response.json()["message"] and "attn" in response.json()["message"]


def test_management_api_round_trip(server, adapters_url, reference, late, model_dir):
    listed = requests.get(adapters_url, timeout=30).json()["adapters"]
    folders = {name: str(model_dir / "adapters" / name) for name in TINY_ADAPTERS}
    assert listed == [{"name": name, "src": folders[name]} for name in TINY_ADAPTERS]
    assert generate(server, PROMPTS[0], "late").status_code == 404  # not yet

    src = str(late)
    response = requests.post(adapters_url, params={"name": "late", "src": src}, timeout=60)
    assert response.status_code == 200, response.text
    assert response.json()["adapter"] == {"name": "late", "src": src}
    assert requests.get(f"{adapters_url}/late", timeout=30).json() == {"name": "late", "src": src}
    assert_answers(server, reference, ["late", None])
    again = requests.post(adapters_url, json={"name": "late", "src": src}, timeout=60)
    assert again.status_code == 409
    assert "'late'" in again.json()["message"]

    deleted = requests.delete(f"{adapters_url}/late", timeout=30)
    assert deleted.status_code == 200, deleted.text
    response = generate(server, PROMPTS[0], "late")
    assert response.status_code == 404
    assert "'late'" in response.json()["message"]
    assert requests.get(f"{adapters_url}/late", timeout=30).status_code == 404
    assert requests.delete(f"{adapters_url}/late", timeout=30).status_code == 404
    names = [a["name"] for a in requests.get(adapters_url, timeout=30).json()["adapters"]]
    assert names == list(TINY_ADAPTERS)


def test_an_adapter_that_cannot_be_served_is_refused_at_registration(
    adapters_url, model_dir, tmp_path
):
    folder = save_adapter(model_dir, "big", ["q_proj"], 32, 8, False, seed=5, folder=tmp_path)
    response = requests.post(adapters_url, params={"name": "big", "src": str(folder)}, timeout=60)
    assert response.status_code == 400  # rank 32 > max_lora_rank 16
    message = response.json()["message"]
    assert "'big'" in message and "max_lora_rank=16" in message


def test_metrics_count_requests_and_tokens_per_adapter(server):
    before = adapter_metrics(server)
    assert generate(server, PROMPTS[1], None).status_code == 200  # the base model: not counted
    response = generate(server, PROMPTS[1], "mlp-rs")
    assert response.status_code == 200
    assert metric_changes(before, adapter_metrics(server)) == {
        ("lmserve_adapter_requests_total", "mlp-rs"): 1,
        ("lmserve_adapter_tokens_total", "mlp-rs"): len(token_ids(response.json())),
    }
