"""lmserve on a GPU, in one device run (issue 57): an 8B Llama-shaped model with random weights
(`option.load_format=dummy`, built on the device: nothing is downloaded or written to disk),
its decode steps, time to first token and end-to-end generation each against the device's own
roofline, HF transformers' continuous batching on the same weights, and one served run over
HTTP. Prepare here, run there:

    python -m lmserve.benchmarks.gpu_bench prepare     # here: .gpu_bench/ (models), .whl/
    bash benchmarks/gpu_bench.sh                       # there: the device tool's run, carrying
                                                       #   .gpu_bench and .whl ($OUT set)
    python -m lmserve.benchmarks.gpu_bench run --tiny  # the same run on a 2-layer model (CPU)

Each phase's numbers are written to `<out>/gpu_bench.json` as it ends, so a run stopped at its
time limit still leaves what it measured; a phase that fails is reported and the rest run.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import os
import random
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path

from . import gpu_peers, gpu_report
from .gpu_roofline import LlamaShape, measure_ceilings, median_seconds

# The module (the package's `paged_attention` is the dispatching function of the same name).
attention_kernels = importlib.import_module("lmserve.kernels.paged_attention")
DEFAULT_CUDA_KERNEL = attention_kernels.cuda_kernel
WORK_DIR = Path(".gpu_bench")
# Llama-3-8B's shapes with the bundled tokenizer's vocabulary (SmolLM2's, so the served path
# tokenizes); `tiny` runs the same code in seconds on a CPU.
SHAPES = {
    "llama-8b-shape": dict(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
    ),
    "tiny": dict(
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    ),
}
BLOCK_SIZE = 16


@dataclass(frozen=True)
class Plan:
    shape: str
    dtype: str
    batches: tuple[int, ...]
    contexts: tuple[int, ...]
    prompt: int  # time to first token of one prompt this long
    batch_prompt: int  # end to end: `batch` prompts this long, `batch_output` tokens each
    batch: int
    batch_output: int
    served_single: tuple[int, int, int]  # requests, input, output tokens; one at a time
    served_burst: tuple[int, int, int]  # sent at once
    buffer_bytes: int
    matmul_size: int


FULL = Plan(
    "llama-8b-shape", "bf16", (1, 16, 64, 256), (512, 2048), 2048, 512, 64, 128,
    (8, 128, 128), (64, 512, 128), 4 << 30, 8192,
)  # fmt: skip
TINY = Plan("tiny", "fp32", (1, 4), (64, 128), 128, 32, 4, 8, (2, 16, 8), (4, 32, 8), 64 << 20, 512)


def prepare(out: Path, wheels: Path) -> None:
    """The model folders (config.json + the bundled tokenizer) and the wheels of what the
    device's image lacks, pinned to this environment's versions."""
    from lmserve.properties.config import default_cache_dir
    from lmserve.rolling_batch.model.source import local_model_path

    tokenizer_dir = local_model_path(None, default_cache_dir())
    for name in SHAPES:
        write_model_folder(out / name, name, tokenizer_dir)
    gpu_peers.download_wheels(wheels)
    print(f"wrote {out}/ ({', '.join(SHAPES)}) and {wheels}/")


def write_model_folder(folder: Path, shape: str, tokenizer_dir: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    base = json.loads((tokenizer_dir / "config.json").read_text())
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        **SHAPES[shape],
        "vocab_size": base["vocab_size"],
        "bos_token_id": base["bos_token_id"],
        "eos_token_id": base["eos_token_id"],
        "pad_token_id": base.get("pad_token_id"),
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-5,
        # Older transformers read rope_theta, newer rope_parameters.
        "rope_theta": 500000.0,
        "rope_parameters": {"rope_theta": 500000.0, "rope_type": "default"},
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "initializer_range": 0.02,
        "torch_dtype": "bfloat16",
        "dtype": "bfloat16",
    }
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (tokenizer_dir / name).exists():
            (folder / name).write_bytes((tokenizer_dir / name).read_bytes())
    return folder


def run(plan: Plan, model_dir: Path, out: Path, budget_s: float, served: bool, hf: bool) -> int:
    import torch

    started = time.monotonic()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    config = json.loads((model_dir / "config.json").read_text())
    shape = LlamaShape.of(config, 2 if plan.dtype in ("bf16", "fp16") else 4)
    results: dict = {"device": gpu_report.device_name(device), "plan": asdict(plan), "errors": {}}
    out.mkdir(parents=True, exist_ok=True)

    def save() -> None:
        (out / "gpu_bench.json").write_text(json.dumps(results, indent=1, default=str))

    def phase(name: str, work) -> None:
        if time.monotonic() - started > budget_s:
            results["errors"][name] = f"skipped: the {budget_s:.0f} s budget was spent"
            return
        began = time.monotonic()
        try:
            results[name] = work()
        except Exception:  # noqa: BLE001 - one phase's failure must not cost the others'
            results["errors"][name] = traceback.format_exc()
            print(results["errors"][name], file=sys.stderr)
        results.setdefault("phase_seconds", {})[name] = round(time.monotonic() - began, 1)
        save()

    dtype = _torch_dtype(plan.dtype)
    phase(
        "ceilings",
        lambda: asdict(measure_ceilings(device, dtype, plan.buffer_bytes, plan.matmul_size)),
    )
    engine = {}
    prompts = batch_prompts(plan, shape.vocab)
    # Filled as it goes: a kernel that fails on the device leaves the other's numbers.
    results["engine"] = found = {"steps": []}
    deadline = started + budget_s
    phase(
        "engine",
        lambda: engine_phase(plan, model_dir, device, shape, prompts, engine, out, found, save,
                             deadline),
    )  # fmt: skip
    if hf:
        phase(
            "hf",
            lambda: gpu_peers.hf_continuous_batching(engine, model_dir, plan, prompts, device),
        )
    if "llm" in engine:  # the HF phase closes it when it runs
        engine["llm"].close()
    engine.clear()
    gc.collect()  # the engine holds reference cycles: closing it frees nothing by itself
    if device.type == "cuda":
        torch.cuda.empty_cache()
    if served:
        phase("served", lambda: gpu_peers.served_runs(plan, model_dir))
    table = gpu_report.table(results, shape)
    (out / "gpu_bench.md").write_text(table + "\n")
    print(table)
    return 1 if results["errors"] or found.get("kernel_errors") else 0


def batch_prompts(plan: Plan, vocab: int) -> list[list[int]]:
    """The end-to-end batch's prompts (random token ids: no prefix is shared)."""
    rng = random.Random(1)
    return [[rng.randrange(vocab) for _ in range(plan.batch_prompt)] for _ in range(plan.batch)]


