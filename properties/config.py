"""serving.properties + environment -> one frozen, validated ServingConfig.

Precedence for each key, highest first (as DJL Serving's LMI container reads them;
docs/configuration.md): the file, then `OPTION_*` / `SERVING_*`, then the key's named variables
(LMI names such as `HF_MODEL_ID` and `TENSOR_PARALLEL_DEGREE`, then the TGI/SageMaker aliases
such as `SM_NUM_GPUS`), then the default. Every value remembers where it came from, for
`lmserve config`.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .engine_choice import DYNAMIC_BATCHING, choose_engine, ignored_keys
from .javaprops import PropertiesSyntaxError, parse_properties
from .settings import SETTINGS, SETTINGS_BY_KEY, normalized

log = logging.getLogger(__name__)

PROPERTIES_FILE = "serving.properties"


def default_cache_dir(environ: Mapping[str, str] | None = None) -> Path:
    """Where downloads and converted models go: $LMSERVE_CACHE_DIR, else ~/.cache/lmserve."""
    environ = os.environ if environ is None else environ
    configured = environ.get("LMSERVE_CACHE_DIR")
    return Path(configured) if configured else Path.home() / ".cache" / "lmserve"


class ConfigError(ValueError):
    """Every problem found, one per line, each naming key, value and what is allowed."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("invalid serving configuration:\n  " + "\n  ".join(problems))


@dataclass(frozen=True)
class ServingConfig:
    engine: str
    batch_size: int
    max_batch_delay: int  # ms
    job_queue_size: int
    min_workers: int
    max_workers: int
    port: int
    max_request_size: int  # bytes
    model_id: str | None
    revision: str | None
    task: str
    tensor_parallel_degree: int
    rolling_batch: str
    mpi_mode: bool
    max_rolling_batch_size: int
    max_rolling_batch_prefill_tokens: int
    scheduling_policy: str  # shortest_first or fcfs
    paged_attention: bool
    block_size: int
    num_kv_blocks: int | None
    cpu_kv_cache_fraction: float
    dtype: str
    max_model_len: int | None
    trust_remote_code: bool
    entry_point: str | None
    install_requirements: bool
    output_formatter: str
    tgi_compat: bool
    predict_timeout: int  # s
    model_loading_timeout: int  # s
    restart_engine_on_failure: bool
    gpu_memory_utilization: float
    enable_prefix_caching: bool  # resolved: the default follows paged_attention
    enable_chunked_prefill: bool
    quantize: str | None  # int4/int8 at load, awq/gptq checkpoints; the rolling batch
    model_impl: str  # auto | native | transformers (architectures.py decides what serves)
    load_format: str  # auto (the checkpoint) | dummy (random weights from config.json)
    enforce_eager: bool  # False: decode steps replayed from CUDA graphs (GPU, TP=1)
    speculative_draft_model: str | None  # "ngram" (prompt lookup) or None: no speculation
    speculative_length: int
    enable_auto_tool_choice: bool
    tool_call_parser: str | None  # hermes | llama3_json | mistral
    reasoning_parser: str | None  # deepseek_r1 | qwen3
    enable_lora: bool
    max_loras: int
    max_lora_rank: int
    max_cpu_loras: int  # resolved: the default is max_loras
    step_trace: str | None  # a file for each rolling step's shape and phase times
    # Unknown option.* keys (prefix stripped), kept for custom handlers.
    extra_options: dict[str, str] = field(default_factory=dict)

    @property
    def uses_rolling_batch(self) -> bool:
        return self.rolling_batch != "disable"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> ServingConfig:
        return cls(**values)


@dataclass(frozen=True)
class ResolvedConfig:
    config: ServingConfig
    sources: dict[str, str]  # serving.properties key -> "file line 3" | "env X" | "default" ...
    # For the start-up log: which engine serves and why (None where the config said it
    # plainly), and the keys the chosen engine never reads.
    engine_line: str | None = None
    ignored: tuple[str, ...] = ()


