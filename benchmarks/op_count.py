"""Framework ops in one decode step of the native runtime, and the step's time:

    .venv/bin/python -m lmserve.benchmarks.op_count [--batches 1 8 32] [--dtypes fp32 bf16]

At small batches a decode step costs about its number of eager ops times a fixed per-op cost,
so the count is the number to drive down. Counted at the dispatcher (a TorchDispatchMode):
every ATen op, oneDNN linear and registered custom op counts once; and calls from Python into
a C++ extension's functions (pybind11: they bypass the dispatcher, so the mode never sees
them) count once each too, named `module.function`. What a C++ op does inside counts as
nothing more, except where it calls back into the dispatcher (the decoder stack, which runs
all of a step's layers in one C++ call, counts the ops it calls: no per-layer split then;
`--python-layers` counts the Python layers instead). Whatever the runtime is when this runs is
what is counted.

Setup as in runtime_throughput: the embedded SmolLM2-135M, one process, B prompts of
--prompt-len random tokens prefilled, then one decode token each. The timed step repeats that
same decode step (same positions, the same KV slot overwritten), outside the counting mode,
whose Python hooks would slow every op.
"""

from __future__ import annotations

import argparse
import sys
import types
from collections import Counter, defaultdict

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from lmserve.properties.config import default_cache_dir
from lmserve.rolling_batch.model.source import local_model_path

from .runtime_throughput import (
    batch_runner,
    decode_chunks,
    median_step_seconds,
    run_under_engine_allocator,
)

INPUTS, BEFORE, AFTER = "step inputs", "before layers", "after layers"


class OpCounter(TorchDispatchMode):
    """Counts every op by name (`aten::mm`, `mkldnn::_linear_pointwise`, a C++ extension's
    `lmserve_cpu_ops_avx512.rms_norm`, ...) into the section the step is in: the runner's input
    tensors, the model before its layers (embedding, rotary tables), each decoder layer, after
    them (final norm, LM head). Single-threaded callers only (the profile hook is per thread)."""

    def __init__(self):
        super().__init__()
        self.section: str | int = INPUTS
        self.counts: dict[str | int, Counter] = defaultdict(Counter)
        self._previous_profile = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[self.section][func.name()] += 1
        return func(*args, **(kwargs or {}))

    def __enter__(self):
        self._previous_profile = sys.getprofile()
        sys.setprofile(self._count_extension_call)
        return super().__enter__()

    def __exit__(self, *exc):
        sys.setprofile(self._previous_profile)
        return super().__exit__(*exc)

    def _count_extension_call(self, frame, event, arg) -> None:
        if event == "c_call" and isinstance(arg, types.BuiltinFunctionType):
            module = arg.__module__
            if module and _is_extension_call(frame.f_globals.get("__name__", ""), module):
                self.counts[self.section][f"{module}.{arg.__name__}"] += 1

    def total(self) -> Counter:
        return sum(self.counts.values(), Counter())

    def watch(self, model: nn.Module, layers: nn.ModuleList | None) -> list:
        """Hooks that move `section` along; the caller removes them."""

        def enter(section):
            def hook(*_):
                self.section = section

            return hook

        # The model's own end hook too: where its decoder stack runs in one C++ call no layer
        # hook fires, and the LM head still counts after the layers.
        handles = [
            model.register_forward_pre_hook(enter(BEFORE)),
            model.register_forward_hook(enter(AFTER)),
        ]
        for index, layer in enumerate(layers or ()):
            handles.append(layer.register_forward_pre_hook(enter(index)))
            handles.append(layer.register_forward_hook(enter(AFTER)))
        return handles


def _is_extension_call(caller: str, module: str) -> bool:
    """A call from the runtime's code into a third-party C extension: not into Python's own
    functions (len, math.sqrt, ...), not into torch's (the dispatcher counts its ops), and not
    made by torch or by the extension's own Python code (torch's custom-op machinery reads
    triton settings, numpy calls its core: internals, not the step's ops)."""
    top, caller_top = module.partition(".")[0], caller.partition(".")[0]
    if top in sys.stdlib_module_names or "torch" in (top, caller_top):
        return False
    return caller_top != top


def decoder_layers(model: nn.Module, num_layers: int) -> nn.ModuleList | None:
    """The model's stack of decoder layers, found by shape, not by attribute path, so the
    count survives refactors of the model code (None: no per-layer numbers)."""
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module) == num_layers:
            return module
    return None


