"""LoRA over HTTP, through a real `lmserve serve` at TP=2 (mpiexec ranks): requests naming
adapters (LMI's `adapters`, OpenAI's `model`) answered as HF + PEFT answers them while they
share steps with each other and the base model, unknown adapters refused by name, and the
management API's round trip: list, register from a folder and from S3 (the test's own S3
server), use, unregister while a request still uses the adapter."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
from transformers import AutoTokenizer

from ..container.s3_server import s3, s3_server, upload_folder  # noqa: F401
from ..hf_reference import assert_same_or_near_tie, hf_greedy_alone
from ..lora_adapters import TINY_ADAPTERS, peft_model, save_adapter, tiny_model_with_adapters
from ..servers import Server, write_properties

MAX_NEW_TOKENS = 10
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Dear hiring manager,"]
LATE = (["q_proj", "k_proj", "down_proj"], 4, 8, False)  # adapters registered while serving


@pytest.fixture(scope="module")
def model_dir(smollm2_dir, tmp_path_factory):
    return tiny_model_with_adapters(tmp_path_factory.mktemp("lora-server"), smollm2_dir)


@pytest.fixture(scope="module")
def late_adapters(model_dir, tmp_path_factory):
    """Adapters made outside the model dir, for the management API."""
    root = tmp_path_factory.mktemp("late-adapters")
    return {
        name: save_adapter(model_dir, name, *LATE, seed=seed, folder=root / name)
        for seed, name in ((11, "late"), (12, "from-s3"))
    }


@pytest.fixture(scope="module")
def reference(model_dir, late_adapters):
    """{(prompt, adapter): (HF + PEFT's greedy tokens, their logits)}."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    expected = {}
    for adapter in [None, *TINY_ADAPTERS, *late_adapters]:
        model = peft_model(model_dir, adapter, folder=late_adapters.get(adapter))
        for prompt in PROMPTS:
            ids = tokenizer(prompt)["input_ids"]
            expected[prompt, adapter] = hf_greedy_alone(model, ids, MAX_NEW_TOKENS)
    return expected


@pytest.fixture(scope="module")
def server(model_dir, s3_server, tmp_path_factory):  # noqa: F811
    properties = {
        "option.model_id": model_dir,
        "option.tensor_parallel_degree": 2,
        "option.max_model_len": 512,
        "option.dtype": "fp32",  # as HF's reference (auto may pick bf16 where it is native)
        "option.enable_lora": "true",
        "option.max_loras": 3,
        "option.max_cpu_loras": 3,  # fewer than the five adapters served: some are reread
    }
    folder = write_properties(tmp_path_factory.mktemp("lora") / "model", properties)
    cache = tmp_path_factory.mktemp("lora-cache")
    server = Server(folder, env={**s3_server.env(), "LMSERVE_CACHE_DIR": str(cache)})
    server.model_dir = folder  # where serving.properties is: relative srcs are read from here
    server.wait_healthy()
    yield server
    assert server.stop() == 0


def served_name(server) -> str:
    return requests.get(f"{server.url}/v1/models", timeout=30).json()["data"][0]["id"]


def generate(server, prompt, adapter, max_new_tokens=MAX_NEW_TOKENS, **extra) -> requests.Response:
    body = {
        "inputs": prompt,
        "parameters": {"max_new_tokens": max_new_tokens, "details": True},
        **extra,
    }
    if adapter is not None:
        body["adapters"] = adapter
    return requests.post(f"{server.url}/invocations", json=body, timeout=120)


def token_ids(answer: dict) -> list[int]:
    return [token["id"] for token in answer["details"]["tokens"]]


def assert_answers(server, reference, adapters):
    """Every prompt with every adapter, sent at once so that they share steps."""
    pairs = [(prompt, adapter) for prompt in PROMPTS for adapter in adapters]
    with ThreadPoolExecutor(len(pairs)) as pool:
        responses = list(pool.map(lambda pair: generate(server, *pair), pairs))
    for (prompt, adapter), response in zip(pairs, responses):
        assert response.status_code == 200, response.text
        expected, logits = reference[prompt, adapter]
        assert_same_or_near_tie(token_ids(response.json()), expected, logits)


def test_adapters_and_base_model_in_the_same_steps_match_peft(server, reference):
    assert_answers(server, reference, [None, *TINY_ADAPTERS])


def test_a_list_of_inputs_with_one_adapter_each(server, reference):
    adapters = ["attn", None, "mlp-rs"]
    body = {
        "inputs": PROMPTS,
        "adapters": adapters,
        "parameters": {"max_new_tokens": MAX_NEW_TOKENS, "details": True},
    }
    response = requests.post(f"{server.url}/invocations", json=body, timeout=120)
    assert response.status_code == 200, response.text
    for prompt, adapter, answer in zip(PROMPTS, adapters, response.json()):
        expected, logits = reference[prompt, adapter]
        assert_same_or_near_tie(token_ids(answer), expected, logits)


def test_openai_model_names_the_adapter(server):
    def completion(model):
        body = {"model": model, "prompt": PROMPTS[0], "max_tokens": MAX_NEW_TOKENS}
        response = requests.post(f"{server.url}/v1/completions", json={**body, "temperature": 0})
        assert response.status_code == 200, response.text
        return response.json()["choices"][0]["text"]

    lmi = generate(server, PROMPTS[0], "everything").json()["generated_text"]
    assert completion("everything") == lmi
    base = completion(served_name(server))
    assert base == generate(server, PROMPTS[0], None).json()["generated_text"]
    assert base != lmi


def test_unknown_adapters_are_refused_by_name(server):
    response = generate(server, PROMPTS[0], "nope")
    assert response.status_code == 404
    assert "'nope'" in response.json()["message"] and "attn" in response.json()["message"]
    chat = {"model": "nope", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    response = requests.post(f"{server.url}/v1/chat/completions", json=chat, timeout=60)
    assert response.status_code == 404
    assert "'nope'" in response.json()["error"]["message"]
    response = generate(server, PROMPTS[0], ["attn"])  # a list for one input
    assert response.status_code == 400
    assert response.json()["message"].startswith("adapters:")


def test_management_api_round_trip(server, reference, late_adapters):
    adapters_url = f"{server.url}/models/{served_name(server)}/adapters"
    listed = requests.get(adapters_url, timeout=30).json()["adapters"]
    assert [a["name"] for a in listed] == list(TINY_ADAPTERS)
    late = str(late_adapters["late"])
    response = requests.post(adapters_url, params={"name": "late", "src": late}, timeout=60)
    assert response.status_code == 200, response.text
    assert response.json()["adapter"] == {"name": "late", "src": late}
    assert requests.get(f"{adapters_url}/late", timeout=30).json() == {"name": "late", "src": late}
    assert_answers(server, reference, ["late", "attn"])  # rank 1 has it too (TP=2)
    again = requests.post(adapters_url, json={"name": "late", "src": late}, timeout=60)
    assert again.status_code == 409

    # Unregistered while a request uses it: that request finishes with it, new ones are refused.
    # As long as the context allows, so that it still runs when it is seen running, however
    # fast the machine (the deletion then happens while it runs).
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(generate, server, PROMPTS[1], "late", 480, stream=False)
        _wait_until_running(server, running)
        assert not running.done(), "480 steps ended before the engine was seen running them"
        deleted = requests.delete(f"{adapters_url}/late", timeout=30)
        assert deleted.status_code == 200, deleted.text
        assert generate(server, PROMPTS[0], "late").status_code == 404
        finished = running.result(timeout=300)
    assert finished.status_code == 200, finished.text
    tokens = token_ids(finished.json())
    assert tokens[:MAX_NEW_TOKENS] == reference[PROMPTS[1], "late"][0]
    assert requests.get(f"{adapters_url}/late", timeout=30).status_code == 404
    names = [a["name"] for a in requests.get(adapters_url, timeout=30).json()["adapters"]]
    assert names == list(TINY_ADAPTERS)


def test_register_from_s3(server, reference, late_adapters, s3):  # noqa: F811
    s3.create_bucket(Bucket="adapters")
    upload_folder(s3, late_adapters["from-s3"], "adapters", "lora/from-s3")
    adapters_url = f"{server.url}/models/{served_name(server)}/adapters"
    src = "s3://adapters/lora/from-s3"
    response = requests.post(adapters_url, params={"name": "from-s3", "src": src}, timeout=120)
    assert response.status_code == 200, response.text
    assert_answers(server, reference, ["from-s3"])
    missing = requests.post(
        adapters_url, params={"name": "gone", "src": "s3://adapters/none"}, timeout=120
    )
    assert missing.status_code == 400
    assert "src='s3://adapters/none'" in missing.json()["message"]
    assert requests.delete(f"{adapters_url}/from-s3", timeout=30).status_code == 200


def test_an_adapter_that_cannot_be_served_is_refused_at_registration(server, model_dir, tmp_path):
    folder = save_adapter(
        model_dir, "big", ["q_proj"], 32, 8, False, seed=5, folder=tmp_path / "big"
    )  # rank 32 > max_lora_rank 16
    adapters_url = f"{server.url}/models/{served_name(server)}/adapters"
    response = requests.post(adapters_url, params={"name": "big", "src": str(folder)}, timeout=60)
    assert response.status_code == 400
    message = response.json()["message"]
    assert "'big'" in message and "max_lora_rank=16" in message


def _wait_until_running(server, request, timeout: float = 60.0) -> None:
    """Until the engine runs a request (or `request`, a future, is already answered: then the
    checks after it hold all the same). `timeout`: a hang guard."""
    model_url = f"{server.url}/models/{served_name(server)}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not request.done():
        stats = requests.get(model_url, timeout=30).json()["engine"]["stats"]
        if stats and stats.get("num_running", 0) > 0:
            return
        time.sleep(0.02)
    assert request.done(), "the request never started running"


def adapter_metrics(server) -> dict[tuple[str, str], float]:
    """{(metric, adapter): value} of the per-adapter counters on /metrics."""
    text = requests.get(f"{server.url}/metrics", timeout=30).text
    found = {}
    for line in text.splitlines():
        if line.startswith(("lmserve_adapter_requests_total", "lmserve_adapter_tokens_total")):
            name, value = line.rsplit(" ", 1)
            found[name.split("{")[0], name.split('adapter="')[1].split('"')[0]] = float(value)
    return found


def metric_changes(before: dict, after: dict) -> dict:
    return {
        key: value - before.get(key, 0) for key, value in after.items() if value != before.get(key)
    }


def test_metrics_count_requests_and_tokens_per_adapter(server):
    before = adapter_metrics(server)
    response = generate(server, PROMPTS[0], "mlp-rs")
    assert response.status_code == 200
    assert metric_changes(before, adapter_metrics(server)) == {
        ("lmserve_adapter_requests_total", "mlp-rs"): 1,
        ("lmserve_adapter_tokens_total", "mlp-rs"): len(token_ids(response.json())),
    }


def test_a_relative_src_is_read_from_the_model_dir(server, model_dir):
    save_adapter(
        model_dir, "near", ["v_proj"], 4, 8, False, seed=7, folder=server.model_dir / "extra"
    )
    adapters_url = f"{server.url}/models/{served_name(server)}/adapters"
    response = requests.post(adapters_url, json={"name": "near", "src": "extra"}, timeout=60)
    assert response.status_code == 200, response.text
    assert response.json()["adapter"] == {"name": "near", "src": "extra"}
    assert generate(server, PROMPTS[0], "near").status_code == 200
    assert requests.delete(f"{adapters_url}/near", timeout=30).status_code == 200
    missing = requests.post(adapters_url, json={"name": "far", "src": "nowhere"}, timeout=60)
    assert missing.status_code == 400 and "src='nowhere'" in missing.json()["message"]


# Long enough for full KV blocks (16 tokens each), which the prefix cache shares.
LONG_PROMPT = "The history of the old harbour town, told by the people who lived there: " * 4
# Strong enough that two random draws of it answer LONG_PROMPT differently.
SWAPPED = (["q_proj", "k_proj", "v_proj", "down_proj"], 8, 64, False)


def prefix_hits(server) -> int:
    stats = requests.get(f"{server.url}/models/{served_name(server)}", timeout=30).json()
    return stats["engine"]["stats"]["prefix_cache_hit_tokens"]


def test_an_adapter_registered_again_with_other_weights_gets_no_stale_cache(
    server, model_dir, tmp_path
):
    """DELETE, then POST the same name with other weights: a prompt the old weights left in
    the prefix cache is computed again, and the answer is the new adapter's (HF + PEFT)."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ids = tokenizer(LONG_PROMPT)["input_ids"]
    assert len(ids) > 3 * 16
    folders = {
        seed: save_adapter(model_dir, "swap", *SWAPPED, seed=seed, folder=tmp_path / str(seed))
        for seed in (21, 22)
    }
    expected = {
        seed: hf_greedy_alone(peft_model(model_dir, "swap", folder=folder), ids, MAX_NEW_TOKENS)
        for seed, folder in folders.items()
    }
    assert expected[21][0] != expected[22][0]  # the two adapters say different things
    adapters_url = f"{server.url}/models/{served_name(server)}/adapters"
    for seed, folder in folders.items():
        registered = requests.post(
            adapters_url, json={"name": "swap", "src": str(folder)}, timeout=60
        )
        assert registered.status_code == 200, registered.text
        hits_before = prefix_hits(server)
        for attempt in range(2):  # the second time, its own blocks are cached
            response = generate(server, LONG_PROMPT, "swap")
            assert response.status_code == 200, response.text
            assert_same_or_near_tie(token_ids(response.json()), *expected[seed])
            if attempt == 0:
                assert prefix_hits(server) == hits_before, "K/V of other weights reused"
        assert prefix_hits(server) > hits_before
        assert requests.delete(f"{adapters_url}/swap", timeout=30).status_code == 200
