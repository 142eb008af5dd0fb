"""The offline API: `LLM(...).generate(prompts)` on the native packed runtime.

    from lmserve.rolling_batch import LLM
    with LLM() as llm:                       # the embedded SmolLM2-135M-Instruct
        print(llm.generate(["The capital of France is"], max_new_tokens=16)[0].text)

With `tensor_parallel_degree > 1` it starts the MPI ranks itself, as the server does, talks to
rank 0 over a private ZeroMQ socket and stops them on `close()` (or leaving the `with`).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import tempfile
import time
import weakref
from dataclasses import asdict, dataclass
from pathlib import Path

from lmserve.properties.config import default_cache_dir
from lmserve.properties.settings import speculative_drafts

from . import protocol
from .engine_setup import RuntimeOptions, build_runner
from .eos_tokens import eos_token_ids
from .layers.parallel import TensorParallelGroup
from .model_source import local_model_path
from .mpi_launch import engine_environment, rank_command
from .offline_generation import generate_greedy

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GenerationResult:
    prompt: str | None  # None when the prompt was given as token ids
    text: str
    token_ids: list[int]


class LLM:
    def __init__(
        self,
        model: str | os.PathLike | None = None,
        tensor_parallel_degree: int = 1,
        paged_attention: bool = True,
        dtype: str = "auto",
        max_model_len: int | None = None,
        block_size: int = 16,
        max_rolling_batch_size: int = 32,
        cpu_kv_cache_fraction: float = 0.25,
        cache_dir: str | os.PathLike | None = None,
        trust_remote_code: bool = False,
        quantize: str | None = None,
        model_impl: str = "auto",
        enable_lora: bool = False,
        max_loras: int = 4,
        max_lora_rank: int = 16,
        max_cpu_loras: int | None = None,
        speculative_draft_model: str | None = None,
        speculative_length: int = 5,
        loading_timeout_s: float = 600.0,
    ):
        """The options are serving.properties' of the same names; with `enable_lora` the
        adapters are the PEFT folders in `<model>/adapters/<name>/`; with
        `speculative_draft_model="[ngram]"` up to `speculative_length` drafted tokens are
        checked a step (the same tokens, fewer steps where the text repeats itself)."""
        from transformers import AutoTokenizer

        cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
        self.model_path = local_model_path(model, cache)
        self.tokenizer = AutoTokenizer.from_pretrained(
            self.model_path, trust_remote_code=trust_remote_code
        )
        self.eos_token_ids = eos_token_ids(self.model_path, self.tokenizer)
        drafts = speculative_drafts(speculative_draft_model or "")
        self._speculative_length = speculative_length if drafts else 0
        options = RuntimeOptions(
            dtype=dtype,
            max_model_len=max_model_len,
            paged_attention=paged_attention,
            block_size=block_size,
            max_rolling_batch_size=max_rolling_batch_size,
            cpu_kv_cache_fraction=cpu_kv_cache_fraction,
            trust_remote_code=trust_remote_code,
            quantize=quantize,
            model_impl=model_impl,
            enable_lora=enable_lora,
            max_loras=max_loras,
            max_lora_rank=max_lora_rank,
            max_cpu_loras=max_cpu_loras or max_loras,
        )
        if tensor_parallel_degree == 1:
            self._engine = _InProcessEngine(self.model_path, options)
        else:
            self._engine = _MPIEngine(
                self.model_path, options, tensor_parallel_degree, loading_timeout_s
            )

    def generate(
        self,
        prompts: str | list[str] | list[list[int]],
        max_new_tokens: int = 30,
        ignore_eos: bool = False,
        adapters: str | list[str | None] | None = None,
    ) -> list[GenerationResult]:
        """Greedy generation; one result per prompt, in order. `adapters`: the LoRA adapter of
        every prompt, or a list with each prompt's (None: the base model)."""
        if isinstance(prompts, str):
            prompts = [prompts]
        if adapters is None or isinstance(adapters, str):
            adapters = [adapters] * len(prompts)
        texts = [p if isinstance(p, str) else None for p in prompts]
        prompt_ids = [
            self.tokenizer(p)["input_ids"] if isinstance(p, str) else list(p) for p in prompts
        ]
        outputs = self._engine.generate(
            prompt_ids,
            max_new_tokens,
            sorted(self.eos_token_ids),
            ignore_eos,
            list(adapters),
            self._speculative_length,
        )
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


class _InProcessEngine:
    def __init__(self, model_path: Path, options: RuntimeOptions):
        self.runner, _, self.max_model_len = build_runner(
            model_path, options, TensorParallelGroup()
        )
        self.max_rolling_batch_size = options.max_rolling_batch_size

    def generate(self, prompts, max_new_tokens, eos_token_ids, ignore_eos, adapters, drafts):
        runner = self.runner
        return generate_greedy(
            runner.execute,
            runner.num_blocks,
            runner.block_size,
            self.max_model_len,
            self.max_rolling_batch_size,
            prompts,
            max_new_tokens,
            set(eos_token_ids),
            ignore_eos,
            adapters=adapters,
            lora=runner.lora,
            speculative_length=drafts,
        )

    def close(self) -> None:
        self.runner = None


class _MPIEngine:
    """Drives `mpiexec -n N` ranks running `mpi_worker`; replies come from rank 0."""

    def __init__(self, model_path: Path, options: RuntimeOptions, ranks: int, timeout_s: float):
        import zmq

        # mkdtemp makes the directory 0700: only this user reaches the socket.
        self._ipc_dir = tempfile.mkdtemp(prefix="lmserve-llm-")
        address = f"ipc://{self._ipc_dir}/rank0.sock"
        settings = {"model_path": str(model_path), "options": asdict(options), "address": address}
        command = rank_command(ranks, "lmserve.rolling_batch.mpi_worker", json.dumps(settings))
        self._process = subprocess.Popen(command, start_new_session=True, env=engine_environment())
        # An LLM dropped without close() (or an interpreter exiting) still stops its ranks.
        self._finalizer = weakref.finalize(self, _kill_ranks, self._process, self._ipc_dir)
        self._socket = zmq.Context.instance().socket(zmq.DEALER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.connect(address)
        self._request({"op": "hello"}, timeout_s)

    def generate(self, prompts, max_new_tokens, eos_token_ids, ignore_eos, adapters, drafts):
        reply = self._request(
            {
                "op": "generate",
                "prompts": prompts,
                "max_new_tokens": max_new_tokens,
                "eos_token_ids": eos_token_ids,
                "ignore_eos": ignore_eos,
                "adapters": adapters,
                "speculative_length": drafts,
            },
            timeout_s=None,
        )
        return reply["token_ids"]

    def _request(self, message: dict, timeout_s: float | None) -> dict:
        self._socket.send(protocol.pack(message))
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not self._socket.poll(100):
            if self._process.poll() is not None:
                raise RuntimeError(f"the MPI ranks exited with code {self._process.returncode}")
            if deadline is not None and time.monotonic() > deadline:
                self.close()
                raise TimeoutError(f"the MPI ranks did not answer {message['op']!r} in time")
        reply = protocol.unpack(self._socket.recv())
        if "error" in reply:
            raise ValueError(reply["error"])
        return reply

    def close(self) -> None:
        if self._process.poll() is None:
            try:
                self._socket.send(protocol.pack({"op": "shutdown"}))
                self._process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
        self._socket.close()
        self._finalizer()


def _kill_ranks(process: subprocess.Popen, ipc_dir: str) -> None:
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    shutil.rmtree(ipc_dir, ignore_errors=True)
