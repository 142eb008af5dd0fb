"""`lmserve serve`: resolve the model, start the engine and gunicorn, supervise both.

Both children are fork+exec'd into process groups of their own, so stopping one stops
everything it started (gunicorn workers, later MPI ranks). The engine reports "ready" through
the state file; the supervisor reports what it sees: a load that takes longer than
`model_loading_timeout` or an engine that exits marks the state failed (/ping -> 500, waiting
requests answered), then the server exits non-zero so the platform replaces it.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

from lmserve.properties.python_command import python_command
from lmserve.rolling_batch.engine.mpi_launch import engine_environment, rank_command
from lmserve.rolling_batch.ipc import protocol
from lmserve.rolling_batch.ipc.runtime import Runtime, read_state, write_state

from . import gunicorn_conf
from .cluster import Cluster

log = logging.getLogger("lmserve.serve")

_POLL_S = 0.2
# How long the front end keeps answering after the engine died, so waiting clients get an
# error reply and health checks see the failure before the server goes away (or, with
# restarts, before the new engine's "loading" replaces the "failed" state).
FAILED_GRACE_S = 5.0
RESTART_GRACE_S = 2.0
MAX_RESTARTS = 3
_STOP_TIMEOUT_S = 10.0


def make_ipc_dir() -> str:
    # mkdtemp creates the directory 0700: only this user can reach the engine socket.
    return tempfile.mkdtemp(prefix="lmserve-")


class Supervisor:
    def __init__(self, runtime: Runtime, host: str, port: int):
        self.runtime = runtime
        self.host = host
        self.port = port
        self.engine: subprocess.Popen | None = None
        self.http: subprocess.Popen | None = None
        self._stop_signal: int | None = None

    def run(self) -> int:
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        runtime_path = self.runtime.write()
        write_state(self.runtime, protocol.EngineState.LOADING, "loading the model")
        try:
            self.engine = self._start_engine(runtime_path)
            # gunicorn puts the directory it starts in first on sys.path (before it reads its
            # --chdir): the private runtime folder, never where `lmserve serve` ran (from a
            # checkout's root, kernels/ would shadow the installed package of that name).
            self.http = self._start(self._gunicorn_command(runtime_path), cwd=runtime_path.parent)
            return self._supervise(runtime_path)
        finally:
            self._stop_children()
            shutil.rmtree(self.runtime.ipc_dir, ignore_errors=True)

    def _gunicorn_command(self, runtime_path: Path) -> list[str]:
        return python_command(
            "-m",
            "gunicorn",
            "--config",
            gunicorn_conf.__file__,
            "--bind",
            f"{self.host}:{self.port}",
            f"lmserve.container.app:create_app({str(runtime_path)!r})",
        )

    def _start(
        self, command: list[str], env: dict[str, str] | None = None, cwd: Path | None = None
    ) -> subprocess.Popen:
        return subprocess.Popen(command, start_new_session=True, env=env, cwd=cwd)

    def _start_engine(self, runtime_path: Path) -> subprocess.Popen:
        command = engine_command(self.runtime, runtime_path)
        return self._start(command, engine_environment())

    def _supervise(self, runtime_path: Path) -> int:
        config = self.runtime.config
        loading_deadline = time.monotonic() + config.model_loading_timeout
        announced_ready = False
        restarts = 0
        while self._stop_signal is None:
            if self.http.poll() is not None:
                log.error("the HTTP server exited with code %s", self.http.returncode)
                return 1
            if self.engine.poll() is not None:
                reason = f"engine exited with code {self.engine.returncode}"
                engine_state = read_state(self.runtime)
                if engine_state["state"] == protocol.EngineState.FAILED:
                    reason = f"{engine_state['reason']}; {reason}"
                if not config.restart_engine_on_failure or restarts >= MAX_RESTARTS:
                    return self._engine_failed(reason)
                restarts += 1
                self._restart_engine(reason, runtime_path, restarts)
                loading_deadline = time.monotonic() + config.model_loading_timeout
                announced_ready = False
                continue
            state = read_state(self.runtime)["state"]
            if state == protocol.EngineState.READY and not announced_ready:
                log.info("ready: http://%s:%d/invocations", self.host, self.port)
                announced_ready = True
            if state == protocol.EngineState.LOADING and time.monotonic() > loading_deadline:
                return self._engine_failed(
                    f"model not loaded within {self.runtime.config.model_loading_timeout} s"
                    " (option.model_loading_timeout)"
                )
            time.sleep(_POLL_S)
        log.info("received signal %d: stopping", self._stop_signal)
        return 0

    def _restart_engine(self, reason: str, runtime_path: Path, restarts: int) -> None:
        log.error("%s; restarting the engine (%d of %d)", reason, restarts, MAX_RESTARTS)
        write_state(self.runtime, protocol.EngineState.FAILED, reason)
        _stop_group(self.engine)
        time.sleep(RESTART_GRACE_S)  # waiting requests are answered from the failed state
        write_state(self.runtime, protocol.EngineState.LOADING, f"restarting after: {reason}")
        self.engine = self._start_engine(runtime_path)

    def _engine_failed(self, reason: str) -> int:
        log.error("%s; answering with errors for %.0f s, then exiting", reason, FAILED_GRACE_S)
        write_state(self.runtime, protocol.EngineState.FAILED, reason)
        _stop_group(self.engine)
        deadline = time.monotonic() + FAILED_GRACE_S
        while time.monotonic() < deadline and self._stop_signal is None:
            time.sleep(_POLL_S)
        return 1

    def _on_signal(self, signum: int, _frame) -> None:
        self._stop_signal = signum

    def _stop_children(self) -> None:
        for child in (self.http, self.engine):
            if child is not None:
                _stop_group(child)


def engine_command(runtime: Runtime, runtime_path: Path) -> list[str]:
    config = runtime.config
    if config.engine == "MPI" and runtime.hosts:
        # Ranks on other hosts cannot read the leader's files: they get the runtime inline.
        cluster = Cluster(tuple((host, ranks) for host, ranks in runtime.hosts), "runtime")
        return rank_command(
            config.tensor_parallel_degree,
            "lmserve.rolling_batch.engine.process",
            runtime.to_json(),
            cluster.mpiexec_args(),
        )
    if config.engine == "MPI":
        return rank_command(
            config.tensor_parallel_degree, "lmserve.rolling_batch.engine.process", str(runtime_path)
        )
    return python_command("-m", "lmserve.handlers.python_engine.process", str(runtime_path))


def _stop_group(child: subprocess.Popen) -> None:
    """SIGTERM the child's whole process group, SIGKILL whatever outlives the timeout."""
    if child.poll() is None:
        try:
            os.killpg(child.pid, signal.SIGTERM)
            child.wait(timeout=_STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            pass
        except ProcessLookupError:
            return
    try:
        os.killpg(child.pid, signal.SIGKILL)  # stragglers the leader left behind
    except ProcessLookupError:
        pass
    child.wait()
