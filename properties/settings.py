"""The table of known serving.properties keys: how each is parsed, its default, and which
environment variables may set it. Parsers raise ValueError with the allowed values; the loader
turns that into one message naming key and value."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class EnvAlias:
    """An environment name whose value is in other units than its key's: `translate` turns the
    variable's text into the key's (SAGEMAKER_MAX_PAYLOAD_IN_MB is MiB, max_request_size bytes).
    Text it cannot translate is passed on as it is, so the key's parser names the problem."""

    name: str
    translate: Callable[[str], str]


@dataclass(frozen=True)
class Setting:
    key: str  # as written in serving.properties, e.g. "batch_size" or "option.dtype"
    field: str  # ServingConfig attribute
    parse: Callable[[str], Any]
    default: Any  # INFERRED: decided from other settings after parsing
    # Environment names after OPTION_*/SERVING_*, in precedence order (LMI names, then TGI's
    # and SageMaker's).
    env_aliases: tuple[str | EnvAlias, ...] = ()


INFERRED = object()


def integer(minimum: int | None = None) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text.strip())
        except ValueError:
            raise ValueError(
                "an integer" + (f" >= {minimum}" if minimum is not None else "")
            ) from None
        if minimum is not None and value < minimum:
            raise ValueError(f"an integer >= {minimum}")
        return value

    return parse


def real(low: float, high: float, low_open: bool = True) -> Callable[[str], float]:
    bracket = "(" if low_open else "["

    def parse(text: str) -> float:
        allowed = f"a number in {bracket}{low}, {high}]"
        try:
            value = float(text.strip())
        except ValueError:
            raise ValueError(allowed) from None
        if not (low < value <= high if low_open else low <= value <= high):
            raise ValueError(allowed)
        return value

    return parse