def measure(
    model_path, dtype: str, batch: int, prompt_len: int, repeats: int, python_layers=False
) -> dict:
    """`python_layers`: the model's Python layers serve even where its decoder stack would
    run in one C++ call (rolling_batch/model/families/native_stack.py), as before the stack."""
    runner, hf_config, blocks = batch_runner(model_path, dtype, batch, prompt_len + 1)
    if python_layers:
        for module in runner.model.modules():
            if getattr(module, "native_stack", None) is not None:
                module.native_stack = None
    decode = decode_chunks(runner, blocks, prompt_len)
    step_s = median_step_seconds(runner, decode, repeats)

    layers = decoder_layers(runner.model, hf_config.num_hidden_layers)
    counter = OpCounter()
    handles = counter.watch(runner.model, layers)
    try:
        with counter:
            runner.execute(decode)
    finally:
        for handle in handles:
            handle.remove()
    return {
        "step_s": step_s,
        "total": counter.total(),
        "sections": {s: sum(counter.counts[s].values()) for s in (INPUTS, BEFORE, AFTER)},
        "layers": [counter.counts[i] for i in range(len(layers or ()))],
    }


def layer_summary(layers: list[Counter]) -> tuple[str, Counter]:
    """("70 (layer 0: 76)", the typical layer's ops). Typical = the most common op count;
    layers that differ are named (the first layer may build things the others reuse)."""
    if not layers:
        return "-", Counter()
    sizes = [sum(c.values()) for c in layers]
    typical = Counter(sizes).most_common(1)[0][0]
    odd = [f"layer {i}: {n}" for i, n in enumerate(sizes) if n != typical]
    text = (
        str(typical) if not odd else f"{typical} ({', '.join(odd[:3])}{', ...' * (len(odd) > 3)})"
    )
    return text, layers[sizes.index(typical)]


def print_tables(dtype: str, results: dict[int, dict], top: int) -> None:
    batches = list(results)
    print(
        f"\n{dtype}: ops per decode step\n\n"
        "| batch | ops per step | per layer | layers | step inputs / before / after layers |"
        " step ms (median) | us per op |\n|---|---|---|---|---|---|---|"
    )
    typical = {}
    for batch, r in results.items():
        total = sum(r["total"].values())
        layer_text, typical[batch] = layer_summary(r["layers"])
        if not any(r["layers"][i] for i in range(len(r["layers"]))):
            layer_text = "- (one C++ call: the decoder stack)"
        outside = " / ".join(str(r["sections"][s]) for s in (INPUTS, BEFORE, AFTER))
        print(
            f"| {batch} | {total} | {layer_text} | {len(r['layers'])} | {outside} |"
            f" {1e3 * r['step_s']:.2f} | {1e6 * r['step_s'] / total:.1f} |"
        )
    tables = (
        ("whole step", {b: r["total"] for b, r in results.items()}),
        ("one typical layer", typical),
    )
    for title, counts in tables:
        names: list[str] = []
        for counter in counts.values():  # an op may rank high at one batch only
            names += [n for n, _ in counter.most_common(top) if n not in names]
        header = " | ".join(f"batch {b}" for b in batches)
        print(f"\n{dtype}: top ops, {title}\n\n| op | {header} |\n|---|" + "---|" * len(batches))
        for name in names:
            print(f"| {name} | " + " | ".join(str(c[name]) for c in counts.values()) + " |")


def main() -> None:
    # Timed under the allocator settings the engine processes get.
    run_under_engine_allocator("lmserve.benchmarks.op_count")
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--dtypes", nargs="+", choices=["fp32", "bf16"], default=["fp32"])
    parser.add_argument("--prompt-len", type=int, default=64, help="context before the step")
    parser.add_argument("--repeats", type=int, default=20, help="timed steps (median)")
    parser.add_argument("--top", type=int, default=12, help="op names listed")
    parser.add_argument("--threads", type=int, help="torch threads; default: torch's")
    parser.add_argument(
        "--python-layers", action="store_true", help="the Python layers, not the decoder stack"
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model_path = local_model_path(None, default_cache_dir())
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads; SmolLM2-135M, one decode"
        f" token per sequence after {args.prompt_len} prompt tokens"
    )
    for dtype in args.dtypes:
        results = {
            batch: measure(
                model_path, dtype, batch, args.prompt_len, args.repeats, args.python_layers
            )
            for batch in args.batches
        }
        print_tables(dtype, results, args.top)


if __name__ == "__main__":
    main()
