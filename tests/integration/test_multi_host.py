"""Tensor parallel across hosts, on one machine: the worker host is a network namespace made
here, joined to this one by a veth pair with addresses of their own. The leader (this
namespace) runs the front end and rank 0; rank 1 runs in the worker namespace, started by
mpiexec's launcher as over ssh (`HYDRA_LAUNCHER_EXEC`: a script that runs the command in the
namespace named by the host's address). Hosts come from DJL Serving's variables. Nothing but
MPI goes between the ranks. Needs root and `ip netns`; skipped otherwise."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import threading
import time

import pytest
import requests
from transformers import AutoModelForCausalLM, AutoTokenizer

from ..hf_reference import assert_same_or_near_tie, hf_greedy_alone
from ..servers import Server, write_properties
from .test_rank_failure import LONG, rank_pid

SUBNET = f"10.{200 + os.getpid() % 50}.1"  # this run's: leader .1, worker .2
NAMESPACE = f"lmserve-w{os.getpid()}"
VETH = f"lmv{os.getpid() % 100000}"


def _ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=False)


def _netns_usable() -> bool:
    if os.geteuid() != 0 or shutil.which("ip") is None:
        return False
    probe = f"lmserve-probe{os.getpid()}"
    if _ip("netns", "add", probe).returncode != 0:
        return False
    _ip("netns", "del", probe)
    return True


pytestmark = pytest.mark.skipif(not _netns_usable(), reason="needs root and `ip netns`")


@pytest.fixture(scope="module")
def worker_host(tmp_path_factory):
    """The worker namespace and its address; the launcher script that reaches it."""
    steps = [
        ("netns", "add", NAMESPACE),
        ("link", "add", f"{VETH}a", "type", "veth", "peer", "name", f"{VETH}b"),
        ("link", "set", f"{VETH}b", "netns", NAMESPACE),
        ("addr", "add", f"{SUBNET}.1/24", "dev", f"{VETH}a"),
        ("link", "set", f"{VETH}a", "up"),
        ("netns", "exec", NAMESPACE, "ip", "addr", "add", f"{SUBNET}.2/24", "dev", f"{VETH}b"),
        ("netns", "exec", NAMESPACE, "ip", "link", "set", f"{VETH}b", "up"),
        ("netns", "exec", NAMESPACE, "ip", "link", "set", "lo", "up"),
    ]
    try:
        for step in steps:
            result = _ip(*step)
            assert result.returncode == 0, f"ip {' '.join(step)}: {result.stderr}"
        launcher = tmp_path_factory.mktemp("launcher") / "netns-ssh"
        # Called as ssh is by hydra and by lmserve's host check: -x HOST COMMAND.
        launcher.write_text(
            "#!/bin/sh\n"
            '[ "$1" = -x ] && shift\n'
            "host=$1; shift\n"
            f'[ "$host" = {SUBNET}.2 ] || {{ echo "ssh: connect to host $host: No route" >&2;'
            " exit 255; }\n"
            f'exec ip netns exec {NAMESPACE} sh -c "$*"\n'
        )
        launcher.chmod(0o755)
        yield launcher
    finally:
        _ip("link", "del", f"{VETH}a")
        _ip("netns", "del", NAMESPACE)


def cluster_env(launcher, worker_format: str) -> dict[str, str]:
    return {
        "DJL_CLUSTER_SIZE": "2",
        "DJL_LEADER_ADDR": f"{SUBNET}.1",
        "DJL_WORKER_ADDR_FORMAT": worker_format,
        "HYDRA_LAUNCHER_EXEC": str(launcher),
    }


def start(tmp_path, tiny_model_dir, env) -> Server:
    properties = {
        "engine": "MPI",
        "option.tensor_parallel_degree": 2,
        "option.model_id": tiny_model_dir,
        "option.max_model_len": 4096,
        "option.dtype": "fp32",
    }
    return Server(write_properties(tmp_path / "model", properties), env=env)


@pytest.fixture(scope="module")
def server(worker_host, tiny_model_dir, tmp_path_factory):
    worker = SUBNET.rsplit(".", 1)[0] + ".%d.2"  # DJL's format: %d = 1 is this subnet
    server = start(
        tmp_path_factory.mktemp("multi-host"), tiny_model_dir, cluster_env(worker_host, worker)
    )
    server.wait_healthy()
    yield server
    server.stop()


def test_ranks_in_two_namespaces_answer_as_hf(server, tiny_model_dir):
    in_worker = set(_ip("netns", "pids", NAMESPACE).stdout.split())
    assert str(rank_pid(server, 1)) in in_worker and str(rank_pid(server, 0)) not in in_worker
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    for prompt in ("The capital of France is", "def fibonacci(n):"):
        body = {"inputs": prompt, "parameters": {"max_new_tokens": 12, "details": True}}
        response = requests.post(f"{server.url}/invocations", json=body, timeout=120)
        assert response.status_code == 200, response.text
        served = [token["id"] for token in response.json()["details"]["tokens"]]
        expected, logits = hf_greedy_alone(model, tokenizer(prompt)["input_ids"], 12)
        assert_same_or_near_tie(served, expected, logits)


def test_a_lost_worker_rank_answers_every_client_within_5_s(server):
    answers: list[requests.Response] = []

    def ask():
        answers.append(requests.post(f"{server.url}/invocations", json=LONG, timeout=60))

    clients = [threading.Thread(target=ask) for _ in range(3)]
    for client in clients:
        client.start()
    time.sleep(1.5)  # running in the engine now
    os.kill(rank_pid(server, 1), signal.SIGKILL)
    killed_at = time.monotonic()
    for client in clients:
        client.join(timeout=20)
    assert len(answers) == 3, "a client got no answer"
    assert time.monotonic() - killed_at < 5
    assert all(answer.status_code >= 500 for answer in answers)
    assert requests.get(f"{server.url}/ping", timeout=10).status_code != 200


def test_an_unreachable_host_stops_start_up_naming_it(worker_host, tiny_model_dir, tmp_path):
    missing = SUBNET.rsplit(".", 1)[0] + ".%d.9"  # no such host: the launcher cannot reach it
    server = start(tmp_path, tiny_model_dir, cluster_env(worker_host, missing))
    assert server.process.wait(timeout=120) == 2
    log = server.log()
    assert f"host {SUBNET}.9: not reached" in log and "DJL_CLUSTER_SIZE=2" in log
