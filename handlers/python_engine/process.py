"""engine=Python: the engine process.
`python -m lmserve.handlers.python_engine.process RUNTIME_JSON`.

Loads the model (or the user's handler), binds the engine socket, then runs the engine shell
(rolling_batch/engine/shell.py) around dynamic batching (dynamic_core.py).
"""

from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path

import zmq

from lmserve.rolling_batch.engine.shell import EngineShell
from lmserve.rolling_batch.ipc import protocol
from lmserve.rolling_batch.ipc.runtime import Runtime, write_state

from .dynamic_batcher import DynamicBatcher
from .dynamic_core import BatchWork, DynamicBatchCore

log = logging.getLogger("lmserve.engine")


def load_hf_work(runtime: Runtime) -> tuple[BatchWork, dict]:
    from .hf_engine import HFEngine
    from .hf_work import HFGenerateWork

    config = runtime.config
    started = time.monotonic()
    engine = HFEngine.load(
        runtime.model_path,
        config.dtype,
        config.trust_remote_code,
        enable_lora=config.enable_lora,
        max_lora_rank=config.max_lora_rank,
        adapters_dir=runtime.adapters_dir,
    )
    dtype = str(engine.dtype).removeprefix("torch.")
    log.info(
        "engine=Python model %s loaded in %.1f s: dtype=%s device=%s",
        runtime.model_name,
        time.monotonic() - started,
        dtype,
        engine.device,
    )
    return HFGenerateWork(engine), {"dtype": dtype, "device": engine.device}


def load_user_handler_work(runtime: Runtime, entry_point: str) -> tuple[BatchWork, dict]:
    """The model.py's module, and DJL's load-time `handle` call with the model's options."""
    from ..custom.user_code import EntryPoint, load
    from .custom_service import UserHandlerService
    from .user_handler_work import UserHandlerWork

    model_dir = Path(runtime.model_path)
    entry = EntryPoint.from_location(entry_point)
    started = time.monotonic()
    service = UserHandlerService(load(entry, model_dir), entry_point)
    service.initialize(handler_properties(runtime))
    log.info("engine=Python handler %s loaded in %.1f s", entry_point, time.monotonic() - started)
    return UserHandlerWork(service), {"handler": entry_point}


def handler_properties(runtime: Runtime) -> dict[str, str]:
    """What DJL's load-time Input carries: the options (unknown option.* keys included: they
    are kept for custom handlers) and the model directory."""
    config = runtime.config.to_dict()
    properties = {
        key: str(value)
        for key, value in config.items()
        if value is not None and not isinstance(value, dict)
    }
    properties.update(runtime.config.extra_options)
    properties["model_dir"] = runtime.model_path
    return properties


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("runtime", help="runtime.json written by `lmserve serve`")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s engine %(levelname)s %(message)s")
    runtime = Runtime.read(args.runtime)
    config = runtime.config
    try:
        if runtime.entry_point is None:
            work, details = load_hf_work(runtime)
        else:
            work, details = load_user_handler_work(runtime, runtime.entry_point)
    except Exception as error:
        # /ping and the supervisor show why, not just an exit code; the traceback goes to the log.
        log.exception("the model failed to load")
        write_state(runtime, protocol.EngineState.FAILED, f"model failed to load: {error!r}"[:2000])
        raise SystemExit(1) from None
    log.info(
        "batch_size=%d max_batch_delay=%d ms job_queue_size=%d",
        config.batch_size,
        config.max_batch_delay,
        config.job_queue_size,
    )
    socket = zmq.Context.instance().socket(zmq.ROUTER)
    socket.bind(runtime.engine_address)
    write_state(runtime, protocol.EngineState.READY, **details)
    python_engine_shell(runtime, work, socket).run_forever()


def python_engine_shell(runtime: Runtime, work: BatchWork, socket: zmq.Socket) -> EngineShell:
    config = runtime.config
    batcher = DynamicBatcher(config.batch_size, config.max_batch_delay / 1000.0)
    core = DynamicBatchCore(work, batcher)
    return EngineShell(core, socket, config.job_queue_size, config.predict_timeout)


if __name__ == "__main__":
    main()