def warm_up_prompts(prompts: list[list[int]], vocab: int) -> list[list[int]]:
    """Two prompts no block of the timed ones matches (a prefix cache finds nothing)."""
    return [[(t + 7) % vocab for t in p] for p in prompts[:2]]


def engine_phase(
    plan: Plan, model_dir: Path, device, shape: LlamaShape, prompts, keep, out, found: dict,
    save, deadline: float,
):  # fmt: skip
    """Decode steps and a prompt's first token through the model runner (what one engine step
    costs, the scheduler left out), then end-to-end offline generation through the `LLM`,
    into `found`, saved after each attention kernel (`save`; none starts past `deadline`);
    `keep["llm"]` is the engine, for the HF phase. A kernel's Python or compile error is
    contained; a fault on the device itself breaks every later CUDA call."""
    import torch

    from lmserve.properties.config import default_cache_dir
    from lmserve.rolling_batch import LLM

    longest = max(*plan.contexts, plan.prompt, plan.batch_prompt + plan.batch_output) + 1
    blocks_each = -(-longest // BLOCK_SIZE)
    batches = _fitting_batches(plan, shape, device, blocks_each)
    began = time.monotonic()
    max_model_len = blocks_each * BLOCK_SIZE
    llm = LLM(
        model_dir,
        cache_dir=default_cache_dir(),
        dtype=plan.dtype,
        load_format="dummy",
        max_model_len=max_model_len,
        max_rolling_batch_size=max(*batches, plan.batch),
        num_kv_blocks=max(*batches, plan.batch) * blocks_each,
        enable_prefix_caching=False,  # each kernel's end-to-end run sends the same prompts
    )
    keep["llm"] = llm
    runner = llm._engine.runner
    found.update(load_s=time.monotonic() - began, batches_run=list(batches))
    for k_cache, v_cache in runner.kv_caches:  # keys and values to read, not zeros
        k_cache.normal_()
        v_cache.normal_()
    rng = random.Random(0)
    steps = [
        [_chunk(rng, runner, i, blocks_each, context, 1) for i in range(batch)]
        for context in plan.contexts
        for batch in batches
    ]
    prompt = [_chunk(rng, runner, 0, blocks_each, 0, plan.prompt)]
    profiled = [
        _chunk(rng, runner, i, blocks_each, min(plan.contexts), 1)
        for i in range(min(max(batches), 64))
    ]
    found["prompt_len"] = plan.prompt
    found["default_kernel"] = DEFAULT_CUDA_KERNEL if device.type == "cuda" else "cpu"
    cuda = device.type == "cuda"
    work = _EngineWork(
        llm, plan, steps, prompt, profiled, prompts, max(*batches, plan.batch), max_model_len, out
    )
    try:
        for kernel in attention_kernels.CUDA_KERNELS if cuda else ("cpu",):
            if time.monotonic() > deadline:
                found.setdefault("kernel_errors", {})[kernel] = "skipped: budget spent"
                continue
            try:
                _time_kernel(kernel, work, found)
                if cuda:  # a fault of this kernel's is reported as its own
                    torch.cuda.synchronize()
            except Exception:  # noqa: BLE001 - a kernel failing on the device: time the other
                found.setdefault("kernel_errors", {})[kernel] = traceback.format_exc()
                print(found["kernel_errors"][kernel], file=sys.stderr)
            save()
    finally:
        runner.graphs = None
        if cuda:
            attention_kernels.cuda_kernel = DEFAULT_CUDA_KERNEL  # the served run's
            torch.cuda.synchronize()
    return found


@dataclass
class _EngineWork:
    """What engine_phase times with each attention kernel."""

    llm: object
    plan: Plan
    steps: list  # decode steps: lists of chunks
    prompt: list  # one whole prompt's chunk
    profiled: list  # the decode step profiled
    prompts: list[list[int]]  # the end-to-end batch
    max_batch: int
    max_model_len: int
    out: Path


def _time_kernel(kernel: str, work: _EngineWork, found: dict) -> None:
    """Everything timed with one attention kernel: decode steps eager and from CUDA graphs,
    the first token, a profiled step, the end-to-end batch."""
    from lmserve.rolling_batch.model.cuda_graphs import capture_decode_graphs

    runner = work.llm._engine.runner
    device = runner.device
    graphs = None
    if device.type == "cuda":
        attention_kernels.cuda_kernel = kernel
        began = time.monotonic()
        graphs = capture_decode_graphs(runner, work.max_batch, work.max_model_len)
        found.setdefault("capture_s", {})[kernel] = time.monotonic() - began
        if graphs is None:  # cuda_graphs.py logged why; the steps run eagerly only
            found.setdefault("kernel_errors", {})[f"{kernel}, graphs"] = "capture failed"
    modes = {"eager": None} if graphs is None else {"eager": None, "graphs": graphs}
    for mode, mode_graphs in modes.items():
        runner.graphs = mode_graphs
        found["steps"] += [_time_step(runner, chunks, kernel, mode) for chunks in work.steps]
    runner.graphs = None  # a prompt runs eagerly; the profile shows every launch
    found.setdefault("ttft_s", {})[kernel] = median_seconds(
        lambda _: step_tokens(runner, work.prompt), device, 2, 5
    )
    found.setdefault("profile", {})[kernel] = gpu_report.profile_step(
        runner, work.profiled, work.out / f"profile-{kernel}.txt"
    )
    runner.graphs = graphs
    mode = "eager" if graphs is None else "graphs"
    found.setdefault("offline", {})[f"{kernel}, {mode}"] = _end_to_end(
        work.llm, work.prompts, work.plan
    )


def _time_step(runner, chunks, kernel: str, mode: str) -> dict:
    device = runner.device
    return {
        "kernel": kernel,
        "mode": mode,
        "batch": len(chunks),
        "context": chunks[0].num_computed,
        "step_s": median_seconds(lambda _: step_tokens(runner, chunks), device),
        "inputs_s": median_seconds(lambda _: runner._prepare(chunks), device),
    }


def _end_to_end(llm, prompts: list[list[int]], plan: Plan) -> dict:
    vocab = llm._engine.runner.model.config.vocab_size
    llm.generate(warm_up_prompts(prompts, vocab), max_new_tokens=4, ignore_eos=True)
    began = time.monotonic()
    answers = llm.generate(prompts, max_new_tokens=plan.batch_output, ignore_eos=True)
    wall = time.monotonic() - began
    generated = sum(len(a.token_ids) for a in answers)
    return {"wall_s": wall, "tokens": generated, "tokens_per_s": generated / wall}


def step_tokens(runner, chunks) -> list[int]:
    """One greedy step as the engine takes it: the model's step, then the tokens on the host
    (from the greedy head where the runner has one, a CPU's; else the logits' argmax)."""
    result = runner.execute_step(chunks)
    return list(result.greedy_tokens) or result.logits.argmax(dim=-1).tolist()


def _chunk(rng, runner, index: int, blocks_each: int, computed: int, new: int):
    from lmserve.rolling_batch.core.step import SequenceChunk

    needed = -(-(computed + new) // BLOCK_SIZE)
    first = index * blocks_each
    return SequenceChunk(
        token_ids=tuple(rng.randrange(runner.model.config.vocab_size) for _ in range(new)),
        num_computed=computed,
        block_ids=tuple(range(first, first + needed)),
        needs_logits=True,
        argmax_only=runner.argmax_head,  # as the scheduler asks: a GPU has no greedy head
    )


def _fitting_batches(plan: Plan, shape: LlamaShape, device, blocks_each: int) -> tuple[int, ...]:
    """The plan's batches whose K/V fit in 85% of the device's memory beside the weights
    twice (HF's copy is made while the engine still holds them): a smaller GPU runs fewer,
    and the table says which ran."""
    import torch

    if device.type != "cuda":
        return plan.batches
    free = 0.85 * torch.cuda.get_device_properties(device).total_memory
    free -= 2 * shape.num_params * shape.element_bytes
    per_sequence = blocks_each * BLOCK_SIZE * shape.kv_bytes_per_token()
    fitting = tuple(b for b in plan.batches if max(b, plan.batch) * per_sequence <= free)
    return fitting or plan.batches[:1]


def _torch_dtype(name: str):
    import torch

    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[name]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    prep = commands.add_parser("prepare", help="model folders and wheels, here")
    prep.add_argument("--out", type=Path, default=WORK_DIR)
    prep.add_argument("--wheels", type=Path, default=Path(".whl"))
    go = commands.add_parser("run", help="measure (on the device)")
    go.add_argument("--tiny", action="store_true", help="the 2-layer shape: a dry run")
    go.add_argument("--model", type=Path, help="default: .gpu_bench/<the plan's shape>")
    go.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "bench-results"))
    go.add_argument("--budget-s", type=float, default=300.0, help="skip phases after this")
    go.add_argument("--no-served", action="store_true", help="skip the HTTP runs")
    go.add_argument("--no-hf", action="store_true", help="skip HF transformers' peer")
    args = parser.parse_args(argv)
    if args.command == "prepare":
        prepare(args.out, args.wheels)
        return 0
    plan = TINY if args.tiny else FULL
    model_dir = args.model or WORK_DIR / plan.shape
    return run(plan, model_dir, args.out, args.budget_s, not args.no_served, not args.no_hf)


if __name__ == "__main__":
    sys.exit(main())
