"""The `lmserve` command: `serve` and `config`."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from pathlib import Path

from lmserve.handlers.custom.formatters import load_formatters
from lmserve.handlers.custom.user_code import (
    EntryPoint,
    UserCodeError,
    defines_handle,
    find_entry_point,
)
from lmserve.properties.config import (
    ConfigError,
    ResolvedConfig,
    ServingConfig,
    default_cache_dir,
    describe,
    load_config,
)
from lmserve.rolling_batch.ipc.runtime import Runtime
from lmserve.rolling_batch.lora.adapters import ADAPTERS_DIR, adapters_dir
from lmserve.rolling_batch.model.weights.gguf_convert import GGUFError

from .cluster import ClusterError, num_hosts, resolve_cluster
from .host_probe import check_hosts
from .launcher import Supervisor, make_ipc_dir
from .model_store import ModelStoreError, resolve_model, served_model_dir
from .requirements_install import RequirementsError, install_requirements
from .s3_download import S3Error

log = logging.getLogger("lmserve")

SAGEMAKER_MODEL_DIR = Path("/opt/ml/model")


def default_model_dir() -> Path | None:
    return SAGEMAKER_MODEL_DIR if SAGEMAKER_MODEL_DIR.is_dir() else None


def count_gpus() -> int:
    """From /proc, so the supervisor never imports torch."""
    gpus = Path("/proc/driver/nvidia/gpus")
    return len(list(gpus.iterdir())) if gpus.is_dir() else 0


def _load(model_dir: Path | None) -> tuple[ResolvedConfig, EntryPoint | None, bool]:
    """(the configuration, the model dir's own Python if it brings some, whether that defines
    handle()). A handle() decides the engine, so the configuration is read again knowing it;
    a module without one brings formatters for the LLM handler."""
    resolved = _read_config(model_dir)
    entry = find_entry_point(resolved.config.entry_point, model_dir)
    is_handler = entry is not None and defines_handle(entry)
    if is_handler:
        resolved = _read_config(model_dir, user_handler=True)
    if resolved.engine_line is not None:
        log.info("%s", resolved.engine_line)
    for ignored in resolved.ignored:
        log.warning("%s", ignored)
    return resolved, entry, is_handler


def _read_config(model_dir: Path | None, user_handler: bool = False) -> ResolvedConfig:
    gpus = count_gpus()
    if gpus:
        return load_config(model_dir, os.environ, num_devices=gpus, user_handler=user_handler)
    # CPU: ranks are bounded by cores (one rank per core, on every host of a cluster); "max"
    # means the one CPU device.
    return load_config(
        model_dir,
        os.environ,
        num_devices=(os.cpu_count() or 1) * num_hosts(os.environ),
        max_tensor_parallel=1,
        user_handler=user_handler,
    )


def serve(args: argparse.Namespace) -> int:
    # PID 1 in a container ignores a signal it has no handler for: without one, a `docker stop`
    # while the model resolves (a download, a GGUF conversion) waits out docker's timeout for
    # its SIGKILL. Nothing is served yet, so stopping then is a clean exit; the supervisor
    # installs its own handlers once it runs.
    signal.signal(signal.SIGTERM, _stop_starting)
    model_dir = args.model_dir if args.model_dir is not None else default_model_dir()
    served = served_model_dir(model_dir)  # a model store's one model: its own folder and file
    resolved, entry, is_handler = _load(served)
    config = resolved.config
    if config.max_workers > 1:
        log.warning(
            "maxWorkers=%d: lmserve runs one engine process; on these cores more copies would"
            " only compete (raise batch_size instead)",
            config.max_workers,
        )
    if entry is not None and served is None:
        raise ConfigError([f"option.entryPoint={entry.name!r} needs a model dir (--model-dir)"])
    model = resolve_model(config, model_dir, default_cache_dir())
    if model.serving is not None:  # resolve_model refused what the rolling batch cannot run
        log.info("%s", model.serving.describe())
    if served is not None and config.install_requirements:
        _add_requirements(served)
    port = args.port if args.port is not None else config.port
    log.info(
        "engine=%s (rolling_batch=%s) dtype=%s batch_size=%d max_batch_delay=%d ms"
        " job_queue_size=%d; model %s from %s at %s",
        config.engine,
        config.rolling_batch,
        config.dtype,
        config.batch_size,
        config.max_batch_delay,
        config.job_queue_size,
        model.name,
        model.source,
        model.path,
    )
    formatters = entry.location if entry is not None and not is_handler else None
    # Loaded here first, so that a broken model.py or formatter name stops start-up clearly.
    user_dir = str(served) if served is not None else None
    load_formatters(formatters, user_dir, config.output_formatter)
    adapters = _adapters_dir(config, served, model.path)
    runtime = Runtime(
        config,
        model.name,
        str(model.path),
        model.source,
        make_ipc_dir(),
        entry_point=entry.location if is_handler else None,
        formatters=formatters,
        user_dir=user_dir,
        adapters_dir=adapters,
        hosts=_hosts(config, model.path, adapters),
    )
    return Supervisor(runtime, args.host, port).run()


def _hosts(config: ServingConfig, model_path: Path, adapters: str | None) -> list[list] | None:
    """engine=MPI over several hosts (container/cluster.py): the hosts, each checked first
    (the model's files and the start-up adapters' among what must be the same)."""
    if config.engine != "MPI":
        return None
    cluster = resolve_cluster(os.environ, config.tensor_parallel_degree)
    if cluster is None:
        return None
    check_hosts(cluster, model_path, adapters_dir=None if adapters is None else Path(adapters))
    layout = ", ".join(f"{host} ({ranks} ranks)" for host, ranks in cluster.hosts)
    log.info("engine=MPI over %d hosts from %s: %s", len(cluster.hosts), cluster.source, layout)
    return [[host, ranks] for host, ranks in cluster.hosts]


def _adapters_dir(config: ServingConfig, served: Path | None, model_path: Path) -> str | None:
    if not config.enable_lora:
        return None
    folder = adapters_dir(served, model_path)
    log.info("LoRA adapters: %s", folder or f"none yet (no {ADAPTERS_DIR}/ in the model dir)")
    return None if folder is None else str(folder)


def _add_requirements(model_dir: Path) -> None:
    """The model dir's requirements.txt, installed (once) where the processes about to start
    find it: they inherit PYTHONPATH."""
    site_packages = install_requirements(model_dir, default_cache_dir())
    if site_packages is not None:
        paths = [str(site_packages), os.environ.get("PYTHONPATH", "")]
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)


def show_config(args: argparse.Namespace) -> int:
    model_dir = args.model_dir if args.model_dir is not None else default_model_dir()
    print(describe(_load(served_model_dir(model_dir))[0]))
    return 0


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The `lmserve` parser; `command` is the subcommand about to run (the bench subcommand's
    own arguments are added only for it)."""
    parser = argparse.ArgumentParser(prog="lmserve", description="LLM serving container")
    commands = parser.add_subparsers(dest="command", required=True)
    serve_parser = commands.add_parser("serve", help="serve /ping and /invocations")
    serve_parser.add_argument(
        "--model-dir", type=Path, help="folder with serving.properties and/or the model"
    )
    serve_parser.add_argument("--host", default="0.0.0.0")
    serve_parser.add_argument("--port", type=int, help="default: the port setting, 8080")
    serve_parser.set_defaults(run=serve)
    config_parser = commands.add_parser(
        "config", help="print the resolved configuration and where each value came from"
    )
    config_parser.add_argument("--model-dir", type=Path)
    config_parser.set_defaults(run=show_config)
    bench_parser = commands.add_parser(
        "bench", help="load-test servers: throughput, TTFT, latency; table, JSON, plots"
    )
    if command == "bench":
        # Only `lmserve bench` imports the benchmarks (load generator, plots): a server needs
        # none of it, and a broken or missing benchmark dependency must not stop `serve`.
        from lmserve.benchmarks import bench_cli

        bench_cli.add_arguments(bench_parser)
        bench_parser.set_defaults(run=bench_cli.run)
    return parser


def _stop_starting(signum: int, _frame) -> None:
    log.info("stopped (signal %d) before the server started", signum)
    raise SystemExit(0)


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    argv = sys.argv[1:] if argv is None else argv
    command = next((arg for arg in argv if not arg.startswith("-")), None)
    args = build_parser(command).parse_args(argv)
    try:
        sys.exit(args.run(args))
    except (
        ConfigError,
        ModelStoreError,
        S3Error,
        GGUFError,
        UserCodeError,
        RequirementsError,
        ClusterError,
    ) as error:
        log.error("%s", error)
        sys.exit(2)


if __name__ == "__main__":
    main()
