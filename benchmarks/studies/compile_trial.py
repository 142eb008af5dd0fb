"""Trial: does `torch.compile` (inductor's CPU backend) of the whole forward beat the eager
runtime once the C++ kernels and the oneDNN-packed linears are in?

    .venv/bin/python benchmarks/studies/compile_trial.py [--batches 1 8 32] [--dtype fp32]

Dynamo cannot see into a pybind11 function or an opaque oneDNN weight, so for the trial each
is registered as a torch custom op (`torch.library.custom_op`) with a fake implementation for
shape propagation, and the runtime's ops module is swapped for one that calls them: paged
attention, the K/V store, rotary, the two RMSNorms, SiLU-and-mul, and the packed linear (its
weight passed by handle). What is left for inductor are the views, splits, the embedding and
the step's own glue. The forward is compiled once with dynamic shapes (the token count, the
batch and the context lengths vary every step) and timed against eager on the same decode
steps as `op_count`: B sequences, one decode token each after --prompt-len prompt tokens.
Compile time and the first call's time are reported too (a server pays them at start-up).
Eager is the runtime as it serves: where the decoder stack runs as one C++ call
(rolling_batch/model/families/native_stack.py), inductor is given the Python layers it replaces.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time
import types

import torch

from lmserve.benchmarks.runtime_throughput import (
    batch_runner,
    decode_chunks,
    median_step_seconds,
)
from lmserve.kernels import cpu_native
from lmserve.properties.config import default_cache_dir
from lmserve.properties.python_command import python_command
from lmserve.rolling_batch.engine.mpi_launch import engine_environment
from lmserve.rolling_batch.model.layers import cpu_matmul
from lmserve.rolling_batch.model.source import local_model_path

_LINEARS: list = []  # handle -> the packed weight's own eager call
_OUT_FEATURES: list[int] = []


def register_opaque_ops(native: types.ModuleType) -> types.SimpleNamespace:
    """The native ops as custom ops, in an object with the native module's interface."""

    @torch.library.custom_op("lmserve_trial::paged_attention", mutates_args=())
    def paged_attention(
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        query_start_loc: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        return native.paged_attention(
            query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale
        )

    @paged_attention.register_fake
    def _(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale):
        return query.new_empty(query.shape)

    @torch.library.custom_op("lmserve_trial::store_kv", mutates_args=("k_cache", "v_cache"))
    def store_kv(
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        native.store_kv(key, value, k_cache, v_cache, slot_mapping)

    @torch.library.custom_op("lmserve_trial::rotary_", mutates_args=("heads",))
    def rotary_(
        heads: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> None:
        native.rotary_(heads, positions, cos, sin)

    @torch.library.custom_op("lmserve_trial::rms_norm", mutates_args=())
    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return native.rms_norm(x, weight, eps)

    @rms_norm.register_fake
    def _(x, weight, eps):
        return torch.empty_like(x)

    @torch.library.custom_op("lmserve_trial::add_rms_norm_", mutates_args=("x", "residual"))
    def add_rms_norm_(
        x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> None:
        native.add_rms_norm_(x, residual, weight, eps)

    @torch.library.custom_op("lmserve_trial::silu_and_mul", mutates_args=())
    def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
        return native.silu_and_mul(gate_up)

    @silu_and_mul.register_fake
    def _(gate_up):
        return gate_up.new_empty(*gate_up.shape[:-1], gate_up.shape[-1] // 2)

    @torch.library.custom_op("lmserve_trial::packed_linear", mutates_args=())
    def packed_linear(x: torch.Tensor, handle: int, bias: torch.Tensor | None) -> torch.Tensor:
        return _LINEARS[handle](x, bias)

    @packed_linear.register_fake
    def _(x, handle, bias):
        return x.new_empty(*x.shape[:-1], _OUT_FEATURES[handle])

    shim = types.SimpleNamespace(
        paged_attention=paged_attention,
        store_kv=store_kv,
        rotary_=rotary_,
        rms_norm=rms_norm,
        add_rms_norm_=add_rms_norm_,
        silu_and_mul=silu_and_mul,
    )
    shim.packed_linear = packed_linear
    # Eager only: the fp32 panels' layout, and the whole decoder stack in one C++ call.
    shim.pack_linear_weight = native.pack_linear_weight
    shim.DecoderStack = native.DecoderStack
    return shim


def route_packed_linears_through(packed_linear, native: types.ModuleType) -> None:
    """Every packed weight (oneDNN's or the C++ panels', built from here on) calls the custom
    op with its handle; the op calls the weight's own eager code."""
    for kind in (cpu_matmul.PackedWeight, cpu_matmul.NativeLinearWeight):
        original_init, original_call = kind.__init__, kind.__call__

        def init(self, weight, *rest, original_init=original_init, original_call=original_call):
            original_init(self, weight, *rest)
            if hasattr(self, "native"):
                self.native = native  # not the shim, whose packed_linear is the custom op
            self.handle = len(_LINEARS)
            _LINEARS.append(functools.partial(original_call, self))
            _OUT_FEATURES.append(weight.shape[0])

        kind.__init__ = init
        kind.__call__ = lambda self, x, bias=None: packed_linear(x, self.handle, bias)


def run_under_engine_allocator() -> None:
    """Re-executes this script with the allocator settings the engine processes get, unless
    they are set already (glibc reads them at start-up only)."""
    if "MALLOC_TRIM_THRESHOLD_" not in os.environ:
        script = os.path.abspath(__file__)
        os.execve(sys.executable, python_command(script, *sys.argv[1:]), engine_environment())


def main() -> None:
    run_under_engine_allocator()
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    native = cpu_native.native_ops()
    if native is None:
        raise SystemExit("the trial needs the C++ kernels")
    shim = register_opaque_ops(native)
    route_packed_linears_through(shim.packed_linear, native)
    cpu_native.native_ops = lambda: shim  # every call site looks it up per call
    model_path = local_model_path(None, default_cache_dir())
    runner, _, blocks = batch_runner(model_path, args.dtype, max(args.batches), args.prompt_len + 1)
    eager_forward = runner.model.forward
    compiled_forward = torch.compile(eager_forward, dynamic=True)
    stack = runner.model.model.native_stack

    def use(compiled: bool) -> None:
        """Eager: the runtime as it serves (its decoder stack where it applies); compiled:
        the Python layers, which are what inductor can see."""
        runner.model.forward = compiled_forward if compiled else eager_forward
        runner.model.model.native_stack = None if compiled else stack

    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.dtype}; decode"
        f" step after {args.prompt_len} prompt tokens\n\n| batch | eager ms | compiled ms |"
        " compiled / eager | first compiled call s |\n|---|---|---|---|---|"
    )
    for batch in args.batches:
        chunks = decode_chunks(runner, blocks[:batch], args.prompt_len)
        use(compiled=False)
        eager = median_step_seconds(runner, chunks, args.repeats)
        use(compiled=True)
        started = time.perf_counter()
        with torch.inference_mode():
            runner.execute(chunks)  # compiles (first batch) or checks guards
        first = time.perf_counter() - started
        compiled = median_step_seconds(runner, chunks, args.repeats)
        use(compiled=False)
        eager_logits = runner.execute(chunks)
        use(compiled=True)
        difference = (runner.execute(chunks) - eager_logits).abs().max().item()
        print(
            f"| {batch} | {1e3 * eager:.2f} | {1e3 * compiled:.2f} | {compiled / eager:.2f} |"
            f" {first:.1f} (max logit difference {difference:.1e}) |",
            flush=True,
        )


if __name__ == "__main__":
    main()
