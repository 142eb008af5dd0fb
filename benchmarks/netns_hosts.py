"""A second "host" on one machine, for tensor parallel across hosts: a network namespace joined
to this one by a veth pair, the leader at SUBNET.1 here and the worker at SUBNET.2 there, and a
launcher script that mpiexec (`HYDRA_LAUNCHER_EXEC`) and lmserve's host check call as they call
ssh (`-x HOST COMMAND`), running the command in the namespace. Needs root and `ip netns`."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class WorkerHost:
    namespace: str
    subnet: str  # "10.x.1": the leader is .1, the worker .2
    launcher: Path

    @property
    def leader(self) -> str:
        return f"{self.subnet}.1"

    @property
    def address(self) -> str:
        return f"{self.subnet}.2"

    def djl_environment(self, worker_format: str | None = None) -> dict[str, str]:
        """DJL Serving's variables for the leader and this worker (`worker_format`: another
        DJL_WORKER_ADDR_FORMAT, e.g. one naming a host that does not exist)."""
        return {
            "DJL_CLUSTER_SIZE": "2",
            "DJL_LEADER_ADDR": self.leader,
            # %d = 1 is this subnet's third number: 10.x.%d.2 -> 10.x.1.2
            "DJL_WORKER_ADDR_FORMAT": worker_format or self.subnet.rsplit(".", 1)[0] + ".%d.2",
            "HYDRA_LAUNCHER_EXEC": str(self.launcher),
            # Namespaces share the machine's memory, and MPI's UCX would take the shortcut
            # (shared memory between the ranks); real hosts have only the network: TCP it is.
            "UCX_TLS": "tcp,self",
            # Each "host" would take every core of the machine they share: one thread a rank.
            "OMP_NUM_THREADS": "1",
        }


def ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=False)


def netns_usable() -> bool:
    if os.geteuid() != 0 or shutil.which("ip") is None:
        return False
    probe = f"lmserve-probe{os.getpid()}"
    if ip("netns", "add", probe).returncode != 0:
        return False
    ip("netns", "del", probe)
    return True


@contextmanager
def worker_namespace():
    """Yields a WorkerHost; removes the namespace, the veth pair and the script after."""
    tag = os.getpid()
    namespace, veth, subnet = f"lmserve-w{tag}", f"lmv{tag % 100000}", f"10.{200 + tag % 50}.1"
    folder = Path(tempfile.mkdtemp(prefix="lmserve-netns-"))
    steps = [
        ("netns", "add", namespace),
        ("link", "add", f"{veth}a", "type", "veth", "peer", "name", f"{veth}b"),
        ("link", "set", f"{veth}b", "netns", namespace),
        ("addr", "add", f"{subnet}.1/24", "dev", f"{veth}a"),
        ("link", "set", f"{veth}a", "up"),
        ("netns", "exec", namespace, "ip", "addr", "add", f"{subnet}.2/24", "dev", f"{veth}b"),
        ("netns", "exec", namespace, "ip", "link", "set", f"{veth}b", "up"),
        ("netns", "exec", namespace, "ip", "link", "set", "lo", "up"),
    ]
    try:
        for step in steps:
            result = ip(*step)
            if result.returncode != 0:
                raise RuntimeError(f"ip {' '.join(step)}: {result.stderr.strip()}")
        launcher = folder / "netns-ssh"
        launcher.write_text(
            "#!/bin/sh\n"
            '[ "$1" = -x ] && shift\n'
            "host=$1; shift\n"
            f'[ "$host" = {subnet}.2 ] || {{ echo "ssh: connect to host $host: No route" >&2;'
            " exit 255; }\n"
            f'exec ip netns exec {namespace} sh -c "$*"\n'
        )
        launcher.chmod(0o755)
        yield WorkerHost(namespace, subnet, launcher)
    finally:
        ip("link", "del", f"{veth}a")
        ip("netns", "del", namespace)
        shutil.rmtree(folder, ignore_errors=True)
