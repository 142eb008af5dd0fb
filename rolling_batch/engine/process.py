"""engine=MPI: every rank of `mpiexec -n TP python -m mpi4py -m lmserve.rolling_batch.engine.process
RUNTIME_JSON`. All ranks load their shard of the model; rank 0 owns the engine socket and runs
the rolling batch, the others follow its steps. Ranks > 0 never talk to the front end."""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable

import zmq

from lmserve.properties.config import ServingConfig

from ..core.block_manager import BlockManager
from ..core.grammar import GrammarCompiler
from ..core.scheduler import Scheduler
from ..core.speculation import NgramDrafter
from ..core.step import SequenceChunk
from ..ipc import protocol
from ..ipc.runtime import Runtime, write_state
from ..lora.registry import AdapterRegistry
from ..model.eos_tokens import eos_token_ids
from ..model.runner import ModelRunner, StepLogits
from ..model.runner_setup import RuntimeOptions, build_runner
from .ranks import StepBroadcaster, follow, make_group, ranks_on_this_host
from .rolling_core import RollingBatchCore
from .sampler import Sampler
from .shell import EngineShell
from .stats import StepTrace


def main() -> None:
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    logging.basicConfig(
        level=logging.INFO, format=f"%(asctime)s engine rank{rank} %(levelname)s %(message)s"
    )
    runtime = Runtime.read(sys.argv[1])
    config = runtime.config
    try:
        group = make_group(comm, runtime.hosts[0][0] if runtime.hosts else None)
        runner, _, max_model_len = build_runner(
            runtime.model_path,
            RuntimeOptions.from_config(config, runtime.adapters_dir),
            group,
            ranks_on_this_host(comm),
        )
    except Exception as error:
        if rank == 0:
            write_state(
                runtime, protocol.EngineState.FAILED, f"model failed to load: {error!r}"[:2000]
            )
        raise
    if rank != 0:
        follow(runner, comm)
        return
    # Before the ready state: a tokenizer that fails to load here, or a step trace that
    # cannot be written, must fail start-up.
    eos = eos_token_ids(runtime.model_path, trust_remote_code=config.trust_remote_code)
    broadcaster = StepBroadcaster(runner, comm)
    core = build_rolling_core(
        config,
        runtime.model_path,
        runner,
        max_model_len,
        eos,
        execute=broadcaster.execute_step,
        world_size=comm.Get_size(),
        share_adapters=broadcaster.share_adapters,
    )
    socket = zmq.Context.instance().socket(zmq.ROUTER)
    socket.bind(runtime.engine_address)
    dtype = str(runner.model.dtype).removeprefix("torch.")
    logging.getLogger("lmserve.engine").info(
        "engine=MPI model %s: %d rank(s), dtype=%s device=%s, max_rolling_batch_size=%d"
        " max_rolling_batch_prefill_tokens=%d scheduling_policy=%s paged_attention=%s"
        " prefix_caching=%s"
        " speculative_draft_model=%s, KV cache %d blocks x %d tokens",
        runtime.model_name,
        comm.Get_size(),
        dtype,
        runner.device,
        config.max_rolling_batch_size,
        config.max_rolling_batch_prefill_tokens,
        config.scheduling_policy,
        config.paged_attention,
        config.enable_prefix_caching,
        config.speculative_draft_model,
        runner.num_blocks,
        runner.block_size,
    )
    write_state(runtime, protocol.EngineState.READY, dtype=dtype, device=str(runner.device))
    EngineShell(core, socket, config.job_queue_size, config.predict_timeout).run_forever()


def build_rolling_core(
    config: ServingConfig,
    model_path: str,
    runner: ModelRunner,
    max_model_len: int,
    eos: set[int],
    execute: Callable[[list[SequenceChunk]], StepLogits],
    world_size: int = 1,
    share_adapters: Callable[[dict[str, str]], None] = lambda folders: None,
) -> RollingBatchCore:
    """Rank 0's rolling batch over a loaded runner, as `config` sets it up: for the server's
    engine and the offline LLM alike. `execute` runs a step on every rank; `share_adapters`
    tells the other ranks where the adapters are."""
    scheduler = Scheduler(
        BlockManager(runner.num_blocks, runner.block_size, config.enable_prefix_caching),
        max_rolling_batch_size=config.max_rolling_batch_size,
        max_prefill_tokens=config.max_rolling_batch_prefill_tokens,
        max_model_len=max_model_len,
        max_loras=config.max_loras if config.enable_lora else None,
        drafter=NgramDrafter(config.speculative_length) if config.speculative_draft_model else None,
        argmax_head=runner.argmax_head,
        shortest_first=config.scheduling_policy == "shortest_first",
        adapter_weights=runner.lora.weights_digest if runner.lora is not None else None,
    )
    adapters = None
    if runner.lora is not None:
        adapters = AdapterRegistry(runner.lora, share_adapters, scheduler.blocks.forget_adapter)
    return RollingBatchCore(
        execute,
        scheduler,
        Sampler(runner.device),
        eos,
        world_size=world_size,
        adapters=adapters,
        step_trace=StepTrace(config.step_trace) if config.step_trace else None,
        grammars=GrammarCompiler(model_path, eos, config.trust_remote_code),
    )


if __name__ == "__main__":
    main()
