"""Tensor parallel across hosts, on one machine: the worker host is a network namespace made
here, joined to this one by a veth pair with addresses of their own. The leader (this
namespace) runs the front end and rank 0; rank 1 runs in the worker namespace, started by
mpiexec's launcher as over ssh (`HYDRA_LAUNCHER_EXEC`: a script that runs the command in the
namespace named by the host's address). Hosts come from DJL Serving's variables. Nothing but
MPI goes between the ranks, over TCP as between machines. The embedded SmolLM2-135M at TP=2
answers as HF does, with a LoRA adapter of the model dir's on both hosts as HF + PEFT does;
registering an adapter while serving is refused (only this host would have it). Start-up
refuses a host that cannot be reached, or whose lmserve code differs. Needs root and
`ip netns`; skipped otherwise."""

from __future__ import annotations

import pytest
import requests
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from lmserve.benchmarks.netns_hosts import ip, netns_usable, worker_namespace

from ..container.test_host_probe import CHANGED, copy_of_lmserve
from ..hf_reference import assert_same_or_near_tie, hf_greedy_alone
from ..lora_adapters import peft_model, save_adapter
from ..servers import Server, write_properties
from .test_rank_failure import collect, rank_one_killed_under_load, rank_pid

pytestmark = pytest.mark.skipif(not netns_usable(), reason="needs root and `ip netns`")


@pytest.fixture(scope="module")
def worker_host():
    with worker_namespace() as host:
        yield host


def start(tmp_path, model_dir, env, adapter: str | None = None) -> Server:
    """`adapter`: one made for the model, saved in the model dir's adapters/, with LoRA on."""
    properties = {
        "engine": "MPI",
        "option.tensor_parallel_degree": 2,
        "option.model_id": model_dir,
        "option.max_model_len": 4096,
        "option.dtype": "fp32",
    }
    if adapter is not None:
        properties["option.enable_lora"] = "true"
    folder = write_properties(tmp_path / "model", properties)
    if adapter is not None:
        targets = ["q_proj", "v_proj"]
        save_adapter(model_dir, adapter, targets, 8, 16, False, 1, folder / "adapters" / adapter)
    server = Server(folder, env=env)
    server.model_dir = folder
    return server


@pytest.fixture(scope="module")
def server(worker_host, smollm2_dir, tmp_path_factory):
    """The embedded SmolLM2-135M at TP=2, rank 1 on the worker host, with a LoRA adapter."""
    server = start(
        tmp_path_factory.mktemp("multi-host"),
        smollm2_dir,
        worker_host.djl_environment(),
        adapter="tuned",
    )
    server.worker_host = worker_host
    server.wait_healthy()
    yield server
    server.stop()


def test_ranks_in_two_namespaces_answer_as_hf(server, smollm2_dir):
    in_worker = set(ip("netns", "pids", server.worker_host.namespace).stdout.split())
    assert str(rank_pid(server, 1)) in in_worker and str(rank_pid(server, 0)) not in in_worker
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    for prompt in ("The capital of France is", "def fibonacci(n):"):
        body = {"inputs": prompt, "parameters": {"max_new_tokens": 12, "details": True}}
        response = requests.post(f"{server.url}/invocations", json=body, timeout=120)
        assert response.status_code == 200, response.text
        served = [token["id"] for token in response.json()["details"]["tokens"]]
        expected, logits = hf_greedy_alone(model, tokenizer(prompt)["input_ids"], 12)
        assert_same_or_near_tie(served, expected, logits)


def test_a_model_dir_adapter_runs_on_both_hosts_and_none_is_registered_later(server, smollm2_dir):
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    model_dir = server.model_dir
    prompt = "The capital of France is"
    body = {"inputs": prompt, "parameters": {"max_new_tokens": 8, "details": True}}
    response = requests.post(
        f"{server.url}/invocations", json={**body, "adapters": "tuned"}, timeout=120
    )
    assert response.status_code == 200, response.text
    served = [token["id"] for token in response.json()["details"]["tokens"]]
    model = peft_model(smollm2_dir, "tuned", folder=model_dir / "adapters" / "tuned")
    expected, logits = hf_greedy_alone(model, tokenizer(prompt)["input_ids"], 8)
    assert_same_or_near_tie(served, expected, logits)

    name = requests.get(f"{server.url}/v1/models", timeout=30).json()["data"][0]["id"]
    adapters_url = f"{server.url}/models/{name}/adapters"
    late = {"name": "late", "src": str(model_dir / "adapters" / "tuned")}
    refused = requests.post(adapters_url, json=late, timeout=60)
    assert refused.status_code == 400
    message = refused.json()["message"]
    hosts = f"{server.worker_host.leader}, {server.worker_host.address}"
    assert f"ranks span 2 hosts ({hosts})" in message
    assert "adapters/ folder on every host" in message
    listed = requests.get(adapters_url, timeout=60).json()["adapters"]
    assert [adapter["name"] for adapter in listed] == ["tuned"]
    assert requests.get(f"{server.url}/ping", timeout=10).status_code == 200


def test_a_lost_worker_rank_answers_every_client(server):
    # rank 1: the worker host's. The supervisor waits (stopped) from the moment the engine is
    # marked failed while the test sees every client answered and /ping unhealthy: its grace
    # period before it ends the server cannot run out on a slow host.
    with rank_one_killed_under_load(server, hold=True) as (answers, killed_at, clients):
        waited = collect(answers, killed_at, clients)
        assert waited < 60  # a hang guard: the answers come from the failure, not a timeout
        assert all(answer.status_code >= 500 for answer in answers)
        assert requests.get(f"{server.url}/ping", timeout=10).status_code != 200


def test_an_unreachable_host_stops_start_up_naming_it(worker_host, tiny_model_dir, tmp_path):
    missing = worker_host.subnet.rsplit(".", 1)[0] + ".%d.9"  # the launcher reaches no such host
    server = start(tmp_path, tiny_model_dir, worker_host.djl_environment(missing))
    assert server.process.wait(timeout=120) == 2
    log = server.log()
    assert f"host {worker_host.subnet}.9: not reached" in log and "DJL_CLUSTER_SIZE=2" in log


def test_a_host_with_other_lmserve_code_stops_start_up_naming_it(
    worker_host, tiny_model_dir, tmp_path
):
    """The worker host runs a wheel-style copy of lmserve with one file changed."""
    site = copy_of_lmserve(tmp_path / "site")
    launcher = tmp_path / "other-code-ssh"
    launcher.write_text(f'#!/bin/sh\nPYTHONPATH={site} exec {worker_host.launcher} "$@"\n')
    launcher.chmod(0o755)
    env = {**worker_host.djl_environment(), "HYDRA_LAUNCHER_EXEC": str(launcher)}
    server = start(tmp_path, tiny_model_dir, env)
    assert server.process.wait(timeout=120) == 2
    log = server.log()
    assert f"host {worker_host.address}: lmserve's code differs from the leader's" in log
    assert f"files: {CHANGED});" in log
