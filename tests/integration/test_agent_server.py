"""What agents send, through the OpenAI SDK against a real server on the embedded model:
structured outputs (a JSON schema with nested objects, arrays, enums and required fields;
`json_object`; a regex; a choice; TGI's grammar on /invocations) come back valid, streamed or
not, and a bad schema is a 400 the SDK reports with its field; `tool_choice: "required"` and a
named function return calls whose arguments validate against the tool's schema, streamed in
pieces that add up. (`auto` parsing and reasoning: tests/handlers/test_agent_answers.py, on
scripted output: this model writes no tool-call markup.) And what clients probe: /health,
/version, /tokenize, /detokenize."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import requests

from ..servers import Server, write_properties

openai = pytest.importorskip("openai")

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pets": {"type": "array", "items": {"enum": ["cat", "dog", "fish"]}, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "pets", "address"],
    "additionalProperties": False,
}
ASK_PERSON = [{"role": "user", "content": "Describe a person called Ann, as JSON."}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = write_properties(
        tmp_path_factory.mktemp("agent"),
        {"option.max_rolling_batch_size": 8, "option.max_model_len": 1024},
    )
    server = Server(folder)
    server.wait_healthy()
    yield server
    assert server.stop() == 0


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def person_format(strict: bool = True) -> dict:
    return {
        "type": "json_schema",
        "json_schema": {"name": "person", "schema": PERSON, "strict": strict},
    }


def test_json_schema_answers_validate_streamed_or_not(client):
    answer = client.chat.completions.create(
        model="m",
        messages=ASK_PERSON,
        max_tokens=120,
        temperature=0,
        response_format=person_format(),
    )
    text = answer.choices[0].message.content
    jsonschema.validate(json.loads(text), PERSON)
    assert answer.choices[0].finish_reason == "stop"
    stream = client.chat.completions.create(
        model="m",
        messages=ASK_PERSON,
        max_tokens=120,
        temperature=0,
        response_format=person_format(),
        stream=True,
    )
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == text


def test_sampled_choices_each_validate(client):
    answer = client.chat.completions.create(
        model="m",
        messages=ASK_PERSON,
        max_tokens=120,
        temperature=1.0,
        seed=7,
        n=3,
        response_format=person_format(strict=False),
    )
    for choice in answer.choices:
        jsonschema.validate(json.loads(choice.message.content), PERSON)


def test_json_object_regex_and_choice(client):
    answer = client.chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": "Give me a JSON object with one key."}],
        max_tokens=60,
        temperature=0,
        response_format={"type": "json_object"},
    )
    if answer.choices[0].finish_reason == "stop":  # a small model may talk for 60 tokens
        assert isinstance(json.loads(answer.choices[0].message.content), dict)
    phone = client.completions.create(
        model="m",
        prompt="Call me at",
        max_tokens=20,
        temperature=0,
        extra_body={"structured_outputs": {"regex": r" [0-9]{3}-[0-9]{4}"}},
    )
    assert re.fullmatch(r" [0-9]{3}-[0-9]{4}", phone.choices[0].text)
    assert phone.choices[0].finish_reason == "stop"
    yes_no = client.chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": "Is the sky green?"}],
        max_tokens=20,
        extra_body={"structured_outputs": {"choice": ["yes", "no"]}},
    )
    assert yes_no.choices[0].message.content in ("yes", "no")


def test_tgi_grammar_on_invocations(server):
    body = {
        "inputs": "Ann's details:",
        "parameters": {"max_new_tokens": 120, "grammar": {"type": "json", "value": PERSON}},
    }
    answer = requests.post(f"{server.url}/invocations", json=body, timeout=300).json()
    jsonschema.validate(json.loads(answer["generated_text"]), PERSON)


def test_bad_schemas_are_400_with_the_field(client):
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(
            model="m",
            messages=ASK_PERSON,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "nope"}},
            },
        )
    assert refused.value.status_code == 400
    assert refused.value.param == "response_format.json_schema.schema"


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather forecast for a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 30},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]


def test_required_and_named_tool_calls_validate(client):
    schema = WEATHER["function"]["parameters"]
    for tool_choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        answer = client.chat.completions.create(
            model="m",
            messages=ASK_WEATHER,
            tools=[WEATHER],
            tool_choice=tool_choice,
            max_tokens=100,
            temperature=0,
        )
        (choice,) = answer.choices
        assert choice.finish_reason == "tool_calls"
        (call,) = choice.message.tool_calls[:1]
        assert call.function.name == "get_weather" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), schema)


def test_a_streamed_forced_call_adds_up_to_the_whole_one(client):
    named = {"type": "function", "function": {"name": "get_weather"}}
    whole = client.chat.completions.create(
        model="m", messages=ASK_WEATHER, tools=[WEATHER], tool_choice=named, max_tokens=100,
        temperature=0,
    )  # fmt: skip
    stream = client.chat.completions.create(
        model="m", messages=ASK_WEATHER, tools=[WEATHER], tool_choice=named, max_tokens=100,
        temperature=0, stream=True,
    )  # fmt: skip
    names, pieces, finish = [], [], None
    for chunk in stream:
        for delta_call in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            if delta_call.function.name:
                names.append(delta_call.function.name)
            pieces.append(delta_call.function.arguments or "")
        if chunk.choices and chunk.choices[0].finish_reason:
            finish = chunk.choices[0].finish_reason
    assert names == ["get_weather"] and finish == "tool_calls"
    assert "".join(pieces) == whole.choices[0].message.tool_calls[0].function.arguments


def test_tools_without_auto_tool_choice_are_refused_by_name(client):
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model="m", messages=ASK_WEATHER, tools=[WEATHER])
    assert refused.value.param == "tool_choice"


def test_the_small_endpoints_clients_probe(server):
    health = requests.get(f"{server.url}/health", timeout=30)
    assert health.status_code == 200 and health.content == b""
    assert requests.get(f"{server.url}/version", timeout=30).json()["version"]
    counted = requests.post(f"{server.url}/tokenize", json={"prompt": "Hello"}, timeout=30).json()
    assert counted["count"] == len(counted["tokens"]) > 0 and counted["max_model_len"] == 1024
    back = requests.post(f"{server.url}/detokenize", json={"tokens": counted["tokens"]}, timeout=30)
    assert back.json() == {"prompt": "Hello"}
    refused = requests.post(f"{server.url}/detokenize", json={"tokens": "x"}, timeout=30)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "tokens"
