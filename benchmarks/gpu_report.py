"""gpu_bench.py's table: each measured step beside its roofline floor, the peers beside the
engine, and a profile of one decode step (where its time goes, kernel by kernel)."""

from __future__ import annotations

from pathlib import Path

from .gpu_roofline import Ceilings, LlamaShape


def device_name(device) -> str:
    import torch

    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return f"{props.name}, {props.total_memory / 2**30:.0f} GiB, torch {torch.__version__}"
    return f"CPU ({torch.get_num_threads()} threads), torch {torch.__version__}"


def profile_step(runner, chunks, path: Path) -> dict:
    """One decode step under torch's profiler: its kernels by total device time (or CPU time
    on a CPU) into `path`; the number of kernel launches and the top five, returned."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from .gpu_bench import step_tokens

    step_tokens(runner, chunks)  # compiled and warm before the profile
    activities = [ProfilerActivity.CPU]
    cuda = runner.device.type == "cuda"
    if cuda:
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof:
        step_tokens(runner, chunks)
        if cuda:
            torch.cuda.synchronize()
    sort = "self_device_time_total" if cuda else "self_cpu_time_total"
    events = prof.key_averages()
    path.write_text(events.table(sort_by=sort, row_limit=40) + "\n")
    device_events = [e for e in events if cuda and e.device_type.name == "CUDA"]
    ranked = sorted(device_events or events, key=lambda e: getattr(e, sort), reverse=True)
    return {
        "batch": len(chunks),
        "kernel_launches": sum(e.count for e in device_events) if cuda else None,
        "top": [(e.key[:60], e.count) for e in ranked[:5]],
    }


def table(results: dict, shape: LlamaShape) -> str:
    lines = [f"device: {results['device']}"]
    ceilings = results.get("ceilings")
    if ceilings is not None:
        c = Ceilings(**ceilings)
        weights = shape.num_params * shape.element_bytes / 1e9
        lines.append(
            f"ceilings: read {c.read_bytes_per_s / 1e12:.2f} TB/s (copy"
            f" {c.copy_bytes_per_s / 1e12:.2f}), matmul {c.matmul_flops_per_s / 1e12:.0f}"
            f" TFLOP/s ({c.matmul_size}^3); weights {weights:.2f} GB"
        )
    engine = results.get("engine") or {}
    if ceilings is not None and engine:
        lines += _step_rows(engine, shape, Ceilings(**ceilings))
    lines += _comparison_rows(results, engine)
    for kernel, error in engine.get("kernel_errors", {}).items():
        lines.append(f"engine with {kernel}: FAILED: {error.strip().splitlines()[-1]}")
    for phase, error in results.get("errors", {}).items():
        lines.append(f"{phase}: FAILED: {error.strip().splitlines()[-1]}")
    return "\n".join(lines)


def _step_rows(engine: dict, shape: LlamaShape, ceilings: Ceilings) -> list[str]:
    rows = [
        "",
        "| step | attention | launch | batch | context | ms | tokens/s | floor ms (bound) |"
        " share | inputs ms |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for step in engine.get("steps", []):
        b, ctx, seconds = step["batch"], step["context"], step["step_s"]
        floor, bound = ceilings.floor_s(shape.decode_bytes(b, ctx), shape.decode_flops(b, ctx))
        rows.append(
            f"| decode | {step['kernel']} | {step['mode']} | {b} | {ctx} | {seconds * 1e3:.2f} |"
            f" {b / seconds:.0f} | {floor * 1e3:.2f} ({bound}) | {floor / seconds:.0%} |"
            f" {step['inputs_s'] * 1e3:.2f} |"
        )
    prompt = engine.get("prompt_len")
    for kernel, seconds in engine.get("ttft_s", {}).items():
        weights = shape.num_params * shape.element_bytes
        floor, bound = ceilings.floor_s(weights, shape.prefill_flops(prompt))
        rows.append(
            f"| first token | {kernel} | eager | 1 | {prompt} prompt | {seconds * 1e3:.1f} | - |"
            f" {floor * 1e3:.2f} ({bound}) | {floor / seconds:.0%} (x{seconds / floor:.2f}) | - |"
        )
    for kernel, seconds in engine.get("capture_s", {}).items():
        if f"{kernel}, graphs" not in engine.get("kernel_errors", {}):
            rows.append(f"\nCUDA graphs captured for {kernel} in {seconds:.1f} s")
    for kernel, profile in engine.get("profile", {}).items():
        top = ", ".join(f"{name} x{count}" for name, count in profile["top"])
        rows.append(
            f"\nprofile of a decode step at batch {profile['batch']} ({kernel}):"
            f" {profile['kernel_launches']} kernel launches; most time: {top}"
        )
    return rows


def _comparison_rows(results: dict, engine: dict) -> list[str]:
    rows = ["", "| run | tokens/s | note |", "|---|---|---|"]
    offline = engine.get("offline", {})
    hf = results.get("hf")
    for setup, run in offline.items():
        note = f"x{run['tokens_per_s'] / hf['tokens_per_s']:.2f} HF" if hf else ""
        rows.append(
            f"| lmserve offline end to end ({setup}) | {run['tokens_per_s']:.0f} | {note} |"
        )
    if hf:
        weights = "the same weights" if hf["same_weights"] else "its own random weights"
        rows.append(
            f"| HF generate_batch ({hf['attention']}, {weights}) | {hf['tokens_per_s']:.0f} | |"
        )
    served = results.get("served") or {}
    default = engine.get("default_kernel")  # the served run's attention, graphs where captured
    single = [s for s in engine.get("steps", []) if s["batch"] == 1 and s["kernel"] == default]
    single.sort(key=lambda s: s["mode"] != "graphs")
    for label in ("single", "burst"):
        run = served.get(label)
        if not run:
            continue
        decode = run["decode_tokens_per_s"] or 0.0
        note = f"decode {decode:.0f} tokens/s a request"
        if label == "single" and single:
            offline_rate = 1 / single[0]["step_s"]
            note += f" (offline step rate {offline_rate:.0f}: x{decode / offline_rate:.2f})"
        rows.append(f"| served {label} ({run['num_requests']} requests) |"
                    f" {run['throughput_tokens_per_s']:.0f} | {note} |")  # fmt: skip
    return rows if len(rows) > 3 else []
