"""Prefix caching end to end, SmolLM2 in fp32 over real HTTP: requests sharing a system prompt,
and a conversation's next turns resending its history, answered with HF's greedy tokens while
the engine reuses the cached blocks of their shared prefixes (its metrics say how many tokens);
with one rank and with two (rank 0's block tables reach both), and with a KV pool small
enough that requests are preempted and cached blocks evicted."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from ..hf_reference import assert_same_or_near_tie, hf_greedy_alone
from ..servers import Server, write_properties

SYSTEM = (
    "You are a careful assistant for a small bakery in Lyon. You answer questions about"
    " opening hours, bread, pastries and cakes, in one or two short sentences, politely,"
    " and you never invent prices that are not on the menu.\n"
)
# Long enough (over 128 tokens) that decodes sharing it are scored together (cascade).
MENU_SYSTEM = SYSTEM + (
    "The menu: baguette, pain de campagne, rye bread with walnuts, brioche, croissants (plain,"
    " almond, chocolate), pain au raisin, chausson aux pommes, tarte aux fraises in summer,"
    " tarte au citron, eclairs (coffee, chocolate), paris-brest, praluline on Saturdays,"
    " galette des rois in January. Opening hours: Tuesday to Saturday from seven to seven,"
    " Sunday from seven to one, closed on Monday. Birthday cakes are ordered three days"
    " ahead by phone or in the shop. Every bread is baked on site each morning from five.\n"
)
QUESTIONS = [
    "When do you open on Sunday?",
    "Do you sell croissants?",
    "What is your best cake?",
    "Can I order a birthday cake?",
    "Is the baguette made every morning?",
    "Do you have gluten-free bread?",
]
MAX_NEW_TOKENS = 12


@pytest.fixture(scope="module")
def hf(smollm2_dir):
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(smollm2_dir)


def conversation_prompts(system: str) -> list[str]:
    """Three turns of one conversation, each resending the history before it."""
    history = system
    prompts = []
    for question in QUESTIONS[:3]:
        history += f"User: {question}\nAssistant:"
        prompts.append(history)
        history += " Yes, of course.\n"
    return prompts


def prefix_metrics(server: Server) -> tuple[float, float]:
    values = {}
    for line in requests.get(f"{server.url}/metrics", timeout=10).text.splitlines():
        if line.startswith("lmserve_prefix_cache"):
            name, value = line.rsplit(" ", 1)
            values[name.split("{")[0]] = float(value)
    return (
        values["lmserve_prefix_cache_query_tokens_total"],
        values["lmserve_prefix_cache_hit_tokens_total"],
    )


def ask_all(server: Server, prompts: list[str]) -> list[list[int]]:
    def ask(prompt):
        parameters = {"max_new_tokens": MAX_NEW_TOKENS, "details": True}
        body = {"inputs": prompt, "parameters": parameters}
        answer = requests.post(f"{server.url}/invocations", json=body, timeout=600)
        assert answer.status_code == 200, answer.text
        return [token["id"] for token in answer.json()["details"]["tokens"]]

    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(ask, prompts))


@pytest.mark.parametrize(
    ("system", "options"),
    [
        (MENU_SYSTEM, {"option.tensor_parallel_degree": 1}),
        # Two ranks, and a pool of 8 blocks of 16 tokens for up to 4 requests of ~60-110
        # tokens: preemptions, and cached blocks evicted to make room.
        (
            SYSTEM,
            {
                "option.tensor_parallel_degree": 2,
                "option.num_kv_blocks": 8,
                "option.max_rolling_batch_size": 4,
            },
        ),
    ],
    ids=["one-rank", "two-ranks-tight-pool"],
)
def test_shared_prefixes_are_reused_and_answers_equal_hf(tmp_path, hf, system, options):
    properties = {
        "engine": "MPI",
        "option.dtype": "fp32",
        "option.max_model_len": 256,
        "option.max_rolling_batch_size": 8,
        **options,
    }
    server = Server(write_properties(tmp_path / "model", properties))
    server.wait_healthy()
    try:
        model, tokenizer = hf
        system_turns = [system + f"User: {q}\nAssistant:" for q in QUESTIONS]
        # The first request computes the system prompt; the rest, concurrent, reuse it.
        served = ask_all(server, system_turns[:1]) + ask_all(server, system_turns[1:])
        served += [
            tokens
            for prompt in conversation_prompts(system)
            for tokens in ask_all(server, [prompt])
        ]
        queried, hit = prefix_metrics(server)
        name = requests.get(f"{server.url}/models", timeout=10).json()["models"][0]["modelName"]
        stats = requests.get(f"{server.url}/models/{name}", timeout=10).json()["engine"]["stats"]
    finally:
        assert server.stop() == 0
    for prompt, tokens in zip(system_turns + conversation_prompts(system), served):
        expected, logits = hf_greedy_alone(model, tokenizer(prompt)["input_ids"], MAX_NEW_TOKENS)
        assert_same_or_near_tie(tokens, expected, logits)
    system_blocks = len(tokenizer(system)["input_ids"]) // 16
    # At least the system prompt's full blocks for each of the 5 later system turns and the
    # conversation's turns, however the concurrent ones met in the batch.
    assert hit >= 5 * system_blocks * 16
    assert 0 < hit < queried
    assert stats["kv_blocks_used"] == 0 and stats["prefix_cached_blocks"] > 0
    if "option.num_kv_blocks" in options:  # preempted requests came back through the cache
        assert stats["num_preemptions"] > 0
