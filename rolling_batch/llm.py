"""The offline API: `LLM(...).generate(prompts)` on the native packed runtime.

    from lmserve.rolling_batch import LLM
    with LLM() as llm:                       # the embedded SmolLM2-135M-Instruct
        print(llm.generate(["The capital of France is"], max_new_tokens=16)[0].text)

The LLM is a client of the server's engine over the same typed protocol: every prompt is a
GenerateRequest, answered by a FinalEvent (or an ErrorEvent). With one rank the engine shell
and the rolling batch run in this process (engine/process.py: build_rolling_core); with
`tensor_parallel_degree > 1` it starts the MPI ranks as the server does (engine/process.py, in a
private directory) and talks to rank 0 over their socket, stopping them on `close()` (or
leaving the `with`).
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import weakref
from dataclasses import dataclass, replace
from pathlib import Path

import zmq

from lmserve.properties.config import ServingConfig, default_cache_dir, load_config

from .engine.mpi_launch import engine_environment, rank_command
from .engine.process import build_rolling_core
from .engine.shell import EngineShell
from .ipc import protocol
from .ipc.runtime import Runtime, read_state
from .model.eos_tokens import eos_token_ids
from .model.layers.parallel import TensorParallelGroup
from .model.runner import ModelRunner
from .model.runner_setup import RuntimeOptions, build_runner
from .model.source import local_model_path

log = logging.getLogger(__name__)

_CLIENT = b"llm"  # the in-process client's identity at the shell

# A request's answer: its FinalEvent, or the ErrorEvent that refused or failed it.
Answer = protocol.FinalEvent | protocol.ErrorEvent


@dataclass(frozen=True)
class GenerationResult:
    prompt: str | None  # None when the prompt was given as token ids
    text: str
    token_ids: list[int]


class LLM:
    def __init__(
        self,
        model: str | os.PathLike | None = None,
        cache_dir: str | os.PathLike | None = None,
        loading_timeout_s: float = 600.0,
        **options: object,
    ):
        """`options`: serving.properties' option.* settings by their names, defaulting as
        there (docs/configuration.md): `tensor_parallel_degree`, `dtype`, `max_model_len`,
        `paged_attention`, `block_size`, `max_rolling_batch_size`, `quantize`, `enable_lora`
        (the adapters are the PEFT folders in `<model>/adapters/<name>/`),
        `speculative_draft_model="[ngram]"`, ... An unknown name or a bad value raises
        ConfigError naming it."""
        from transformers import AutoTokenizer

        cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
        config = engine_config(options)
        self.model_path = local_model_path(model, cache, config.load_format != "dummy")
        self.tokenizer = AutoTokenizer.from_pretrained(
            self.model_path, trust_remote_code=config.trust_remote_code
        )
        self.eos_token_ids = eos_token_ids(self.model_path, self.tokenizer)
        if config.tensor_parallel_degree == 1:
            self._engine = LocalEngine.load(self.model_path, config, self.eos_token_ids)
        else:
            self._engine = _RankEngine(self.model_path, config, loading_timeout_s)

    def generate(
        self,
        prompts: str | list[str] | list[list[int]],
        max_new_tokens: int = 30,
        ignore_eos: bool = False,
        adapters: str | list[str | None] | None = None,
    ) -> list[GenerationResult]:
        """Greedy generation; one result per prompt, in order. `adapters`: the LoRA adapter of
        every prompt, or a list with each prompt's (None: the base model). A prompt the engine
        refuses (too long, an adapter not served) raises ValueError naming it."""
        if isinstance(prompts, str):
            prompts = [prompts]
        if adapters is None or isinstance(adapters, str):
            adapters = [adapters] * len(prompts)
        texts = [p if isinstance(p, str) else None for p in prompts]
        requests = [
            protocol.GenerateRequest(
                str(index),
                self.tokenizer(prompt)["input_ids"] if isinstance(prompt, str) else list(prompt),
                protocol.GenerationParams(
                    max_new_tokens=max_new_tokens, ignore_eos=ignore_eos, adapter=adapter
                ),
                stream=False,
            )
            for index, (prompt, adapter) in enumerate(zip(prompts, adapters, strict=True))
        ]
        answers = self._engine.run(requests)
        refused = [
            answers[r.id] for r in requests if isinstance(answers[r.id], protocol.ErrorEvent)
        ]
        if refused:
            raise ValueError("; ".join(f"prompt {e.id}: {e.message}" for e in refused))
        outputs = [answers[r.id].token_ids for r in requests]
        return [
            GenerationResult(text, self.tokenizer.decode(ids, skip_special_tokens=True), ids)
            for text, ids in zip(texts, outputs)
        ]

    def close(self) -> None:
        self._engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *_exc) -> None:
        self.close()


def engine_config(options: dict[str, object]) -> ServingConfig:
    """The ServingConfig of the LLM's options, resolved and checked as serving.properties'
    are (the environment is not read). An offline batch waits as long as it needs: no queue
    bound, no option.predict_timeout."""
    properties = {
        f"option.{name}": str(value).lower() if isinstance(value, bool) else str(value)
        for name, value in options.items()
        if value is not None
    }
    config = load_config(None, environ={}, properties=properties).config
    unknown = sorted(config.extra_options)
    if unknown:
        raise TypeError(f"LLM() got unknown options: {', '.join(unknown)}")
    return replace(config, job_queue_size=sys.maxsize, predict_timeout=None)


class LocalEngine:
    """The engine shell and the rolling batch in this process (one rank); the shell's frames
    come back through `_Inbox`."""

    def __init__(self, shell: EngineShell, inbox: _Inbox, runner: ModelRunner):
        self.shell = shell
        self._inbox = inbox
        self.runner = runner

    @classmethod
    def load(cls, model_path: Path, config: ServingConfig, eos: set[int]) -> LocalEngine:
        runner, _, max_model_len = build_runner(
            model_path, RuntimeOptions.from_config(config), TensorParallelGroup()
        )
        return cls.for_runner(config, model_path, runner, max_model_len, eos)

    @classmethod
    def for_runner(
        cls,
        config: ServingConfig,
        model_path: str | Path,
        runner: ModelRunner,
        max_model_len: int,
        eos: set[int],
    ) -> LocalEngine:
        core = build_rolling_core(
            config, str(model_path), runner, max_model_len, eos, execute=runner.execute_step
        )
        inbox = _Inbox()
        return cls(EngineShell(core, inbox, config.job_queue_size), inbox, runner)

    def run(self, requests: list[protocol.GenerateRequest]) -> dict[str, Answer]:
        for request in requests:
            self.shell.handle(_CLIENT, request)
        try:
            while self.shell.core.seconds_until_work(time.monotonic()) is not None:
                self.shell.turn()
        except BaseException:
            # Interrupted (Ctrl-C, a failed step): none of this call's requests stays behind
            # to run, or to answer, in the next call.
            for request in requests:
                self.shell.handle(_CLIENT, protocol.AbortRequest(request.id))
            self._inbox.take()
            raise
        return self._inbox.take()

    def close(self) -> None:
        self.shell = self.runner = None


class _Inbox:
    """Stands for the socket of an in-process shell: keeps the answers it is sent."""

    def __init__(self):
        self._answers: dict[str, Answer] = {}

    def send_multipart(self, frames: list[bytes]) -> None:
        _, frame = frames
        for event in protocol.decode_events(frame):
            if isinstance(event, (protocol.FinalEvent, protocol.ErrorEvent)):
                self._answers[event.id] = event

    def take(self) -> dict[str, Answer]:
        answers, self._answers = self._answers, {}
        return answers


class _RankEngine:
    """`mpiexec -n N` ranks running the server's engine/process.py in a private directory; this
    process is their one front end."""

    def __init__(self, model_path: Path, config: ServingConfig, timeout_s: float):
        # mkdtemp makes the directory 0700: only this user reaches the socket.
        ipc_dir = tempfile.mkdtemp(prefix="lmserve-llm-")
        runtime = Runtime(config, model_path.name, str(model_path), str(model_path), ipc_dir)
        command = rank_command(
            config.tensor_parallel_degree,
            "lmserve.rolling_batch.engine.process",
            str(runtime.write()),
        )
        self._process = subprocess.Popen(command, start_new_session=True, env=engine_environment())
        # An LLM dropped without close() (or an interpreter exiting) still stops its ranks.
        self._finalizer = weakref.finalize(self, _stop_ranks, self._process, ipc_dir)
        self._wait_until_ready(runtime, timeout_s)
        self._socket = zmq.Context.instance().socket(zmq.DEALER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.connect(runtime.engine_address)

    def _wait_until_ready(self, runtime: Runtime, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            state = read_state(runtime)
            if state["state"] == protocol.EngineState.READY:
                return
            if state["state"] == protocol.EngineState.FAILED:
                self.close()
                raise RuntimeError(state["reason"])
            self._check_alive()
            if time.monotonic() > deadline:
                self.close()
                raise TimeoutError(f"the MPI ranks did not load the model in {timeout_s:g} s")
            time.sleep(0.1)

    def _check_alive(self) -> None:
        if self._process.poll() is not None:
            raise RuntimeError(f"the MPI ranks exited with code {self._process.returncode}")

    def run(self, requests: list[protocol.GenerateRequest]) -> dict[str, Answer]:
        for request in requests:
            self._socket.send(protocol.encode(request))
        answers: dict[str, Answer] = {}
        while len(answers) < len(requests):
            if not self._socket.poll(100):
                self._check_alive()
                continue
            for event in protocol.decode_events(self._socket.recv()):
                if isinstance(event, (protocol.FinalEvent, protocol.ErrorEvent)):
                    answers[event.id] = event
        return answers

    def close(self) -> None:
        if hasattr(self, "_socket"):
            self._socket.close()
        self._finalizer()


def _stop_ranks(process: subprocess.Popen, ipc_dir: str) -> None:
    """SIGTERM the ranks' process group, SIGKILL whatever outlives 30 s."""
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    shutil.rmtree(ipc_dir, ignore_errors=True)