def load_config(
    model_dir: str | os.PathLike | None,
    environ: Mapping[str, str] | None = None,
    num_devices: int | None = None,
    max_tensor_parallel: int | None = None,
    user_handler: bool = False,
    properties: Mapping[str, str] | None = None,
) -> ResolvedConfig:
    """Reads `<model_dir>/serving.properties` (if any) and the environment; `properties`
    (serving.properties keys, the offline LLM's arguments) override both.

    `user_handler`: the model dir brings its own `handle()`, which serves with engine=Python
    and dynamic batching (a configuration that asks for the rolling batch is refused).

    `num_devices` bounds tensor_parallel_degree (None skips that check); `max` resolves to
    `max_tensor_parallel`, by default `num_devices` (on CPU the caller passes 1: "all
    devices" of a CPU is one, though more ranks may be asked for explicitly).
    """
    environ = os.environ if environ is None else environ
    file_values = _read_file(model_dir)
    file_values.update({key: (text, "argument") for key, text in (properties or {}).items()})
    raw = _merge_sources(file_values, environ)
    problems: list[str] = []
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    extra_options: dict[str, str] = {}
    for key, (text, source) in raw.items():
        setting = SETTINGS_BY_KEY.get(key)
        if setting is None:
            if key.startswith("option."):
                log.warning(
                    "unknown option %s=%r (%s): kept for custom handlers", key, text, source
                )
                extra_options[key.removeprefix("option.")] = text
                sources[key] = source
            else:
                log.warning("unknown server key %s=%r (%s): ignored", key, text, source)
            continue
        try:
            values[setting.field] = setting.parse(text)
        except ValueError as allowed:
            problems.append(f"{key}={text!r} ({source}): expected {allowed}")
            values[setting.field] = setting.default  # keeps the cross-field checks meaningful
        sources[key] = source
    for setting in SETTINGS:
        if setting.key not in sources:
            values.setdefault(setting.field, setting.default)
            sources[setting.key] = "default"
    _resolve_max_devices(values, max_tensor_parallel or num_devices)
    problems += _resolve_prefix_caching(values)
    problems += _resolve_lora_cache(values)
    engine_line = choose_engine(values, sources, user_handler)
    problems += _cross_field_problems(values, num_devices)
    if user_handler and values["rolling_batch"] != DYNAMIC_BATCHING:
        problems.append(
            f"the model dir's handler (model.py or option.entryPoint) runs with engine=Python and"
            f" dynamic batching, not the rolling batch (engine={values['engine']} from"
            f" {sources['engine']}, option.rolling_batch={values['rolling_batch']} from"
            f" {sources['option.rolling_batch']}): expected engine=Python with"
            " option.rolling_batch=disable, or no engine set"
        )
    if problems:
        raise ConfigError(problems)
    return ResolvedConfig(
        ServingConfig(**values, extra_options=extra_options),
        sources,
        engine_line,
        tuple(ignored_keys(values, sources)),
    )


def _read_file(model_dir: str | os.PathLike | None) -> dict[str, tuple[str, str]]:
    if model_dir is None:
        return {}
    path = Path(model_dir) / PROPERTIES_FILE
    if not path.is_file():
        return {}
    try:
        entries = parse_properties(path.read_text(encoding="utf-8"))
    except PropertiesSyntaxError as error:
        raise ConfigError([f"{path}: {error}"]) from None
    return {e.key: (e.value, f"{PROPERTIES_FILE} line {e.line_number}") for e in entries}


def _merge_sources(
    file_values: dict[str, tuple[str, str]], environ: Mapping[str, str]
) -> dict[str, tuple[str, str]]:
    merged: dict[str, tuple[str, str]] = {}
    known_by_normalized = {normalized(s.key): s.key for s in SETTINGS}
    # Lowest precedence first; later writes win.
    for setting in SETTINGS:
        for alias in reversed(setting.env_aliases):
            name = alias if isinstance(alias, str) else alias.name
            if environ.get(name, "") != "":
                text = environ[name] if isinstance(alias, str) else alias.translate(environ[name])
                merged[setting.key] = (text, f"env {name}")
    for name in sorted(environ):
        key = _key_for_env_name(name, known_by_normalized)
        if key is not None:
            merged[key] = (environ[name], f"env {name}")
    merged.update(file_values)
    return merged


def _key_for_env_name(name: str, known_by_normalized: dict[str, str]) -> str | None:
    if name == "OPTION_ENGINE":
        return "engine"
    if name.startswith("OPTION_") and len(name) > len("OPTION_"):
        key = "option." + name.removeprefix("OPTION_").lower()
        return known_by_normalized.get(normalized(key), key)
    if name.startswith("SERVING_") and len(name) > len("SERVING_"):
        # Only known server keys: SERVING_* is also used by unrelated tooling.
        return known_by_normalized.get(normalized(name.removeprefix("SERVING_")))
    return None


def _resolve_max_devices(values: dict[str, Any], max_degree: int | None) -> None:
    if values["tensor_parallel_degree"] == "max":
        values["tensor_parallel_degree"] = max_degree or 1


