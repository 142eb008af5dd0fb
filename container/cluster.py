"""Tensor parallel across hosts: which machines the MPI ranks run on.

One model over the ranks of several hosts, MPI being the only thing between them: the leader
(this machine: the front end and rank 0) and worker hosts that run ranks only, started by
mpiexec's launcher (ssh, as MPI does; `HYDRA_LAUNCHER_EXEC` names another). The hosts come from
the environment, in the names the platforms already give (the first one set wins):

- `HYDRA_HOST_FILE`: a hostfile, a line a host, `host[:ranks]` (MPICH's) or `host slots=N`
  (OpenMPI's, as kubeflow's mpi-operator writes /etc/mpi/hostfile); the leader's line first.
- DJL Serving's: `DJL_CLUSTER_SIZE` (hosts, > 1), `DJL_LEADER_ADDR`, `DJL_WORKER_ADDR_FORMAT`
  (a `%d` standing for 1 .. size - 1).
- LeaderWorkerSet's: `LWS_GROUP_SIZE` (> 1) and `LWS_LEADER_ADDRESS`
  (`<set>-<group>.<service>.<namespace>`); worker i is `<set>-<group>-<i>.<service>...`.

`option.tensor_parallel_degree` counts the ranks of all hosts, split evenly unless a hostfile
says otherwise. Torch-free.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

_SLOTS = re.compile(r"^slots=(\d+)$")


class ClusterError(ValueError):
    """A host list that cannot serve the configuration; the message names hosts and sources."""


@dataclass(frozen=True)
class Cluster:
    hosts: tuple[tuple[str, int], ...]  # (address, ranks), the leader first
    source: str  # where the host list came from, for messages

    @property
    def leader(self) -> str:
        return self.hosts[0][0]

    @property
    def workers(self) -> list[str]:
        return [host for host, _ in self.hosts[1:]]

    def mpiexec_args(self) -> list[str]:
        """mpiexec's options for these hosts: ranks in blocks, host by host (rank 0 on the
        leader), and the leader's address for the proxies on other hosts to call back to."""
        hosts = ",".join(f"{host}:{ranks}" for host, ranks in self.hosts)
        return ["-hosts", hosts, "-localhost", self.leader, "-launcher", "ssh"]


def resolve_cluster(environ: Mapping[str, str], num_ranks: int) -> Cluster | None:
    """The hosts of `num_ranks` ranks, or None for one machine."""
    found = _host_list(environ)
    if found is None:
        return None
    hosts, source = found
    if any(ranks is None for _, ranks in hosts):
        return _even([host for host, _ in hosts], num_ranks, source)
    total = sum(ranks for _, ranks in hosts)
    if total != num_ranks:
        listed = ", ".join(f"{host}: {ranks}" for host, ranks in hosts)
        raise ClusterError(
            f"option.tensor_parallel_degree={num_ranks} but the hosts of {source} hold {total}"
            f" ranks ({listed}); expected as many ranks as the degree"
        )
    return Cluster(tuple(hosts), source)


def num_hosts(environ: Mapping[str, str]) -> int:
    """How many hosts the environment names (1: this machine alone)."""
    found = _host_list(environ)
    return 1 if found is None else len(found[0])


def _host_list(environ: Mapping[str, str]) -> tuple[list[tuple[str, int | None]], str] | None:
    """(the hosts, the leader first, with their ranks where given; the source), or None for
    fewer than two."""
    hosts: list[tuple[str, int | None]] = []
    if environ.get("HYDRA_HOST_FILE"):
        source = f"HYDRA_HOST_FILE={environ['HYDRA_HOST_FILE']}"
        hosts = _read_hostfile(Path(environ["HYDRA_HOST_FILE"]))
    elif (size := _cluster_size(environ, "DJL_CLUSTER_SIZE")) > 1:
        source = f"DJL_CLUSTER_SIZE={size}"
        leader = _required(environ, "DJL_LEADER_ADDR", "DJL_CLUSTER_SIZE")
        pattern = _required(environ, "DJL_WORKER_ADDR_FORMAT", "DJL_CLUSTER_SIZE")
        if "%d" not in pattern:
            raise ClusterError(f"DJL_WORKER_ADDR_FORMAT={pattern!r}: expected a %d for the index")
        names = [leader] + [pattern.replace("%d", str(index)) for index in range(1, size)]
        hosts = [(name, None) for name in names]
    elif (size := _cluster_size(environ, "LWS_GROUP_SIZE")) > 1:
        source = f"LWS_GROUP_SIZE={size}"
        leader = _required(environ, "LWS_LEADER_ADDRESS", "LWS_GROUP_SIZE")
        first, dot, rest = leader.partition(".")
        names = [leader] + [f"{first}-{index}{dot}{rest}" for index in range(1, size)]
        hosts = [(name, None) for name in names]
    return (hosts, source) if len(hosts) > 1 else None


def _cluster_size(environ: Mapping[str, str], name: str) -> int:
    text = environ.get(name, "").strip()
    if not text:
        return 1
    if not text.isdigit() or int(text) < 1:
        raise ClusterError(f"{name}={text!r}: expected the number of hosts (1 or more)")
    return int(text)


def _required(environ: Mapping[str, str], name: str, because: str) -> str:
    value = environ.get(name, "").strip()
    if not value:
        raise ClusterError(f"{name} is not set; {because} > 1 needs it (the hosts' addresses)")
    return value


def _read_hostfile(path: Path) -> list[tuple[str, int | None]]:
    try:
        lines = path.read_text().splitlines()
    except OSError as error:
        raise ClusterError(f"HYDRA_HOST_FILE={path}: {error.strerror}") from None
    hosts = []
    for number, line in enumerate(lines, start=1):
        fields = line.split("#", 1)[0].split()
        if not fields:
            continue
        host, _, ranks = fields[0].partition(":")
        slots = [m.group(1) for field in fields[1:] if (m := _SLOTS.match(field))]
        count = ranks or (slots[0] if slots else "")
        if (count and not count.isdigit()) or len(fields) > 1 + len(slots) or not host:
            raise ClusterError(
                f"HYDRA_HOST_FILE={path} line {number}: {line.strip()!r}; expected"
                " `host`, `host:ranks` or `host slots=ranks`"
            )
        hosts.append((host, int(count) if count else None))
    return hosts


def _even(hosts: list[str], num_ranks: int, source: str) -> Cluster:
    if num_ranks % len(hosts):
        raise ClusterError(
            f"option.tensor_parallel_degree={num_ranks} over the {len(hosts)} hosts of {source}:"
            f" expected a multiple of {len(hosts)} (the same number of ranks on every host)"
        )
    return Cluster(tuple((host, num_ranks // len(hosts)) for host in hosts), source)
