"""A family with no native module (GPT-NeoX) served over HTTP by the rolling batch's generic
path: the start-up log names the path, and concurrent requests, streamed and not, get HF's
greedy tokens."""

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


@pytest.fixture(scope="module")
def served(tmp_path_factory, smollm2_dir):
    folder = tmp_path_factory.mktemp("generic-neox")
    config = transformers.GPTNeoXConfig(
        vocab_size=49152,  # SmolLM2's tokenizer
        hidden_size=48,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        rotary_pct=0.5,
        max_position_embeddings=512,
        architectures=["GPTNeoXForCausalLM"],
    )
    torch.manual_seed(3)
    model = transformers.GPTNeoXForCausalLM(config).eval()
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
    yield server, model, transformers.AutoTokenizer.from_pretrained(folder)
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


def test_start_up_names_the_generic_path(served):
    server, _, _ = served
    log = server.log_path.read_text()
    assert "model architecture GPTNeoXForCausalLM: the rolling batch's generic path" in log


@pytest.mark.parametrize("stream", [False, True])
def test_concurrent_requests_get_hf_greedy_tokens(served, stream):
    server, model, tokenizer = served
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        responses = list(pool.map(lambda prompt: ask(server, prompt, stream), PROMPTS))
        served_ids = [token_ids(response, stream) for response in responses]
    model.generation_config.eos_token_id = None  # random weights: the whole length
    for prompt, ids in zip(PROMPTS, served_ids):
        expected, logits = hf_greedy_alone(model, tokenizer(prompt)["input_ids"], MAX_NEW)
        assert_same_or_near_tie(ids, expected, logits, eos_ids=())