def boolean(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    raise ValueError("true or false")


def choice(*allowed: str, aliases: dict[str, str] | None = None) -> Callable[[str], str]:
    """Case-insensitive; returns the canonical spelling."""
    canonical = {name.lower(): name for name in allowed}
    canonical.update({k.lower(): v for k, v in (aliases or {}).items()})

    def parse(text: str) -> str:
        try:
            return canonical[text.strip().lower()]
        except KeyError:
            raise ValueError("one of " + ", ".join(allowed)) from None

    return parse


def text(value: str) -> str:
    return value.strip()


def writable_file(text_value: str) -> str:
    """A file path whose folder exists and may be written (the file itself is appended to)."""
    path = text_value.strip()
    folder = os.path.dirname(os.path.abspath(path))
    if not path or not os.path.isdir(folder) or not os.access(folder, os.W_OK):
        raise ValueError("a file path in an existing folder this server may write to")
    return path


def tensor_parallel_degree(text_value: str) -> int | str:
    if text_value.strip().lower() == "max":
        return "max"
    try:
        return integer(1)(text_value)
    except ValueError:
        raise ValueError('an integer >= 1 or "max"') from None


def output_formatter(text_value: str) -> str:
    value = text_value.strip()
    module, _, function = value.rpartition(":")
    dotted = all(part.isidentifier() for part in module.split(".")) if module else True
    if value in ("json", "jsonlines", "sse") or (function.isidentifier() and dotted):
        return value
    raise ValueError("json, jsonlines, sse, a function in model.py, or <module>:<function>")


def speculative_drafts(text_value: str) -> str | None:
    """vLLM's (and so LMI's) spelling of n-gram drafts is "[ngram]"; "ngram" is taken too."""
    value = text_value.strip().lower()
    if value == "":
        return None
    if value in ("[ngram]", "ngram"):
        return "ngram"
    raise ValueError(
        '"[ngram]" (drafts looked up in the sequence\'s own tokens) or unset; draft models'
        " are not served"
    )


def quantization(text_value: str) -> str | None:
    method = text_value.strip().lower()
    if method == "":
        return None
    if method in ("int4", "int8", "awq", "gptq"):
        return method
    raise ValueError(
        "int4 or int8 (weight-only, quantized at load), awq or gptq (the checkpoint's own 4-bit"
        " weights), or unset; fp8 and other methods are not served"
    )


def only(allowed: str, why: str) -> Callable[[str], str]:
    """One accepted value (case-insensitive): what lmserve does; anything else is refused with
    `why` instead of being parsed and silently ignored."""

    def parse(text_value: str) -> str:
        if text_value.strip().lower() == allowed.lower():
            return allowed
        raise ValueError(f"{allowed} ({why})")

    return parse


def only_boolean(allowed: bool, why: str) -> Callable[[str], bool]:
    def parse(text_value: str) -> bool:
        if boolean(text_value) == allowed:
            return allowed
        raise ValueError(f"{str(allowed).lower()} ({why})")

    return parse


def mebibytes_as_bytes(text_value: str) -> str:
    try:
        return str(int(text_value.strip()) * 1024 * 1024)
    except ValueError:
        return text_value


ROLLING_BATCH_ALIASES = ("scheduler", "lmi-dist", "vllm")

# The SageMaker names DJL translates (wlm/.../util/SageMakerCompatibility.java). DJL lets them
# override serving.properties; here, like the other aliases, they apply only where neither the
# file nor an OPTION_*/SERVING_* variable sets the key.
SAGEMAKER_NUM_MODEL_WORKERS = "SAGEMAKER_NUM_MODEL_WORKERS"  # both minWorkers and maxWorkers

SETTINGS: tuple[Setting, ...] = (
    # server keys (plain, SERVING_*)
    Setting("engine", "engine", choice("Python", "MPI"), INFERRED),
    Setting("batch_size", "batch_size", integer(1), 1),
    Setting("max_batch_delay", "max_batch_delay", integer(0), 100),
    Setting("job_queue_size", "job_queue_size", integer(1), 1000, ("MAX_CONCURRENT_REQUESTS",)),
    Setting("minWorkers", "min_workers", integer(1), 1, (SAGEMAKER_NUM_MODEL_WORKERS,)),
    Setting("maxWorkers", "max_workers", integer(1), 1, (SAGEMAKER_NUM_MODEL_WORKERS,)),
    Setting("port", "port", integer(1), 8080),
    # Bytes; DJL's ConfigManager default (DEF_MAX_REQUEST_SIZE = 64 * 1024 * 1024).
    Setting(
        "max_request_size",
        "max_request_size",
        integer(1),
        64 * 1024 * 1024,
        # Bytes, else MiB; DJL too prefers SAGEMAKER_MAX_REQUEST_SIZE when both are set.
        (
            "SAGEMAKER_MAX_REQUEST_SIZE",
            EnvAlias("SAGEMAKER_MAX_PAYLOAD_IN_MB", mebibytes_as_bytes),
        ),
    ),
    # engine options (option.*, OPTION_*)
    Setting("option.model_id", "model_id", text, None, ("HF_MODEL_ID",)),
    Setting("option.revision", "revision", text, None, ("HF_REVISION",)),
    Setting(
        "option.task",
        "task",
        only("text-generation", "the only task lmserve serves"),
        "text-generation",
        ("HF_TASK",),
    ),
    Setting(
        "option.tensor_parallel_degree",
        "tensor_parallel_degree",
        tensor_parallel_degree,
        1,
        ("TENSOR_PARALLEL_DEGREE", "SM_NUM_GPUS"),
    ),
    Setting(
        "option.rolling_batch",
        "rolling_batch",
        choice("auto", *ROLLING_BATCH_ALIASES, "disable"),
        INFERRED,
    ),
    # DJL's switch for MPI ranks; true asks for the rolling batch even with engine=Python.
    Setting("option.mpi_mode", "mpi_mode", boolean, False),
    Setting(
        "option.max_rolling_batch_size",
        "max_rolling_batch_size",
        integer(1),
        32,
        ("MAX_BATCH_SIZE",),
    ),
    Setting(
        "option.max_rolling_batch_prefill_tokens",
        "max_rolling_batch_prefill_tokens",
        integer(1),
        4096,
        ("MAX_BATCH_PREFILL_TOKENS",),
    ),
    # Waiting prompts that arrived together (between two engine steps) prefill shortest first
    # (lower median time to first token); `fcfs` keeps their arrival order. Earlier arrivals
    # go first either way (rolling_batch/scheduler.py).
    Setting(
        "option.scheduling_policy",
        "scheduling_policy",
        choice("shortest_first", "fcfs"),
        "shortest_first",
    ),
    Setting("option.paged_attention", "paged_attention", boolean, True),
    Setting("option.block_size", "block_size", integer(1), 16),
    # None: as many blocks as the memory budget holds; a number pins the pool (tests, tuning).
    Setting("option.num_kv_blocks", "num_kv_blocks", integer(1), None),
    # CPU only: the share of available RAM the KV cache may take (GPU: gpu_memory_utilization).
    Setting("option.cpu_kv_cache_fraction", "cpu_kv_cache_fraction", real(0.0, 1.0), 0.25),
    Setting(
        "option.dtype",
        "dtype",
        choice(
            "fp32",
            "fp16",
            "bf16",
            "auto",
            aliases={"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"},
        ),
        "auto",
    ),
    Setting("option.max_model_len", "max_model_len", integer(1), None),
    Setting(
        "option.trust_remote_code",
        "trust_remote_code",
        boolean,
        False,
        ("HF_MODEL_TRUST_REMOTE_CODE",),
    ),
    Setting("option.entryPoint", "entry_point", text, None),
    # requirements.txt in the model dir is pip-installed at start-up (container/
    # requirements_install.py); false for images that bring their packages themselves.
    Setting("option.install_requirements", "install_requirements", boolean, True),
    Setting("option.output_formatter", "output_formatter", output_formatter, "json"),
    Setting("option.tgi_compat", "tgi_compat", boolean, False),
    Setting(
        "option.predict_timeout",
        "predict_timeout",
        integer(1),
        120,
        ("SAGEMAKER_MODEL_SERVER_TIMEOUT_SECONDS",),
    ),
    Setting(
        "option.model_loading_timeout",
        "model_loading_timeout",
        integer(1),
        240,
        ("SAGEMAKER_STARTUP_TIMEOUT",),
    ),
    # false (default): a dead engine ends the server non-zero and the platform replaces the
    # container; true: the supervisor restarts the engine in place (a few times).
    Setting("option.restart_engine_on_failure", "restart_engine_on_failure", boolean, False),
    Setting("option.gpu_memory_utilization", "gpu_memory_utilization", real(0.0, 1.0), 0.9),
    # Default (None): on with paged attention, as vLLM's default; the contiguous layout has
    # nothing to share (config.py refuses true with it).
    Setting("option.enable_prefix_caching", "enable_prefix_caching", boolean, None),
    # The default says what lmserve does (vLLM's default is true too): the other value is
    # refused rather than parsed and ignored.
    Setting(
        "option.enable_chunked_prefill",
        "enable_chunked_prefill",
        only_boolean(
            True,
            "the rolling batch always prefills prompts longer than"
            " option.max_rolling_batch_prefill_tokens in chunks, between decode steps",
        ),
        True,
    ),
    # Weight-only int4/int8 on the rolling batch (CPU or GPU); the methods not served are
    # refused by name rather than silently served unquantized.
    Setting("option.quantize", "quantize", quantization, None, ("HF_MODEL_QUANTIZE",)),
    # vLLM's model_impl: "native" lmserve's own module for the family, "transformers" the
    # generic path over the model's transformers modules, "auto" native where there is one.
    Setting("option.model_impl", "model_impl", choice("auto", "native", "transformers"), "auto"),
    # Speculative decoding, LMI's names: the draft model (only "[ngram]", prompt lookup, is
    # served) and the most tokens drafted a step.
    Setting("option.speculative_draft_model", "speculative_draft_model", speculative_drafts, None),
    Setting("option.speculative_length", "speculative_length", integer(1), 5),
    # LoRA adapters in <model dir>/adapters/<name>/ (PEFT folders), chosen per request.
    Setting("option.enable_lora", "enable_lora", boolean, False),
    Setting("option.max_loras", "max_loras", integer(1), 4),  # adapters in one step
    Setting("option.max_lora_rank", "max_lora_rank", integer(1), 16),
    # Adapters kept loaded (the others are read from disk when asked for); None: max_loras.
    Setting("option.max_cpu_loras", "max_cpu_loras", integer(1), None),
    # A file the rolling engine appends each step's shape and phase times to, a JSON line a
    # step (benchmarks/step_floor.py reads it); unset: none is written.
    Setting("option.step_trace", "step_trace", writable_file, None),
)

SETTINGS_BY_KEY = {setting.key: setting for setting in SETTINGS}


def normalized(name: str) -> str:
    """Key spelling used to match environment names: OPTION_ENTRYPOINT -> option.entryPoint,
    SERVING_MIN_WORKERS -> minWorkers."""
    return name.lower().replace("_", "")
