"""Speculative decoding (n-gram drafts) end to end: SmolLM2 in fp32 over real HTTP on two MPI
ranks, `option.speculative_draft_model=[ngram]`. Concurrent greedy requests, streamed and not,
are answered with HF's greedy tokens while the engine keeps drafted tokens (its metrics say how
many); the stream carries the same tokens and text; stop sequences still cut the text; a
sampled request is served beside them."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from ..hf_reference import VARIED_PROMPTS, assert_same_or_near_tie, hf_greedy_alone
from ..servers import Server, write_properties

MAX_NEW_TOKENS = 48
# Prompts whose answers repeat themselves (lists, code) and the varied ones.
PROMPTS = [
    "List the days of the week: Monday,",
    "Count from one to twenty: one, two, three,",
    *VARIED_PROMPTS[:6],
]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    properties = {
        "engine": "MPI",
        "option.tensor_parallel_degree": 2,
        "option.dtype": "fp32",
        "option.max_model_len": 256,
        "option.speculative_draft_model": "[ngram]",
        "option.speculative_length": 4,
    }
    server = Server(write_properties(tmp_path_factory.mktemp("speculation"), properties))
    server.wait_healthy()
    yield server
    assert server.stop() == 0


def post(server, prompt: str, stream: bool = False, **parameters) -> requests.Response:
    body = {"inputs": prompt, "parameters": {"details": True, **parameters}, "stream": stream}
    answer = requests.post(f"{server.url}/invocations", json=body, timeout=600, stream=stream)
    assert answer.status_code == 200, answer.text
    return answer


def spec_metrics(server) -> dict[str, float]:
    values = {}
    for line in requests.get(f"{server.url}/metrics", timeout=10).text.splitlines():
        if line.startswith("lmserve_spec_"):
            name, value = line.rsplit(" ", 1)
            values[name.split("{")[0]] = float(value)
    return values


def test_greedy_answers_equal_hf_while_drafts_are_kept(server, smollm2_dir):
    def ask(prompt):
        answer = post(server, prompt, max_new_tokens=MAX_NEW_TOKENS).json()
        return [token["id"] for token in answer["details"]["tokens"]]

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        served = list(pool.map(ask, PROMPTS))
    metrics = spec_metrics(server)
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    for prompt, tokens in zip(PROMPTS, served):
        expected, logits = hf_greedy_alone(model, tokenizer(prompt)["input_ids"], MAX_NEW_TOKENS)
        assert_same_or_near_tie(tokens, expected, logits)
    drafted = metrics["lmserve_spec_draft_tokens_total"]
    accepted = metrics["lmserve_spec_accepted_tokens_total"]
    assert 0 < accepted < drafted


def test_the_stream_carries_the_same_tokens_and_stop_sequences_cut_it(server):
    prompt = PROMPTS[0]
    whole = post(server, prompt, max_new_tokens=40).json()
    events = [
        json.loads(line)
        for line in post(server, prompt, True, max_new_tokens=40).iter_lines()
        if line
    ]
    assert [e["token"]["id"] for e in events] == [t["id"] for t in whole["details"]["tokens"]]
    assert "".join(e["token"]["text"] for e in events) == whole["generated_text"]
    stop = whole["generated_text"].split()[3]
    cut = whole["generated_text"][: whole["generated_text"].find(stop)]
    stopped = post(server, prompt, max_new_tokens=40, stop_sequences=[stop]).json()
    assert stopped["generated_text"] == cut
    assert stopped["details"]["finish_reason"] == "stop_sequence"


def test_sampled_requests_are_served_beside_speculating_ones(server):
    def ask(parameters):
        return post(server, PROMPTS[1], max_new_tokens=24, **parameters).json()

    sampled = {"do_sample": True, "temperature": 0.8, "seed": 7}
    with ThreadPoolExecutor(3) as pool:
        first, greedy, again = pool.map(ask, [sampled, {}, sampled])
    assert first["generated_text"] == again["generated_text"]  # the seed repeats the text
    assert len(greedy["details"]["tokens"]) == 24
