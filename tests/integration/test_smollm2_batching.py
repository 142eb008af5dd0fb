"""The acceptance test of engine=Python: the embedded SmolLM2 served by a real `lmserve serve`
(no model configured) with dynamic batching; 8 concurrent greedy requests must each equal HF
transformers' greedy `generate` for that prompt run alone, and must have been batched."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from ..servers import Server, write_properties

PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea.",
    "def fibonacci(n):",
    "Once upon a time, in a land far away, there lived a",
    "The three primary colors are",
    "Translate to French: I like cheese.",
    "Q: What is 12 times 7?\nA:",
    "List the planets of the solar system in order from the sun:",
]
MAX_NEW_TOKENS = 24
NEAR_TIE = 1e-4


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = write_properties(
        tmp_path_factory.mktemp("smollm2-python"),
        {"engine": "Python", "batch_size": 4, "max_batch_delay": 100},
    )
    server = Server(folder)
    server.wait_healthy()
    yield server
    assert server.stop() == 0


@pytest.fixture(scope="module")
def hf(smollm2_dir):
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(smollm2_dir)


def hf_greedy_alone(hf, prompt: str) -> tuple[list[int], list[torch.Tensor]]:
    model, tokenizer = hf
    input_ids = torch.tensor([tokenizer(prompt)["input_ids"]])
    out = model.generate(
        input_ids=input_ids,
        attention_mask=torch.ones_like(input_ids),
        max_new_tokens=MAX_NEW_TOKENS,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
    )
    return out.sequences[0, input_ids.shape[1] :].tolist(), [s[0] for s in out.logits]


def assert_same_or_near_tie(served: list[int], expected: list[int], logits: list[torch.Tensor]):
    for step, (got, want) in enumerate(zip(served, expected)):
        if got != want:
            top2 = torch.topk(logits[step].float(), 2).values
            gap = (top2[0] - top2[1]).item()
            assert gap < NEAR_TIE, f"diverged at step {step} ({got} != {want}), top-2 gap {gap}"
            return
    assert served == expected[: len(served)]
    assert len(served) == len(expected) or served[-1] == 2  # only EOS may end it early


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

    _, tokenizer = hf
    for prompt, response in zip(PROMPTS, responses):
        assert response.status_code == 200, response.text
        body = response.json()
        served = [token["id"] for token in body["details"]["tokens"]]
        expected, logits = hf_greedy_alone(hf, prompt)
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
