"""lmserve's quantized weights against llama.cpp on the same GGUF file (the embedded
SmolLM2-135M Q4_1), one request at a time: both servers up at once, their runs alternating,
one command:

    .venv/bin/python -m lmserve.benchmarks.llamacpp_compare --llamacpp-python VENV/bin/python

llama.cpp is a peer to compare with, never a dependency: install its Python server into a
separate venv first (`python -m venv VENV && VENV/bin/pip install 'llama-cpp-python[server]'`,
which builds llama.cpp from source for this CPU in a few minutes; where that native build
crashes, as on an AMX Xeon here, add CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX512=ON
-DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AMX_INT8=OFF"). Its OpenAI server ignores
`ignore_eos`, so its requests carry a logit_bias that forbids the EOS tokens instead: every
request generates exactly its planned length on every server. lmserve runs one server per
`--variants` entry (fp32 and `option.quantize=int4` unless told), and with `--vllm-python`
vLLM joins on the converted weights (bf16 unless told); results go to
benchmarks/results/llamacpp/<workload>/.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

from lmserve.properties.config import default_cache_dir

from . import report
from .bench_cli import measure
from .serving import running_server, wait_healthy
from .vllm_compare import VLLM_DTYPES, check_vllm, running_vllm
from .workload import Lengths, PromptBuilder, plan

HERE = Path(__file__).resolve().parent
MAX_MODEL_LEN = 2048


DTYPES = ("fp32", "bf16")


def lmserve_properties(variant: str) -> dict[str, object]:
    """`variant`: a dtype (dense weights: "fp32", "bf16") or an option.quantize value, with
    fp32 activations or with a dtype after a dash ("int4-bf16")."""
    quantize, _, dtype = variant.partition("-")
    if quantize in DTYPES:
        quantize, dtype = "", quantize
    properties: dict[str, object] = {
        "engine": "MPI",
        "option.dtype": dtype or "fp32",
        "option.max_model_len": MAX_MODEL_LEN,
        "option.max_rolling_batch_size": 32,
    }
    if quantize:
        properties["option.quantize"] = quantize
    return properties


@contextmanager
def running_llamacpp(python: str, gguf: Path, port: int, log_path: Path):
    """llama.cpp's OpenAI server on loopback, one thread a core; yields its base URL."""
    command = [python, "-m", "llama_cpp.server", "--model", str(gguf), "--host", "127.0.0.1"]
    command += ["--port", str(port), "--n_ctx", str(MAX_MODEL_LEN)]
    command += ["--n_threads", str(len(os.sched_getaffinity(0)))]
    url = f"http://127.0.0.1:{port}"
    with log_path.open("w") as log:
        # Not from the repo root: its kernels/ would pass for another package on sys.path.
        server = subprocess.Popen(
            command, cwd=tempfile.gettempdir(), stdout=log, stderr=subprocess.STDOUT
        )
        try:
            if not wait_healthy(server, f"{url}/v1/models", time.monotonic() + 300):
                raise SystemExit(f"llama.cpp's server did not start; see {log_path}")
            yield url
        finally:
            server.terminate()
            server.wait()


def eos_logit_bias(model_dir: Path) -> dict[str, float]:
    config = json.loads((model_dir / "config.json").read_text())
    eos = config.get("eos_token_id")
    ids = eos if isinstance(eos, list) else [eos]
    generation = model_dir / "generation_config.json"
    if generation.exists():
        more = json.loads(generation.read_text()).get("eos_token_id")
        ids += more if isinstance(more, list) else [more]
    return {str(token): -100.0 for token in sorted({i for i in ids if i is not None})}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--llamacpp-python", required=True, help="python of llama.cpp's venv")
    parser.add_argument("--out", type=Path, default=HERE / "results" / "llamacpp")
    parser.add_argument("--port", type=int, default=8110, help="the first of the servers'")
    parser.add_argument(
        "--variants",
        default="fp32,int4",
        help="lmserve servers, comma-separated: fp32, bf16, int8, int4, int4-bf16, ...",
    )
    parser.add_argument(
        "--vllm-python",
        help="python of vLLM's venv (benchmarks/vllm_compare.py): adds vLLM on the converted"
        " weights to the runs",
    )
    parser.add_argument("--vllm-dtype", choices=sorted(VLLM_DTYPES), default="bf16")
    parser.add_argument("--rounds", type=int, default=2, help="alternating runs per server")
    parser.add_argument("--num-requests", type=int, default=8)
    options = parser.parse_args()
    llamacpp_python = os.path.abspath(options.llamacpp_python)  # a venv's symlink, kept

    from lmserve.rolling_batch.model.source import local_model_path
    from lmserve.rolling_batch.model.weights.gguf_convert import embedded_gguf

    model_dir = local_model_path(None, default_cache_dir())
    builder = PromptBuilder(str(model_dir / "tokenizer.json"), seed=0)
    inputs, outputs = Lengths(32, 32), Lengths(256, 256)
    planned = [
        plan(builder, options.num_requests, inputs, outputs, None, round_)
        for round_ in range(1, options.rounds + 1)
    ]
    extra = {"temperature": 0.0, "logit_bias": eos_logit_bias(model_dir)}
    log_path = Path(tempfile.gettempdir()) / "lmserve-bench-llamacpp.log"
    runs: dict[str, dict] = {}
    variants = options.variants.split(",")
    with contextlib.ExitStack() as servers:
        urls = {}
        for index, variant in enumerate(variants):
            server = running_server(lmserve_properties(variant), options.port + index)
            urls[variant] = servers.enter_context(server)[0]
        peer_port = options.port + len(variants)
        peers = {
            "llama.cpp Q4_1": (
                servers.enter_context(
                    running_llamacpp(llamacpp_python, embedded_gguf(), peer_port, log_path)
                ),
                "m",
            )
        }
        if options.vllm_python:
            check_vllm(options.vllm_python)
            vllm_log = Path(tempfile.gettempdir()) / "lmserve-bench-llamacpp-vllm.log"
            vllm = running_vllm(
                options.vllm_python, model_dir, options.vllm_dtype, peer_port + 1, vllm_log
            )
            peers[f"vLLM {options.vllm_dtype}"] = (servers.enter_context(vllm), "smollm2")
        for round_, requests in enumerate(planned, 1):
            label = f", round {round_}" if options.rounds > 1 else ""
            for variant, url in urls.items():
                runs[f"lmserve {variant}{label}"] = measure(url, "lmserve", requests, None, 1)
            for name, (url, model) in peers.items():
                runs[f"{name}{label}"] = measure(url, "openai", requests, model, 1, extra)
    title = "lmserve vs llama.cpp, SmolLM2-135M Q4_1 GGUF: one at a time, 32 in / 256 out"
    report.write(runs, options.out / "single-in32-out256", title)
    print(f"\n{title}\n{report.markdown(runs)}")


if __name__ == "__main__":
    main()
