"""HTTP on the rolling engine: the stream's text equals the non-streamed text, SSE and
jsonlines parse, stop sequences end the stream without their text, seeded sampling repeats, a
client that disconnects mid-stream frees its KV blocks at once, and OpenAI chat (plain and
streamed) answers like HF's own chat template and greedy generate. The server names no engine:
LMI's default (option.rolling_batch=auto) serves, as `make serve` does."""

from __future__ import annotations

import json
import time

import pytest
import requests

from ..servers import Server, command_line, descendants, write_properties

PROMPT = "Once upon a time, in a small village by the sea, there lived"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = write_properties(
        tmp_path_factory.mktemp("rolling-stream"),
        {  # no engine and no option.rolling_batch: the default is under test too
            "option.max_rolling_batch_size": 4,
            "option.max_model_len": 512,
            "option.dtype": "fp32",  # chat answers are compared with HF's fp32 greedy output
        },
    )
    server = Server(folder)
    server.wait_healthy()
    yield server
    assert server.stop() == 0


def test_no_engine_configured_serves_the_rolling_batch_over_mpi_ranks(server):
    start_up = server.log_path.read_text()  # the whole log: server.log() is only its tail
    assert "no engine configured: serving with lmserve's rolling batch over MPI ranks" in start_up
    assert "engine=MPI (rolling_batch=auto)" in start_up
    workers = [command_line(pid) for pid in descendants(server.process.pid)]
    assert any("lmserve.rolling_batch.engine.process" in command for command in workers)
    assert not any("lmserve.handlers.python_engine.process" in command for command in workers)


def generate(server, parameters, **extra) -> requests.Response:
    body = {"inputs": PROMPT, "parameters": parameters, **extra}
    return requests.post(f"{server.url}/invocations", json=body, timeout=120, **_stream_opts(extra))


def _stream_opts(extra):
    return {"stream": True} if extra.get("stream") else {}


def jsonlines(response) -> list[dict]:
    return [json.loads(line) for line in response.iter_lines() if line]


def sse(response) -> list[dict]:
    events = []
    for line in response.iter_lines():
        if line:
            assert line.startswith(b"data: "), line
            events.append(json.loads(line[len(b"data: ") :]))
    return events


def test_stream_equals_the_non_streamed_text(server):
    parameters = {"max_new_tokens": 40, "details": True}
    whole = generate(server, parameters).json()
    streamed = generate(server, parameters, stream=True)
    assert streamed.headers["content-type"].startswith("application/jsonlines")
    events = jsonlines(streamed)
    assert len(events) > 5  # a real answer, not an immediate EOS
    assert "".join(e["token"]["text"] for e in events) == whole["generated_text"]
    assert events[-1]["generated_text"] == whole["generated_text"]
    assert [e["token"]["id"] for e in events] == [t["id"] for t in whole["details"]["tokens"]]
    assert all("generated_text" not in e for e in events[:-1])


def test_sse_when_the_client_accepts_event_streams(server):
    response = requests.post(
        f"{server.url}/invocations",
        json={
            "inputs": PROMPT,
            "parameters": {"max_new_tokens": 12, "ignore_eos_token": True},
            "stream": True,
        },
        headers={"Accept": "text/event-stream"},
        stream=True,
        timeout=120,
    )
    assert response.headers["content-type"].startswith("text/event-stream")
    events = sse(response)
    assert len(events) == 12
    assert events[-1]["generated_text"] == "".join(e["token"]["text"] for e in events)


def test_stop_sequence_ends_the_stream_without_its_text(server):
    whole = generate(server, {"max_new_tokens": 60})
    text = whole.json()["generated_text"]
    stop = text.split()[3]  # a word from the middle of the greedy answer
    cut = text[: text.find(stop)]
    plain = generate(server, {"max_new_tokens": 60, "stop_sequences": [stop], "details": True})
    assert plain.json()["generated_text"] == cut
    assert plain.json()["details"]["finish_reason"] == "stop_sequence"
    events = jsonlines(
        generate(server, {"max_new_tokens": 60, "stop_sequences": [stop]}, stream=True)
    )
    assert "".join(e["token"]["text"] for e in events) == cut == events[-1]["generated_text"]


def test_same_seed_same_text_and_sampling_varies(server):
    sampled = {"max_new_tokens": 20, "do_sample": True, "temperature": 1.2, "top_p": 0.95}
    first = generate(server, {**sampled, "seed": 11}).json()["generated_text"]
    again = generate(server, {**sampled, "seed": 11}).json()["generated_text"]
    others = {generate(server, {**sampled, "seed": s}).json()["generated_text"] for s in range(4)}
    assert first == again
    assert len(others) > 1


