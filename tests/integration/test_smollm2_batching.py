"""The acceptance test of engine=Python: the embedded SmolLM2 served by a real `lmserve serve`
(no model configured) with dynamic batching; 8 concurrent greedy requests must each equal HF
transformers' greedy `generate` for that prompt run alone, and must have been batched."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from ..hf_reference import VARIED_PROMPTS, assert_same_or_near_tie, hf_greedy_alone
from ..servers import Server, write_properties

PROMPTS = VARIED_PROMPTS[:8]
MAX_NEW_TOKENS = 24


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = write_properties(
        tmp_path_factory.mktemp("smollm2-python"),
        # fp32: the reference is HF's fp32 greedy output.
        {
            "engine": "Python",
            "option.rolling_batch": "disable",
            "batch_size": 4,
            "max_batch_delay": 100,
            "option.dtype": "fp32",
        },
    )
    server = Server(folder)
    server.wait_healthy()
    yield server
    assert server.stop() == 0


@pytest.fixture(scope="module")
def hf(smollm2_dir):
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(smollm2_dir)


def test_concurrent_greedy_requests_match_hf_and_are_batched(server, hf):
    def ask(prompt: str) -> requests.Response:
        return requests.post(
            f"{server.url}/invocations",
            json={
                "inputs": prompt,
                "parameters": {"max_new_tokens": MAX_NEW_TOKENS, "details": True},
            },
            timeout=300,
        )

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        responses = list(pool.map(ask, PROMPTS))

    for prompt, response in zip(PROMPTS, responses):
        assert response.status_code == 200, response.text
        body = response.json()
        served = [token["id"] for token in body["details"]["tokens"]]
        model, tokenizer = hf
        expected, logits = hf_greedy_alone(model, tokenizer(prompt)["input_ids"], MAX_NEW_TOKENS)
        assert_same_or_near_tie(served, expected, logits)
        assert body["generated_text"] == tokenizer.decode(served, skip_special_tokens=True)
        assert body["details"]["generated_tokens"] == len(served)

    name = requests.get(f"{server.url}/models", timeout=10).json()["models"][0]["modelName"]
    assert name == "SmolLM2-135M-Instruct"
    stats = requests.get(f"{server.url}/models/{name}", timeout=10).json()["engine"]["stats"]
    sizes = {int(size): count for size, count in stats["batch_sizes"].items()}
    assert sum(size * count for size, count in sizes.items()) == len(PROMPTS)
    assert max(sizes) > 1, f"requests were not batched: {sizes}"
    assert max(sizes) <= 4, f"a batch exceeded batch_size=4: {sizes}"


def test_readme_request_returns_text(server):
    response = requests.post(
        f"{server.url}/invocations",
        json={"inputs": "The capital of France is", "parameters": {"max_new_tokens": 16}},
        timeout=120,
    )
    assert response.status_code == 200
    assert "Paris" in response.json()["generated_text"]
    assert response.headers["x-request-id"]


def test_prompt_log_probs_and_top_tokens_equal_hf(server, hf):
    """decoder_input_details and top_n_tokens through engine=Python's HF generate."""
    model, tokenizer = hf
    prompt = PROMPTS[0]
    parameters = {"max_new_tokens": 4, "decoder_input_details": True, "top_n_tokens": 3}
    body = {"inputs": prompt, "parameters": parameters}
    details = requests.post(f"{server.url}/invocations", json=body, timeout=120).json()["details"]
    prompt_ids = tokenizer(prompt)["input_ids"]
    served = [token["id"] for token in details["tokens"]]
    with torch.inference_mode():
        logits = model(torch.tensor([prompt_ids + served])).logits[0]
    rows = torch.log_softmax(logits.float(), dim=-1)
    prefill = [token["log_prob"] for token in details["prefill"]]
    expected = rows[: len(prompt_ids) - 1].gather(1, torch.tensor(prompt_ids[1:])[:, None])
    assert prefill[0] is None and prefill[1:] == pytest.approx(expected[:, 0].tolist(), abs=5e-3)
    for step, top in enumerate(details["top_tokens"]):
        values, ids = rows[len(prompt_ids) - 1 + step].topk(3)
        assert [t["id"] for t in top][0] == served[step] == int(ids[0])
        assert [t["log_prob"] for t in top] == pytest.approx(values.tolist(), abs=5e-3)
