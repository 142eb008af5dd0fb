"""Families beyond Llama served over HTTP by the rolling batch: Falcon (40B-style: grouped KV
heads, two LayerNorms) and Mixtral (a mixture of experts) on their native modules, OLMo 2
(no native module) on the generic path. The start-up log names the path, and concurrent
requests, streamed and not, get HF's greedy tokens."""

from __future__ import annotations

import json
import shutil
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
import torch
import transformers

from ..conftest import TOKENIZER_FILES
from ..hf_reference import assert_same_or_near_tie, hf_greedy_alone
from ..servers import Server, write_properties

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a land"]
MAX_NEW = 16


SIZES = dict(
    vocab_size=49152,  # SmolLM2's tokenizer
    hidden_size=48,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=512,
)
# architecture -> (its config's fields beyond SIZES, the start-up line naming its path)
FAMILIES = {
    "Olmo2ForCausalLM": (dict(num_key_value_heads=2), "the rolling batch's generic path"),
    "FalconForCausalLM": (
        dict(new_decoder_architecture=True, num_kv_heads=2),
        "the rolling batch's native falcon:FalconForCausalLM",
    ),
    "MixtralForCausalLM": (
        dict(num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2),
        "the rolling batch's native moe:MixtralForCausalLM",
    ),
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def served(request, tmp_path_factory, smollm2_dir):
    architecture = request.param
    folder = tmp_path_factory.mktemp(architecture)
    fields, _ = FAMILIES[architecture]
    config_class = getattr(transformers, architecture.replace("ForCausalLM", "Config"))
    config = config_class(**SIZES, **fields, architectures=[architecture])
    torch.manual_seed(3)
    model = getattr(transformers, architecture)(config).eval()
    model.save_pretrained(folder)
    for name in TOKENIZER_FILES:
        if (smollm2_dir / name).exists():
            shutil.copy(smollm2_dir / name, folder / name)
    write_properties(
        folder,
        {
            "engine": "MPI",
            "option.dtype": "fp32",
            "option.max_model_len": 256,
            "option.max_rolling_batch_size": 4,
        },
    )
    server = Server(folder)
    server.wait_healthy()
    yield server, model, transformers.AutoTokenizer.from_pretrained(folder), architecture
    assert server.stop() == 0


def ask(server, prompt: str, stream: bool) -> requests.Response:
    parameters = {"max_new_tokens": MAX_NEW, "details": True, "ignore_eos_token": True}
    body = {"inputs": prompt, "parameters": parameters, "stream": stream}
    return requests.post(f"{server.url}/invocations", json=body, timeout=300, stream=stream)


def token_ids(response: requests.Response, stream: bool) -> list[int]:
    assert response.status_code == 200, response.text
    if not stream:
        return [token["id"] for token in response.json()["details"]["tokens"]]
    events = [json.loads(line) for line in response.iter_lines() if line]
    return [event["token"]["id"] for event in events]


def test_start_up_names_the_serving_path(served):
    server, _, _, architecture = served
    log = server.log_path.read_text()
    assert f"model architecture {architecture}: {FAMILIES[architecture][1]}" in log


@pytest.mark.parametrize("stream", [False, True])
def test_concurrent_requests_get_hf_greedy_tokens(served, stream):
    server, model, tokenizer, _ = served
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        responses = list(pool.map(lambda prompt: ask(server, prompt, stream), PROMPTS))
        served_ids = [token_ids(response, stream) for response in responses]
    model.generation_config.eos_token_id = None  # random weights: the whole length
    for prompt, ids in zip(PROMPTS, served_ids):
        expected, logits = hf_greedy_alone(model, tokenizer(prompt)["input_ids"], MAX_NEW)
        assert_same_or_near_tie(ids, expected, logits, eos_ids=())