def metrics(server) -> dict[str, float]:
    values = {}
    for line in requests.get(f"{server.url}/metrics", timeout=10).text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    return values


def test_disconnect_mid_stream_frees_the_blocks(server):
    """The client goes away 3 tokens into a 480-token stream: the request is aborted (not run
    to its end) and its blocks are freed. The close follows the third line at once: hundreds
    of steps before the generation could end, on any machine."""
    label = '{model="SmolLM2-135M-Instruct"}'
    tokens, blocks, aborts = (
        f"lmserve_tokens_generated_total{label}",
        f"lmserve_kv_blocks_used{label}",
        'lmserve_engine_requests_finished_total{model="SmolLM2-135M-Instruct",reason="abort"}',
    )
    before = metrics(server)
    max_new = 480
    response = generate(server, {"max_new_tokens": max_new, "ignore_eos_token": True}, stream=True)
    lines = response.iter_lines()
    for _ in range(3):
        next(lines)
    response.close()  # the client goes away
    deadline = time.monotonic() + 60  # only against a hang: what counts is asserted below
    while True:
        values = metrics(server)
        if values[aborts] == before.get(aborts, 0) + 1 and values[blocks] == 0:
            break
        assert time.monotonic() < deadline, "the aborted request kept its blocks"
        time.sleep(0.1)
    assert values[f"lmserve_num_running{label}"] == 0
    assert values[tokens] - before.get(tokens, 0) < max_new  # dropped, not run to its end


CHAT = [
    {"role": "system", "content": "You answer in one short sentence."},
    {"role": "user", "content": "What is the capital of Italy?"},
]


def hf_chat_answer(smollm2_dir, max_new_tokens: int) -> tuple[str, int]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    ids = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, return_dict=True)[
        "input_ids"
    ]
    with torch.inference_mode():
        out = model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False)
    return tokenizer.decode(out[0, len(ids) :], skip_special_tokens=True), len(ids)


def test_chat_completion_equals_hf_chat_template_and_greedy(server, smollm2_dir):
    expected, num_prompt_tokens = hf_chat_answer(smollm2_dir, 24)
    body = {"model": "x", "messages": CHAT, "max_tokens": 24, "temperature": 0}
    answer = requests.post(f"{server.url}/v1/chat/completions", json=body, timeout=120).json()
    assert answer["object"] == "chat.completion"
    assert answer["choices"][0]["message"] == {"role": "assistant", "content": expected}
    assert answer["choices"][0]["finish_reason"] in ("stop", "length")
    usage = answer["usage"]
    assert usage["prompt_tokens"] == num_prompt_tokens
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    # DJL reads any body with `messages` as chat, on /invocations too.
    again = requests.post(f"{server.url}/invocations", json=body, timeout=120).json()
    assert again["choices"][0]["message"]["content"] == expected


