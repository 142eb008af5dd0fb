"""Every error status a client can meet, on a real server with a tiny model; after each one the
server still answers a good request."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from ..servers import Server, write_properties

MAX_MODEL_LEN = 512
MAX_REQUEST_SIZE = 8000


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    folder = write_properties(
        tmp_path_factory.mktemp("tiny-errors"),
        {
            "engine": "Python",
            "option.rolling_batch": "disable",
            "batch_size": 2,
            "max_batch_delay": 20,
            "job_queue_size": 2,
            "max_request_size": MAX_REQUEST_SIZE,
            "option.model_id": tiny_model_dir,
            "option.max_model_len": MAX_MODEL_LEN,
        },
    )
    server = Server(folder)
    server.wait_healthy()
    yield server
    assert server.stop() == 0


def post(server, body, path="/invocations", **kwargs) -> requests.Response:
    """A request, with a hang guard only: the job-queue test's accepted requests wait for
    batches of 400 tokens, which a loaded 2-core host takes over a minute to generate."""
    data = body if isinstance(body, (bytes, str)) else json.dumps(body)
    headers = kwargs.pop("headers", {"Content-Type": "application/json"})
    return requests.post(f"{server.url}{path}", data=data, headers=headers, timeout=600, **kwargs)


def assert_still_serving(server):
    response = post(server, {"inputs": "Hello", "parameters": {"max_new_tokens": 4}})
    assert response.status_code == 200, response.text
    assert isinstance(response.json()["generated_text"], str)
    assert len(response.headers["x-request-id"]) > 0


@pytest.mark.parametrize(
    ("body", "field"),
    [
        (b"{not json", "body"),
        ([1, 2], "body"),
        ({"parameters": {}}, "inputs"),
        ({"inputs": 42}, "inputs"),
        ({"inputs": []}, "inputs"),
        ({"inputs": ["ok", 3]}, "inputs"),
        ({"inputs": "hi", "parameters": "fast"}, "parameters"),
        ({"inputs": "hi", "parameters": {"max_new_tokens": "ten"}}, "parameters.max_new_tokens"),
        ({"inputs": "hi", "parameters": {"max_new_tokens": 0}}, "parameters.max_new_tokens"),
        ({"inputs": "hi", "parameters": {"max_new_tokens": 10_000}}, "parameters.max_new_tokens"),
        ({"inputs": "hi", "parameters": {"temperature": -1}}, "parameters.temperature"),
        ({"inputs": "hi", "parameters": {"top_p": 1.5}}, "parameters.top_p"),
        ({"inputs": "hi", "parameters": {"top_p": 0}}, "parameters.top_p"),
        ({"inputs": "hi", "parameters": {"top_k": -3}}, "parameters.top_k"),
        ({"inputs": "hi", "parameters": {"do_sample": "yes"}}, "parameters.do_sample"),
        (
            {"inputs": "hi", "parameters": {"repetition_penalty": 0}},
            "parameters.repetition_penalty",
        ),
        ({"inputs": "hi", "parameters": {"seed": -1}}, "parameters.seed"),
        ({"inputs": "hi", "parameters": {"stop_sequences": [1]}}, "parameters.stop_sequences"),
        ({"inputs": "hi", "parameters": {"details": 1}}, "parameters.details"),
        ({"inputs": "hi", "stream": "yes"}, "stream"),
        ({"inputs": "word " * 600}, "inputs"),
        ({"inputs": ""}, "inputs"),
    ],
)
def test_bad_input_is_400_naming_the_field(server, body, field):
    response = post(server, body)
    assert response.status_code == 400, response.text
    error = response.json()
    assert error["code"] == 400
    assert error["field"] == field
    assert field.split(".")[-1] in error["message"]
    assert "Traceback" not in response.text
    assert response.headers["x-request-id"]
    assert_still_serving(server)


def test_unknown_model_is_404(server):
    assert post(server, {"inputs": "hi"}, path="/predictions/other-model").status_code == 404
    response = post(server, {"inputs": "hi"}, params={"model_name": "other-model"})
    assert response.status_code == 404
    assert "other-model" in response.json()["message"]
    assert requests.get(f"{server.url}/models/other-model", timeout=10).status_code == 404
    assert requests.get(f"{server.url}/no/such/route", timeout=10).status_code == 404
    assert_still_serving(server)


def test_body_over_the_limit_is_413(server):
    response = post(server, {"inputs": "x" * (MAX_REQUEST_SIZE * 2)})
    assert response.status_code == 413
    assert response.json()["code"] == 413
    assert "max_request_size" in response.json()["message"]
    assert response.headers["x-request-id"]
    assert_still_serving(server)


def test_model_failure_is_424_and_only_fails_that_request(server):
    # A temperature this small overflows the logits to inf: torch.multinomial raises inside
    # HF generate. A real model failure, not a validation error.
    bad = {"inputs": "hi", "parameters": {"do_sample": True, "temperature": 1e-40}}
    response = post(server, bad)
    assert response.status_code == 424, response.text
    error = response.json()
    assert error["code"] == 424 and error["message"] == "prediction failure"
    assert "probability" in error["error"]
    assert_still_serving(server)


def test_full_job_queue_is_503(server):
    body = {"inputs": "Hello", "parameters": {"max_new_tokens": 400, "ignore_eos_token": True}}
    with ThreadPoolExecutor(16) as pool:
        responses = list(pool.map(lambda _: post(server, body), range(16)))
    statuses = [r.status_code for r in responses]
    assert set(statuses) <= {200, 503}, statuses
    assert 200 in statuses and 503 in statuses, statuses
    rejected = next(r for r in responses if r.status_code == 503)
    assert "job_queue_size" in rejected.json()["message"]
    for accepted in (r for r in responses if r.status_code == 200):
        assert accepted.json()["generated_text"] is not None
    assert_still_serving(server)


def test_list_inputs_text_plain_and_model_routes(server):
    response = post(server, {"inputs": ["a", "b c"], "parameters": {"max_new_tokens": 3}})
    assert response.status_code == 200
    assert isinstance(response.json(), list) and len(response.json()) == 2
    plain = post(server, "Hello there", headers={"Content-Type": "text/plain"})
    assert plain.status_code == 200 and "generated_text" in plain.json()
    (listed,) = requests.get(f"{server.url}/models", timeout=10).json()["models"]
    assert listed["status"] == "READY"  # DJL's ListModelsResponse: the pool's status name
    name = listed["modelName"]
    routed = post(
        server, {"inputs": "hi", "parameters": {"max_new_tokens": 2}}, path=f"/predictions/{name}"
    )
    assert routed.status_code == 200
    described = requests.get(f"{server.url}/models/{name}", timeout=10).json()
    assert described["status"] == "Healthy"  # DJL's DescribeWorkflowResponse
    assert described["config"]["job_queue_size"] == 2
    own_id = post(
        server,
        {"inputs": "hi"},
        headers={"Content-Type": "application/json", "x-request-id": "abc-123"},
    )
    assert own_id.headers["x-request-id"] == "abc-123"


def test_metrics_count_responses_by_status(server):
    assert post(server, {"inputs": "hi", "parameters": {"top_p": 7}}).status_code == 400
    assert_still_serving(server)
    text = requests.get(f"{server.url}/metrics", timeout=10).text
    counts = {}
    for line in text.splitlines():
        if line.startswith("lmserve_requests_total{"):
            labels, value = line.rsplit(" ", 1)
            counts[labels.split('status="')[1].split('"')[0]] = float(value)
    assert counts.get("400", 0) >= 1 and counts.get("200", 0) >= 1, text
    assert "lmserve_num_queued" in text


def test_server_metrics_is_the_same_prometheus_text(server):
    # DJL serves its Prometheus text at /server/metrics, GET only.
    djl_path = requests.get(f"{server.url}/server/metrics", timeout=10)
    assert djl_path.status_code == 200
    assert djl_path.headers["content-type"].startswith("text/plain")
    plain = requests.get(f"{server.url}/metrics", timeout=10)

    def families(text: str) -> set[str]:
        return {line.split()[2] for line in text.splitlines() if line.startswith("# TYPE")}

    assert families(djl_path.text) == families(plain.text)
    assert 'lmserve_up{model="' in djl_path.text
    refused = requests.post(f"{server.url}/server/metrics", timeout=10)
    assert refused.status_code == 405
    assert refused.json()["code"] == 405
