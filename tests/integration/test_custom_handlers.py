"""A DJL model.py served unchanged over real HTTP (gunicorn, the engine=Python process): its
load-time properties, dynamic batches answered by position, a stream, a requirements.txt
package, a failing request answered with DJL's 424 while the server goes on, and a handler
that fails to load stopping start-up with its traceback in the log."""

from __future__ import annotations

import json
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests

from ..servers import Server, write_properties

HANDLER_DIR = Path(__file__).with_name("custom_handler")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model_dir = tmp_path_factory.mktemp("custom") / "echo"
    shutil.copytree(HANDLER_DIR, model_dir)
    server = Server(model_dir, env={"HF_HUB_OFFLINE": "1"})
    try:
        server.wait_healthy(timeout=240)
        yield server
    finally:
        server.stop()


def invoke(server, payload, **headers):
    return requests.post(f"{server.url}/invocations", json=payload, headers=headers, timeout=60)


def test_handler_answers_with_properties_headers_and_requirements(server):
    answer = invoke(server, {"inputs": "hi"}, **{"X-Caller": "test"})
    assert answer.status_code == 200
    assert answer.headers["content-type"] == "application/json"
    body = answer.json()
    assert body["echo"] == {"inputs": "hi"}
    assert body["greeting"] == "bonjour from a package requirements.txt installed"
    assert body["header"] == "test"


def test_sagemaker_custom_attributes_reach_the_handler_as_properties(server):
    attributes = {"X-Amzn-SageMaker-Custom-Attributes": "trace_id=abc-1; ids=1,2"}
    assert invoke(server, {"n": 1}, **attributes).json()["trace_id"] == "abc-1"
    # SageMaker passes any value on: one that is not key=value pairs is no error.
    opaque = invoke(server, {"n": 2}, **{"X-Amzn-SageMaker-Custom-Attributes": "Trace ID: 7"})
    assert opaque.status_code == 200
    assert opaque.json()["trace_id"] is None


def test_concurrent_requests_share_a_batch_and_get_their_own_answers(tmp_path):
    """The handler's own server, with a max_batch_delay (60 s) far longer than four concurrent
    requests take to come on any machine: they make one full batch (batch_size=4), each
    answered by its position. (With the example's 300 ms, a busy machine may not bring four
    requests that fast.)"""
    model_dir = tmp_path / "echo"
    shutil.copytree(HANDLER_DIR, model_dir)
    properties = model_dir / "serving.properties"
    text = properties.read_text()
    assert "batch_size=4\nmax_batch_delay=300\n" in text
    properties.write_text(text.replace("max_batch_delay=300", "max_batch_delay=60000"))
    server = Server(model_dir, env={"HF_HUB_OFFLINE": "1"})
    try:
        server.wait_healthy(timeout=240)
        with ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(lambda n: invoke(server, {"n": n}).json(), range(4)))
    finally:
        server.stop()
    assert [a["echo"] for a in answers] == [{"n": n} for n in range(4)]
    assert [a["batch_size"] for a in answers] == [4] * 4


def test_stream_arrives_piece_by_piece(server):
    payload = {"stream": True, "text": "one two three"}
    with requests.post(f"{server.url}/invocations", json=payload, stream=True, timeout=60) as r:
        assert r.headers["content-type"] == "application/jsonlines"
        lines = [json.loads(line) for line in r.iter_lines() if line]
    assert lines == [{"word": w, "index": i} for i, w in enumerate(["one", "two", "three"])]


def test_failing_request_gets_424_and_the_server_goes_on(server):
    answer = invoke(server, {"fail": True})
    assert answer.status_code == 424
    body = answer.json()
    assert body["message"] == "prediction failure"
    assert "ValueError: the handler was asked to fail" in body["error"]
    assert invoke(server, {"n": 1}).status_code == 200


def test_bad_json_body_reaches_the_handler_as_it_is(server):
    answer = requests.post(
        f"{server.url}/invocations", data=b"{not json", headers={"content-type": "application/json"}
    )
    assert answer.status_code == 424  # the handler's get_as_json raised: its failure, DJL's code
    assert "JSONDecodeError" in answer.json()["error"]


def test_handler_that_fails_to_load_stops_start_up(tmp_path):
    model_dir = tmp_path / "broken"
    model_dir.mkdir()
    (model_dir / "my_handler.py").write_text(
        "def handle(inputs):\n    if inputs.is_empty():\n        return 1 / 0\n"
    )
    server = Server(model_dir, env={"OPTION_ENTRYPOINT": "my_handler.py", "HF_HUB_OFFLINE": "1"})
    try:
        code = server.process.wait(timeout=120)
    finally:
        server.stop()
    assert code != 0
    log = server.log()
    assert "ZeroDivisionError" in log and "my_handler.py" in log


FORMATTERS = """
import json

from djl_python.input_parser import input_formatter
from djl_python.output_formatter import output_formatter


@input_formatter
def from_question(input_item):
    request = input_item.get_as_json()
    parameters = {"max_new_tokens": 5, "ignore_eos_token": True}
    return {"inputs": request["question"], "parameters": parameters, "stream": request["stream"]}


@output_formatter
def token_lines(output):
    sequence = output.sequences[output.best_sequence_index]
    lines = []
    while sequence.has_next_token():
        token, _, last = sequence.get_next_token()
        lines.append(json.dumps({"id": token.id, "last": last}) + "\\n")
    return "".join(lines)
"""


def test_model_py_formatters_wrap_the_rolling_batch(tiny_model_dir, tmp_path):
    """A model.py with formatters and no handle(): the default engine (the rolling batch over
    MPI) serves, the formatters shape what goes in and out, streamed or not."""
    model_dir = write_properties(tmp_path / "formatted", {"option.model_id": tiny_model_dir})
    (model_dir / "model.py").write_text(FORMATTERS)
    server = Server(model_dir)
    try:
        server.wait_healthy()
        whole = requests.post(
            f"{server.url}/invocations", json={"question": "Hi", "stream": False}, timeout=60
        )
        with requests.post(
            f"{server.url}/invocations",
            json={"question": "Hi", "stream": True},
            stream=True,
            timeout=60,
        ) as streamed:
            pieces = [json.loads(line) for line in streamed.iter_lines() if line]
    finally:
        assert server.stop() == 0
    assert "rolling batch" in server.log()
    lines = [json.loads(line) for line in whole.text.splitlines()]
    assert [line["last"] for line in lines] == [False] * 4 + [True]
    assert pieces == lines  # greedy: the same tokens either way