def test_streamed_chat_chunks_add_up_to_the_answer(server):
    body = {"messages": CHAT, "max_tokens": 24, "temperature": 0}
    whole = requests.post(f"{server.url}/v1/chat/completions", json=body, timeout=120).json()
    streamed = {**body, "stream": True, "stream_options": {"include_usage": True}}
    response = requests.post(
        f"{server.url}/v1/chat/completions", json=streamed, stream=True, timeout=120
    )
    assert response.headers["content-type"].startswith("text/event-stream")
    payloads = [line[len(b"data: ") :] for line in response.iter_lines() if line]
    assert payloads[-1] == b"[DONE]"
    *chunks, usage = [json.loads(p) for p in payloads[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    content = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert content == whole["choices"][0]["message"]["content"]
    assert chunks[-1]["choices"][0]["finish_reason"] == whole["choices"][0]["finish_reason"]
    # stream_options.include_usage: OpenAI's last chunk, no choices, the usage
    assert usage["choices"] == [] and usage["usage"] == whole["usage"]


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
        ({"messages": CHAT, "n": 17}, "n"),
        ({"messages": CHAT, "temperature": 3}, "temperature"),
        ({"messages": CHAT, "max_tokens": 0}, "max_tokens"),
    ],
)
def test_bad_chat_requests_are_400_naming_the_field(server, body, field):
    response = requests.post(f"{server.url}/v1/chat/completions", json=body, timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()["error"]  # OpenAI's shape on OpenAI routes
    assert (error["param"], error["type"], error["code"]) == (field, "invalid_request_error", 400)
    assert field in error["message"]


# --- the OpenAI SDK as the client -------------------------------------------------------------


@pytest.fixture(scope="module")
def openai_client(server):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def test_openai_models_lists_the_served_model(server, openai_client):
    name = requests.get(f"{server.url}/models", timeout=10).json()["models"][0]["modelName"]
    assert [model.id for model in openai_client.models.list()] == [name]


def test_openai_completion_equals_the_greedy_invocation(server, openai_client):
    expected = generate(server, {"max_new_tokens": 16}).json()["generated_text"]
    answer = openai_client.completions.create(
        model="m", prompt=PROMPT, max_tokens=16, temperature=0
    )
    assert answer.object == "text_completion"
    assert answer.choices[0].text == expected
    assert answer.choices[0].finish_reason == "length"
    assert answer.usage.completion_tokens == 16
    streamed = openai_client.completions.create(
        model="m", prompt=PROMPT, max_tokens=16, temperature=0, stream=True
    )
    assert "".join(chunk.choices[0].text for chunk in streamed) == expected


def test_openai_ignore_eos_generates_max_tokens_past_the_end_of_the_answer(server):
    """vLLM's `ignore_eos`, as benchmarks send it: a short chat answer ends at its EOS without
    it and runs to `max_tokens` with it."""
    body = {"messages": CHAT, "max_tokens": 200, "temperature": 0}
    url = f"{server.url}/v1/chat/completions"
    answer = requests.post(url, json=body, timeout=120).json()
    assert answer["choices"][0]["finish_reason"] == "stop"
    assert answer["usage"]["completion_tokens"] < 200
    forced = requests.post(url, json={**body, "ignore_eos": True}, timeout=120).json()
    assert forced["choices"][0]["finish_reason"] == "length"
    assert forced["usage"]["completion_tokens"] == 200
    assert forced["choices"][0]["message"]["content"].startswith(
        answer["choices"][0]["message"]["content"]
    )


def test_openai_completion_lists_echo_and_logprobs(server, openai_client, smollm2_dir):
    from transformers import AutoTokenizer

    answer = openai_client.completions.create(
        model="m", prompt=[PROMPT, "The capital of France is"], max_tokens=5, temperature=0,
        echo=True, logprobs=1,
    )  # fmt: skip
    assert [choice.index for choice in answer.choices] == [0, 1]
    first = answer.choices[0]
    assert first.text.startswith(PROMPT)
    # echo: the prompt's tokens first (the first without a log-prob), then the 5 generated.
    num_prompt = len(AutoTokenizer.from_pretrained(smollm2_dir)(PROMPT)["input_ids"])
    logprobs = first.logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == num_prompt + 5
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    assert all(lp <= 0 for lp in logprobs.token_logprobs[1:])
    assert "".join(logprobs.tokens) == first.text and logprobs.text_offset[0] == 0
    # The most likely token is greedy's choice: each generated token tops its alternatives.
    for token, top in zip(logprobs.tokens[num_prompt:], logprobs.top_logprobs[num_prompt:]):
        assert max(top, key=top.get) == token
    assert answer.usage.completion_tokens == 10


def test_openai_errors_reach_the_sdk_as_openai_errors(openai_client):
    openai = pytest.importorskip("openai")
    with pytest.raises(openai.BadRequestError) as refused:
        openai_client.completions.create(model="m", prompt=PROMPT, logprobs=21)
    assert refused.value.param == "logprobs" and refused.value.status_code == 400
    with pytest.raises(openai.BadRequestError) as too_long:
        openai_client.completions.create(model="m", prompt=PROMPT, max_tokens=100000)
    assert too_long.value.param == "max_tokens"


def test_openai_chat_through_the_sdk(server, openai_client):
    body = {"messages": CHAT, "max_tokens": 12, "temperature": 0}
    expected = requests.post(f"{server.url}/v1/chat/completions", json=body, timeout=120).json()
    answer = openai_client.chat.completions.create(
        model="m", messages=CHAT, max_tokens=12, temperature=0
    )
    assert answer.choices[0].message.content == expected["choices"][0]["message"]["content"]
    stream = openai_client.chat.completions.create(
        model="m", messages=CHAT, max_tokens=12, temperature=0, stream=True
    )
    pieces = [chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices]
    assert "".join(pieces) == answer.choices[0].message.content


# --- log-probs and several sequences from the real engine --------------------------------------

LOG_PROB_TOLERANCE = 5e-3  # fp32 both sides; logits of ~20 agree to ~1e-4 relative


@pytest.fixture(scope="module")
def hf(smollm2_dir):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(smollm2_dir)


def hf_log_probs(model, token_ids: list[int]):
    """HF's log-softmax after each position of `token_ids`."""
    import torch

    with torch.inference_mode():
        return torch.log_softmax(model(torch.tensor([token_ids])).logits[0].float(), dim=-1)


def assert_top_alternatives(top: dict[int, float], row) -> None:
    """`top` holds HF's log-probs of its tokens, and they are HF's most likely ones (up to
    ties within the tolerance)."""
    for token, log_prob in top.items():
        assert log_prob == pytest.approx(float(row[token]), abs=LOG_PROB_TOLERANCE)
    kth_best = float(row.topk(len(top)).values[-1])
    assert min(top.values()) >= kth_best - LOG_PROB_TOLERANCE


def test_openai_chat_logprobs_equal_hf(server, openai_client, hf):
    model, tokenizer = hf
    answer = openai_client.chat.completions.create(
        model="m", messages=CHAT, max_tokens=8, temperature=0, logprobs=True, top_logprobs=3
    )
    content = answer.choices[0].logprobs.content
    prompt_ids = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, return_dict=True)
    generated = tokenizer(answer.choices[0].message.content, add_special_tokens=False)
    ids = prompt_ids["input_ids"] + generated["input_ids"][: len(content)]
    rows = hf_log_probs(model, ids)[len(prompt_ids["input_ids"]) - 1 :]
    assert len(content) == 8 and "".join(e.token for e in content).startswith(
        answer.choices[0].message.content[:5]
    )
    for entry, row in zip(content, rows):
        by_id = {tokenizer.convert_tokens_to_ids(tokenizer.tokenize(alt.token))[0]: alt.logprob
                 for alt in entry.top_logprobs}  # fmt: skip
        assert len(entry.top_logprobs) == 3
        assert entry.logprob == pytest.approx(float(row.max()), abs=LOG_PROB_TOLERANCE)
        assert_top_alternatives(by_id, row)