def _resolve_prefix_caching(values: dict[str, Any]) -> list[str]:
    """Prefix caching shares full KV blocks: on by default where blocks are small (paged
    attention); the contiguous layout's one block per request has nothing to share."""
    paged = values["paged_attention"]
    if values["enable_prefix_caching"] is None:
        values["enable_prefix_caching"] = paged
    elif values["enable_prefix_caching"] and not paged:
        return [
            "option.enable_prefix_caching=true with option.paged_attention=false: the"
            " contiguous layout holds one max_model_len block per request, so no block is"
            " ever full to share; expected option.paged_attention=true, or"
            " option.enable_prefix_caching=false"
        ]
    return []


def _resolve_lora_cache(values: dict[str, Any]) -> list[str]:
    """Every adapter a step uses must be loaded: the cache holds at least max_loras."""
    if values["max_cpu_loras"] is None:
        values["max_cpu_loras"] = values["max_loras"]
    elif values["max_cpu_loras"] < values["max_loras"]:
        return [
            f"option.max_cpu_loras={values['max_cpu_loras']} < option.max_loras="
            f"{values['max_loras']}: every adapter of a step is kept loaded; expected"
            f" option.max_cpu_loras >= {values['max_loras']}"
        ]
    return []


def _cross_field_problems(values: dict[str, Any], num_devices: int | None) -> list[str]:
    problems = []
    tp = values["tensor_parallel_degree"]
    if isinstance(tp, int) and num_devices is not None and tp > num_devices:
        problems.append(
            f"option.tensor_parallel_degree={tp}: only {num_devices} device(s) here;"
            f' expected an integer <= {num_devices} or "max"'
        )
    # choose_engine made engine=Python mean dynamic batching and engine=MPI the rolling batch.
    dynamic = values["rolling_batch"] == DYNAMIC_BATCHING
    if dynamic and values["engine"] == "MPI":
        problems.append(
            "option.rolling_batch='disable' with engine=MPI: the MPI engine always rolls;"
            " expected auto, scheduler, lmi-dist or vllm (or engine=Python for dynamic batching)"
        )
    elif dynamic and values["mpi_mode"]:
        problems.append(
            "option.mpi_mode=true with option.rolling_batch='disable': MPI ranks run the rolling"
            " batch; expected option.rolling_batch=auto, or option.mpi_mode=false"
        )
    elif dynamic and isinstance(tp, int) and tp > 1:
        problems.append(
            f"option.tensor_parallel_degree={tp} with option.rolling_batch='disable':"
            " tensor parallelism needs the rolling batch over MPI ranks; expected 1, or"
            " option.rolling_batch=auto"
        )
    if values["batch_size"] > 1 and not dynamic:
        problems.append(
            f"batch_size={values['batch_size']} with option.rolling_batch="
            f"{values['rolling_batch']!r}: dynamic batching and rolling batch exclude each other;"
            " expected batch_size=1 (use option.max_rolling_batch_size)"
        )
    if values["quantize"] and dynamic:
        problems.append(
            f"option.quantize={values['quantize']} with option.rolling_batch='disable':"
            " quantized weights are served by the rolling batch; expected"
            " option.rolling_batch=auto, or option.quantize unset"
        )
    if values["load_format"] == "dummy" and dynamic:
        problems.append(
            "option.load_format=dummy with option.rolling_batch='disable': random weights are"
            " served by the rolling batch; expected option.rolling_batch=auto, or"
            " option.load_format=auto"
        )
    if values["enable_auto_tool_choice"] and values["tool_call_parser"] is None:
        problems.append(
            "option.enable_auto_tool_choice=true without option.tool_call_parser: expected the"
            " model's tool-call format (hermes, llama3_json or mistral)"
        )
    if values["min_workers"] > values["max_workers"]:
        problems.append(
            f"minWorkers={values['min_workers']} > maxWorkers={values['max_workers']}:"
            " expected minWorkers <= maxWorkers"
        )
    return problems


def describe(resolved: ResolvedConfig) -> str:
    """The resolved configuration as a table: key, value, where the value came from."""
    config = resolved.config.to_dict()
    rows = [
        (setting.key, repr(config[setting.field]), resolved.sources[setting.key])
        for setting in SETTINGS
    ]
    rows += [
        (f"option.{name}", repr(value), resolved.sources[f"option.{name}"] + ", unknown: kept")
        for name, value in resolved.config.extra_options.items()
    ]
    width_key = max(len(r[0]) for r in rows)
    width_value = max(len(r[1]) for r in rows)
    return "\n".join(f"{k:<{width_key}}  {v:<{width_value}}  {s}" for k, v, s in rows)
