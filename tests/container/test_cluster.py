"""Which hosts the ranks run on, from the names the platforms give (a hostfile, DJL Serving's
variables, LeaderWorkerSet's), and clear errors naming the source when they cannot serve the
degree asked for."""

from __future__ import annotations

import pytest

from lmserve.container.cluster import ClusterError, num_hosts, resolve_cluster
from lmserve.container.launcher import engine_command
from lmserve.properties.config import load_config
from lmserve.rolling_batch.ipc.runtime import Runtime


def test_one_machine_without_hosts():
    assert resolve_cluster({}, 2) is None
    assert resolve_cluster({"DJL_CLUSTER_SIZE": "1"}, 2) is None
    assert num_hosts({}) == 1


def test_djl_variables_spread_the_ranks_evenly_leader_first():
    environ = {
        "DJL_CLUSTER_SIZE": "3",
        "DJL_LEADER_ADDR": "10.0.0.1",
        "DJL_WORKER_ADDR_FORMAT": "worker-%d.svc",
    }
    cluster = resolve_cluster(environ, 6)
    assert cluster.hosts == (("10.0.0.1", 2), ("worker-1.svc", 2), ("worker-2.svc", 2))
    assert cluster.mpiexec_args() == [
        "-hosts", "10.0.0.1:2,worker-1.svc:2,worker-2.svc:2",
        "-localhost", "10.0.0.1", "-launcher", "ssh",
    ]  # fmt: skip
    assert num_hosts(environ) == 3


def test_leaderworkerset_names_its_workers_after_the_leader():
    environ = {"LWS_GROUP_SIZE": "2", "LWS_LEADER_ADDRESS": "llm-0.llm.default"}
    assert resolve_cluster(environ, 2).hosts == (
        ("llm-0.llm.default", 1),
        ("llm-0-1.llm.default", 1),
    )


def test_a_hostfile_in_either_mpi_format(tmp_path):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("# leader first\nleader:3\nworker-a slots=1\n\n")
    cluster = resolve_cluster({"HYDRA_HOST_FILE": str(hostfile)}, 4)
    assert cluster.hosts == (("leader", 3), ("worker-a", 1))
    hostfile.write_text("leader\nworker-a\n")
    assert resolve_cluster({"HYDRA_HOST_FILE": str(hostfile)}, 4).hosts[1] == ("worker-a", 2)


@pytest.mark.parametrize(
    ("environ", "ranks", "message"),
    [
        ({"DJL_CLUSTER_SIZE": "2", "DJL_LEADER_ADDR": "a"}, 2, "DJL_WORKER_ADDR_FORMAT is not set"),
        (
            {"DJL_CLUSTER_SIZE": "2", "DJL_LEADER_ADDR": "a", "DJL_WORKER_ADDR_FORMAT": "b"},
            2,
            "expected a %d",
        ),
        ({"DJL_CLUSTER_SIZE": "two"}, 2, "DJL_CLUSTER_SIZE='two'"),
        (
            {"LWS_GROUP_SIZE": "2", "LWS_LEADER_ADDRESS": "l.svc"},
            3,
            "tensor_parallel_degree=3 over the 2 hosts of LWS_GROUP_SIZE=2",
        ),
        ({"LWS_GROUP_SIZE": "2"}, 2, "LWS_LEADER_ADDRESS is not set"),
    ],
)
def test_what_cannot_serve_is_refused_naming_the_source(environ, ranks, message):
    with pytest.raises(ClusterError, match=message):
        resolve_cluster(environ, ranks)


def test_a_hostfile_that_does_not_hold_the_degree_is_refused(tmp_path):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("leader:1\nworker:2\n")
    with pytest.raises(ClusterError, match=r"hold 3 ranks \(leader: 1, worker: 2\)"):
        resolve_cluster({"HYDRA_HOST_FILE": str(hostfile)}, 2)
    hostfile.write_text("leader:x\nworker\n")
    with pytest.raises(ClusterError, match="line 1: 'leader:x'"):
        resolve_cluster({"HYDRA_HOST_FILE": str(hostfile)}, 2)


def test_ranks_on_other_hosts_get_the_runtime_inline(tmp_path):
    config = load_config(None, {"OPTION_TENSOR_PARALLEL_DEGREE": "2"}).config
    runtime = Runtime(config, "m", "/models/m", "here", str(tmp_path), hosts=[["a", 1], ["b", 1]])
    command = engine_command(runtime, tmp_path / "runtime.json")
    assert command[1:7] == ["-hosts", "a:1,b:1", "-localhost", "a", "-launcher", "ssh"]
    assert Runtime.read(command[-1]) == runtime  # no file to read on host b
    alone = Runtime(config, "m", "/models/m", "here", str(tmp_path))
    assert engine_command(alone, tmp_path / "runtime.json")[-1] == str(tmp_path / "runtime.json")


def test_a_host_with_other_model_files_is_refused_naming_them(tmp_path):
    """The host check runs the probe on the host through the launcher and compares: here the
    'host' reads a copy of the model whose config.json differs."""
    from lmserve.container.cluster import Cluster
    from lmserve.container.host_probe import check_hosts

    model, copy = tmp_path / "model", tmp_path / "copy"
    for folder, text in ((model, '{"a": 1}'), (copy, '{"a": 2}')):
        folder.mkdir()
        (folder / "config.json").write_text(text)
        (folder / "weights.bin").write_bytes(b"x" * 10)
    launcher = tmp_path / "fake-ssh"
    launcher.write_text(f'#!/bin/sh\nshift 2\nexec sh -c "$(echo "$*" | sed s#{model}#{copy}#)"\n')
    launcher.chmod(0o755)
    cluster = Cluster((("leader", 1), ("worker-1", 1)), "DJL_CLUSTER_SIZE=2")
    environ = {"HYDRA_LAUNCHER_EXEC": str(launcher)}
    with pytest.raises(
        ClusterError, match=r"host worker-1: the model's files differ .*config.json"
    ):
        check_hosts(cluster, model, environ)
    (copy / "config.json").write_text('{"a": 1}')
    check_hosts(cluster, model, environ)  # the same files: nothing to say