def test_decoder_input_details_and_top_n_tokens_equal_hf(server, hf):
    model, tokenizer = hf
    parameters = {"max_new_tokens": 4, "decoder_input_details": True, "top_n_tokens": 2}
    details = generate(server, parameters).json()["details"]
    prompt_ids = tokenizer(PROMPT)["input_ids"]
    generated = [token["id"] for token in details["tokens"]]
    rows = hf_log_probs(model, prompt_ids + generated)
    prefill = details["prefill"]
    assert [token["id"] for token in prefill] == prompt_ids and prefill[0]["log_prob"] is None
    for position, token in enumerate(prefill[1:]):
        expected = float(rows[position, prompt_ids[position + 1]])
        assert token["log_prob"] == pytest.approx(expected, abs=LOG_PROB_TOLERANCE)
    for step, top in enumerate(details["top_tokens"]):
        row = rows[len(prompt_ids) - 1 + step]
        assert top[0]["id"] == generated[step]  # greedy: the chosen one is the most likely
        assert_top_alternatives({t["id"]: t["log_prob"] for t in top}, row)


def test_best_of_answers_the_most_likely_of_the_seeded_sequences(server):
    """best_of=3, n=2 with seed 11 samples sequences seeded 11, 12, 13; each alone gives the
    same text (seeded sampling does not depend on the batch), so the answer is the one whose
    tokens' log-probs sum highest, and the runner-up is its only other sequence."""
    sampling = {"do_sample": True, "temperature": 1.2, "max_new_tokens": 12, "details": True}
    alone = []
    for seed in (11, 12, 13):
        output = generate(server, {**sampling, "seed": seed}).json()
        score = sum(token["log_prob"] for token in output["details"]["tokens"])
        alone.append((score, output["generated_text"]))
    ranked = [text for _, text in sorted(alone, reverse=True)]
    answer = generate(server, {**sampling, "seed": 11, "best_of": 3, "n": 2}).json()
    assert answer["generated_text"] == ranked[0]
    assert [s["generated_text"] for s in answer["details"]["best_of_sequences"]] == ranked[1:2]


def test_openai_streams_n_choices_as_it_answers_them_whole(openai_client):
    whole = openai_client.chat.completions.create(
        model="m", messages=CHAT, max_tokens=10, n=2, seed=5
    )
    stream = openai_client.chat.completions.create(
        model="m", messages=CHAT, max_tokens=10, n=2, seed=5, stream=True
    )
    texts = {0: "", 1: ""}
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    assert texts == {c.index: c.message.content for c in whole.choices}
    assert texts[0] != texts[1]  # seeds 5 and 6
