"""engine=MPI end to end: `lmserve serve` with two real MPI ranks (tensor parallel) serving
SmolLM2 with rolling batching. 24 concurrent greedy requests of different prompt lengths and
max_new_tokens each equal HF's greedy output; the same with paged attention off and with a
block pool small enough to force preemption. Every third request also asks for its prompt's
log-probs and the top tokens, which equal HF's across the ranks' sharded LM head. Two of the
three start from the LMI guides' starter configs (engine=Python with
option.rolling_batch=scheduler or vllm), which lmserve serves with the same rolling batch over
MPI ranks. Then requests with a grammar (TGI's regex), greedy and sampled, answer within it
across the ranks, preempted or not."""

from __future__ import annotations

import random
import re
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from ..hf_reference import assert_same_or_near_tie, hf_greedy_alone
from ..servers import Server, write_properties

WORDS = "the quick brown fox jumps over a lazy dog while seven wise owls watch it".split()
ROLLING = {
    "engine": "MPI",
    "option.tensor_parallel_degree": 2,
    "option.max_rolling_batch_size": 8,
    "option.max_model_len": 256,
    "option.dtype": "fp32",  # the reference is HF's fp32 greedy output
}


def make_requests(count: int = 24):
    rng = random.Random(7)
    requests_ = []
    for index in range(count):
        words = [rng.choice(WORDS) for _ in range(rng.randrange(1, 40))]
        requests_.append((f"Story {index}: " + " ".join(words), rng.randrange(1, 65)))
    return requests_


@pytest.fixture(scope="module")
def workload(smollm2_dir):
    """The requests and HF's greedy answer to each, run alone."""
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    cases = []
    for prompt, max_new in make_requests():
        prompt_ids = tokenizer(prompt)["input_ids"]
        expected, logits = hf_greedy_alone(model, prompt_ids, max_new)
        with torch.inference_mode():
            prompt_rows = torch.log_softmax(model(torch.tensor([prompt_ids])).logits[0], dim=-1)
        prompt_log_probs = prompt_rows[:-1].gather(1, torch.tensor(prompt_ids[1:])[:, None])
        cases.append((prompt, max_new, expected, logits, prompt_log_probs[:, 0].tolist()))
    return cases


def asks_for_log_probs(index: int) -> bool:
    return index % 3 == 0


def serve(tmp_path, **extra) -> Server:
    server = Server(write_properties(tmp_path / "model", {**ROLLING, **extra}))
    server.wait_healthy()
    return server


def fire(server: Server, workload) -> list[requests.Response]:
    def ask(index):
        prompt, max_new, *_ = workload[index]
        parameters = {"max_new_tokens": max_new, "details": True}
        if asks_for_log_probs(index):
            parameters.update(decoder_input_details=True, top_n_tokens=2)
        body = {"inputs": prompt, "parameters": parameters}
        return requests.post(f"{server.url}/invocations", json=body, timeout=600)

    with ThreadPoolExecutor(len(workload)) as pool:
        return list(pool.map(ask, range(len(workload))))


def engine_stats(server: Server) -> dict:
    name = requests.get(f"{server.url}/models", timeout=10).json()["models"][0]["modelName"]
    return requests.get(f"{server.url}/models/{name}", timeout=10).json()["engine"]["stats"]


def check_structured_outputs(server: Server) -> None:
    """Grammars across the ranks (rank 0 samples), sampled and greedy, beside free requests
    (and, with a small block pool, preempted and recomputed: the grammar keeps its place)."""
    pattern = r"[0-9]{3}-[0-9]{4}( ext\. [0-9]{2})?"

    def ask(index):
        parameters = {"max_new_tokens": 24, "do_sample": index % 2 == 1, "seed": index}
        if index % 4 != 3:
            parameters["grammar"] = {"type": "regex", "value": pattern}
        body = {"inputs": f"Story {index}: call me at", "parameters": parameters}
        return requests.post(f"{server.url}/invocations", json=body, timeout=600)

    with ThreadPoolExecutor(12) as pool:
        answers = list(pool.map(ask, range(12)))
    for index, answer in enumerate(answers):
        assert answer.status_code == 200, answer.text
        if index % 4 != 3:
            assert re.fullmatch(pattern, answer.json()["generated_text"]), answer.text


def check_answers(responses, workload):
    for index, (response, case) in enumerate(zip(responses, workload)):
        _, max_new, expected, logits, prompt_log_probs = case
        assert response.status_code == 200, response.text
        details = response.json()["details"]
        served = [token["id"] for token in details["tokens"]]
        assert len(served) <= max_new
        assert_same_or_near_tie(served, expected, logits)
        if asks_for_log_probs(index):
            prefill = [token["log_prob"] for token in details["prefill"]]
            assert prefill[0] is None
            assert prefill[1:] == pytest.approx(prompt_log_probs, abs=5e-3)
            assert [top[0]["id"] for top in details["top_tokens"]] == served
        else:
            assert "prefill" not in details and "top_tokens" not in details


@pytest.mark.parametrize(
    "variant",
    [
        {},
        # The Accelerate guide's starter config.
        {
            "engine": "Python",
            "option.rolling_batch": "scheduler",
            "option.paged_attention": "false",
        },
        # The vLLM guide's; 24 blocks of 16 tokens: far less than 8 running requests need.
        {"engine": "Python", "option.rolling_batch": "vllm", "option.num_kv_blocks": 24},
    ],
    ids=["paged", "contiguous-accelerate-starter", "preempting-vllm-starter"],
)
def test_concurrent_greedy_requests_match_hf(tmp_path, workload, variant):
    server = serve(tmp_path, **variant)
    try:
        check_answers(fire(server, workload), workload)
        stats = engine_stats(server)
        check_structured_outputs(server)
    finally:
        assert server.stop() == 0
    assert stats["num_steps_with_joins"] > 0, "no request joined a running batch"
    assert stats["num_steps_with_leaves"] > 0, "no request left while others kept running"
    assert stats["kv_blocks_used"] == 0 and stats["num_running"] == 0
    if "option.num_kv_blocks" in variant:
        assert stats["num_preemptions"] > 0
    assert stats["finished"].get("length", 0) + stats["finished"].get("eos_token", 0) == 24
    if variant.get("engine") == "Python":
        assert (
            f"engine=Python with option.rolling_batch={variant['option.rolling_batch']}: serving"
            " with lmserve's rolling batch over MPI ranks (tensor_parallel_degree=2)"
        ) in server.log_path.read_text()
