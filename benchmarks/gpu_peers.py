"""What gpu_bench.py compares the engine's own steps with: HF transformers' continuous batching
on the same weights, and lmserve served over HTTP; and the wheels the device's image lacks."""

from __future__ import annotations

import gc
import statistics
import subprocess
import sys
import time
from importlib import metadata
from inspect import signature
from pathlib import Path

# lmserve's needs that the device's image does not hold (/work/.library/device/KINDS.md lists
# what it does), with the ones they need in turn.
DEVICE_MISSING = (
    "msgspec",
    "pyzmq",
    "llguidance",
    "flask",
    "blinker",
    "itsdangerous",
    "gunicorn",
    "mpich",
    "mpi4py",
)
# pip matches a wheel's glibc tag exactly: every manylinux the device's glibc (2.39) runs.
PLATFORMS = ("manylinux2014_x86_64", *(f"manylinux_2_{n}_x86_64" for n in range(17, 40)))


def download_wheels(folder: Path) -> None:
    """Python 3.12 x86-64 wheels of DEVICE_MISSING at this environment's versions."""
    pinned = [f"{name}=={metadata.version(name)}" for name in DEVICE_MISSING]
    platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
         "--python-version", "3.12", "--implementation", "cp", *platforms, "-d", str(folder),
         *pinned],
        check=True,
    )  # fmt: skip


def hf_continuous_batching(engine: dict, model_dir: Path, plan, prompts, device) -> dict:
    """The end-to-end batch of gpu_bench's engine phase (the same prompts and lengths, EOS
    ignored) through transformers' `generate_batch`, with the engine's weights copied in (its
    own random ones where the engine phase left no model)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    from .gpu_bench import warm_up_prompts

    config = AutoConfig.from_pretrained(model_dir)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[plan.dtype]
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    same_weights = False
    if "llm" in engine:
        same_weights = copy_weights(engine["llm"]._engine.runner.model, model)
        engine.pop("llm").close()  # its weights and KV cache go before HF allocates its own
    gc.collect()  # (the engine holds reference cycles: closing it frees nothing by itself)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    generation = GenerationConfig(max_new_tokens=plan.batch_output, do_sample=False)
    warm_up = warm_up_prompts(prompts, config.vocab_size)
    model.generate_batch(warm_up, generation_config=generation, progress_bar=False)
    # Newer transformers warm up inside every call unless told not to: this one was.
    warmed = {"warmup": False} if "warmup" in signature(model.generate_batch).parameters else {}
    began = time.monotonic()
    outputs = model.generate_batch(
        prompts, generation_config=generation, progress_bar=False, **warmed
    )
    wall = time.monotonic() - began
    generated = sum(len(o.generated_tokens) for o in outputs.values())
    found = {
        "wall_s": wall,
        "tokens": generated,
        "tokens_per_s": generated / wall,
        "attention": getattr(model.config, "_attn_implementation", None),
        "same_weights": same_weights,
    }
    del model
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return found


def copy_weights(native, hf) -> bool:
    """The native Llama's weights into transformers' LlamaForCausalLM: the fused q/k/v and
    gate/up matrices split back into the checkpoint's names (tensor-parallel degree 1). False,
    copying nothing, where the native model holds its linears packed (a CPU's panels): HF
    keeps its own random weights, which cost it the same work."""
    import torch

    params = dict(native.named_parameters())
    sources = {name: _native_tensor(native, params, name) for name, _ in hf.named_parameters()}
    if any(tensor.numel() == 0 for tensor in sources.values()):
        return False
    with torch.no_grad():
        for name, target in hf.named_parameters():
            target.copy_(sources[name])
    return True


def _native_tensor(native, params: dict, name: str):
    for fragment, fused in ((".q_proj.", "q"), (".k_proj.", "k"), (".v_proj.", "v")):
        if fragment in name:
            qkv = params[name.replace(fragment, ".qkv_proj.")]
            layer = native.get_submodule(name.split(".self_attn.")[0] + ".self_attn.qkv_proj")
            q, kv = layer.q_size, layer.kv_size
            return {"q": qkv[:q], "k": qkv[q : q + kv], "v": qkv[q + kv :]}[fused]
    for fragment, half in ((".gate_proj.", 0), (".up_proj.", 1)):
        if fragment in name:
            both = params[name.replace(fragment, ".gate_up_proj.")]
            return both.chunk(2, dim=0)[half]
    if name == "lm_head.weight" and name not in params:
        return params["model.embed_tokens.weight"]
    return params[name]


def served_runs(plan, model_dir: Path) -> dict:
    """`lmserve serve` with the random weights: one request at a time, then a burst."""
    from .bench_cli import measure
    from .serving import running_server
    from .workload import Lengths, PromptBuilder
    from .workload import plan as plan_requests

    builder = PromptBuilder(str(model_dir / "tokenizer.json"), seed=0)
    requests, input_len, output_len = plan.served_burst
    properties = {
        "option.model_id": str(model_dir.resolve()),
        "option.load_format": "dummy",
        "option.dtype": plan.dtype,
        "option.max_rolling_batch_size": requests,
        "option.max_model_len": 4096,
        "option.enforce_eager": "false",  # CUDA graphs where they capture (cuda_graphs.py)
    }
    found = {}
    with running_server(properties, port=8099) as (url, start_s):
        found["start_s"] = start_s
        for label, (count, n_in, n_out), concurrency in (
            ("single", plan.served_single, 1),
            ("burst", plan.served_burst, None),
        ):
            planned = plan_requests(builder, count, Lengths(n_in, n_in), Lengths(n_out, n_out),
                                    None, seed=1)  # fmt: skip
            run = measure(url, "lmserve", planned, None, concurrency)
            found[label] = {**run["summary"], "decode_tokens_per_s": _decode_rate(run)}
    return found


def _decode_rate(run: dict) -> float | None:
    """The median request's tokens a second after its first (time to first token left out)."""
    rates = [
        (r["output_tokens"] - 1) / (r["latency"] - r["ttft"])
        for r in run["requests"]
        if r.get("error") is None and r.get("ttft") is not None and r["output_tokens"] > 1
        and r["latency"] > r["ttft"]
    ]  # fmt: skip
    return statistics.median(rates) if rates else None
