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
    doc: str = ""  # what the key does, for users (docs/configuration.md is written from it)


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

TOOL_CALL_PARSERS = ("hermes", "llama3_json", "mistral")
REASONING_PARSERS = ("deepseek_r1", "qwen3")

SETTINGS: tuple[Setting, ...] = (
    # server keys (plain, SERVING_*)
    Setting(
        "engine",
        "engine",
        choice("Python", "MPI"),
        INFERRED,
        doc=(
            "`MPI`: the rolling batch over MPI ranks; `Python`: one model process with dynamic "
            "batching. Inferred from option.rolling_batch, option.mpi_mode and a model dir's own "
            "handler"
        ),
    ),
    Setting(
        "batch_size",
        "batch_size",
        integer(1),
        1,
        doc=(
            "engine=Python: requests gathered into one batch (above 1 with no "
            "option.rolling_batch means dynamic batching, as in DJL's older configs)"
        ),
    ),
    Setting(
        "max_batch_delay",
        "max_batch_delay",
        integer(0),
        100,
        doc="engine=Python: milliseconds a batch waits to fill",
    ),
    Setting(
        "job_queue_size",
        "job_queue_size",
        integer(1),
        1000,
        ("MAX_CONCURRENT_REQUESTS",),
        doc="requests waiting for the engine; more get 503",
    ),
    Setting(
        "minWorkers",
        "min_workers",
        integer(1),
        1,
        (SAGEMAKER_NUM_MODEL_WORKERS,),
        doc="validated; one engine process serves",
    ),
    Setting(
        "maxWorkers",
        "max_workers",
        integer(1),
        1,
        (SAGEMAKER_NUM_MODEL_WORKERS,),
        doc="validated; one engine process serves",
    ),
    Setting("port", "port", integer(1), 8080, doc="the HTTP port"),
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
        doc="largest request body in bytes (DJL's default, 64 MiB); larger gets 413",
    ),
    # engine options (option.*, OPTION_*)
    Setting(
        "option.model_id",
        "model_id",
        text,
        None,
        ("HF_MODEL_ID",),
        doc=(
            "a local HF folder, a .gguf file, an HF hub id or s3://bucket/prefix; unset: the "
            "model dir, else the embedded SmolLM2-135M-Instruct"
        ),
    ),
    Setting(
        "option.revision",
        "revision",
        text,
        None,
        ("HF_REVISION",),
        doc="the hub revision of option.model_id",
    ),
    Setting(
        "option.task",
        "task",
        only("text-generation", "the only task lmserve serves"),
        "text-generation",
        ("HF_TASK",),
        doc="what is served; any other task is refused at start-up",
    ),
    Setting(
        "option.tensor_parallel_degree",
        "tensor_parallel_degree",
        tensor_parallel_degree,
        1,
        ("TENSOR_PARALLEL_DEGREE", "SM_NUM_GPUS"),
        doc=(
            "ranks that shard the model (`max`: all GPUs, 1 on a CPU); across hosts too "
            "(docs/multi-host.md)"
        ),
    ),
    Setting(
        "option.rolling_batch",
        "rolling_batch",
        choice("auto", *ROLLING_BATCH_ALIASES, "disable"),
        INFERRED,
        doc=(
            "`auto` (LMI's default since 0.26), `vllm`, `lmi-dist`, `scheduler`: lmserve's "
            "rolling batch; `disable`: dynamic batching with engine=Python. Inferred `disable` "
            "when batch_size > 1 is set and this key is not"
        ),
    ),
    # DJL's switch for MPI ranks; true asks for the rolling batch even with engine=Python.
    Setting(
        "option.mpi_mode",
        "mpi_mode",
        boolean,
        False,
        doc="`true` asks for the rolling batch over MPI ranks, also with engine=Python",
    ),
    Setting(
        "option.max_rolling_batch_size",
        "max_rolling_batch_size",
        integer(1),
        32,
        ("MAX_BATCH_SIZE",),
        doc="requests in flight in the rolling batch",
    ),
    Setting(
        "option.max_rolling_batch_prefill_tokens",
        "max_rolling_batch_prefill_tokens",
        integer(1),
        4096,
        ("MAX_BATCH_PREFILL_TOKENS",),
        doc=(
            "new prompt tokens a step admits; longer prompts are prefilled in chunks between "
            "decode steps"
        ),
    ),
    # Waiting prompts that arrived together (between two engine steps) prefill shortest first
    # (lower median time to first token); `fcfs` keeps their arrival order. Earlier arrivals
    # go first either way (rolling_batch/core/scheduler.py).
    Setting(
        "option.scheduling_policy",
        "scheduling_policy",
        choice("shortest_first", "fcfs"),
        "shortest_first",
        doc=(
            "the order in which waiting prompts start: those that arrived together shortest first"
            " (earlier arrivals still first), or `fcfs`"
        ),
    ),
    Setting(
        "option.paged_attention",
        "paged_attention",
        boolean,
        True,
        doc=(
            "small KV blocks allocated on demand (`true`) or one max_model_len block per request "
            "(`false`)"
        ),
    ),
    Setting("option.block_size", "block_size", integer(1), 16, doc="tokens in a KV block"),
    # None: as many blocks as the memory budget holds; a number pins the pool (tests, tuning).
    Setting(
        "option.num_kv_blocks",
        "num_kv_blocks",
        integer(1),
        None,
        doc="pins the KV pool's size in blocks; unset: as many as the memory budget holds",
    ),
    # CPU only: the share of available RAM the KV cache may take (GPU: gpu_memory_utilization).
    Setting(
        "option.cpu_kv_cache_fraction",
        "cpu_kv_cache_fraction",
        real(0.0, 1.0),
        0.25,
        doc="on CPU, the share of available RAM the KV cache may take",
    ),
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
        doc=(
            "`auto`: bf16 on CPUs that compute bf16 natively (AVX512-BF16, AMX), else fp32; the "
            "checkpoint's dtype on a GPU. `fp32` matches HF's fp32 output token for token"
        ),
    ),
    Setting(
        "option.max_model_len",
        "max_model_len",
        integer(1),
        None,
        doc="longest prompt + output; unset: the model's max positions",
    ),
    Setting(
        "option.trust_remote_code",
        "trust_remote_code",
        boolean,
        False,
        ("HF_MODEL_TRUST_REMOTE_CODE",),
        doc="run a checkpoint's own modelling code (transformers' trust_remote_code)",
    ),
    Setting(
        "option.entryPoint",
        "entry_point",
        text,
        None,
        doc=(
            "a handler file in the model dir, a dotted module, or a DJL built-in handler name "
            "(lmserve's LLM handler); unset: model.py if present (docs/custom-handlers.md)"
        ),
    ),
    # requirements.txt in the model dir is pip-installed at start-up (container/
    # requirements_install.py); false for images that bring their packages themselves.
    Setting(
        "option.install_requirements",
        "install_requirements",
        boolean,
        True,
        doc="pip-install the model dir's requirements.txt at start-up, once per content",
    ),
    Setting(
        "option.output_formatter",
        "output_formatter",
        output_formatter,
        "json",
        doc=(
            "`json`, or a stream: `jsonlines`, `sse`; or a function in model.py (`name`, "
            "`module:function`) that shapes each token"
        ),
    ),
    Setting(
        "option.tgi_compat",
        "tgi_compat",
        boolean,
        False,
        doc="TGI's answer shapes: a list, `details` on, SSE streams",
    ),
    Setting(
        "option.predict_timeout",
        "predict_timeout",
        integer(1),
        120,
        ("SAGEMAKER_MODEL_SERVER_TIMEOUT_SECONDS",),
        doc=(
            "seconds a request may wait for a place in the batch, and the engine may go without "
            "finishing a step; never bounds a generation under way"
        ),
    ),
    Setting(
        "option.model_loading_timeout",
        "model_loading_timeout",
        integer(1),
        240,
        ("SAGEMAKER_STARTUP_TIMEOUT",),
        doc="seconds the engine may take to load before start-up fails",
    ),
    # false (default): a dead engine ends the server non-zero and the platform replaces the
    # container; true: the supervisor restarts the engine in place (a few times).
    Setting(
        "option.restart_engine_on_failure",
        "restart_engine_on_failure",
        boolean,
        False,
        doc=(
            "`false`: a dead engine ends the server non-zero (the platform replaces it); `true`: "
            "the engine restarts in place, up to 3 times"
        ),
    ),
    Setting(
        "option.gpu_memory_utilization",
        "gpu_memory_utilization",
        real(0.0, 1.0),
        0.9,
        doc="on a GPU, the share of memory weights and KV cache may take",
    ),
    # Default (None): on with paged attention, as vLLM's default; the contiguous layout has
    # nothing to share (config.py refuses true with it).
    Setting(
        "option.enable_prefix_caching",
        "enable_prefix_caching",
        boolean,
        None,
        doc="automatic prefix caching of full KV blocks; unset: on with paged attention",
    ),
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
        doc="what the rolling batch does; `false` is refused",
    ),
    # Weight-only int4/int8 on the rolling batch (CPU or GPU); the methods not served are
    # refused by name rather than silently served unquantized.
    Setting(
        "option.quantize",
        "quantize",
        quantization,
        None,
        ("HF_MODEL_QUANTIZE",),
        doc=(
            "`int4`, `int8`: weight-only quantization at load; `awq`, `gptq`: the checkpoint's "
            "4-bit codes (docs/quantization.md)"
        ),
    ),
    # vLLM's model_impl: "native" lmserve's own module for the family, "transformers" the
    # generic path over the model's transformers modules, "auto" native where there is one.
    Setting(
        "option.model_impl",
        "model_impl",
        choice("auto", "native", "transformers"),
        "auto",
        doc=(
            "`native`: lmserve's module for the family; `transformers`: the generic path over the"
            " model's transformers modules; `auto`: native where there is one (docs/models.md)"
        ),
    ),
    # vLLM's load_format: "dummy" fills the weights at random from config.json alone, so a
    # model's speed can be measured without its checkpoint (benchmarks/gpu_bench.py).
    Setting(
        "option.load_format",
        "load_format",
        choice("auto", "dummy"),
        "auto",
        doc=(
            "`dummy`: random weights from config.json alone, no checkpoint read (for"
            " benchmarks; the rolling batch); `auto`: the checkpoint's"
        ),
    ),
    # vLLM's and LMI's enforce_eager. Their default is false (graphs on); lmserve's stays true
    # until its graphs are checked on a GPU (benchmarks/gpu_bench.py times both).
    Setting(
        "option.enforce_eager",
        "enforce_eager",
        boolean,
        True,
        doc=(
            "`false`: decode steps replayed from CUDA graphs captured at start-up (a GPU, tensor"
            " parallel degree 1, no LoRA); `true`: every step launched eagerly"
        ),
    ),
    # Speculative decoding, LMI's names: the draft model (only "[ngram]", prompt lookup, is
    # served) and the most tokens drafted a step.
    Setting(
        "option.speculative_draft_model",
        "speculative_draft_model",
        speculative_drafts,
        None,
        doc=(
            "`[ngram]`: speculative decoding with drafts looked up in each sequence's own tokens "
            "(docs/engines.md)"
        ),
    ),
    Setting(
        "option.speculative_length",
        "speculative_length",
        integer(1),
        5,
        doc="most tokens drafted a step",
    ),
    # What agents send (LMI's names, OPTION_ENABLE_AUTO_TOOL_CHOICE, ...): the model's own
    # tool-call text parsed into `tool_calls`, its thinking into `reasoning_content`.
    Setting(
        "option.enable_auto_tool_choice",
        "enable_auto_tool_choice",
        boolean,
        False,
        doc=(
            'chat `tool_choice: "auto"` (the default with `tools`): the model\'s tool calls '
            "parsed out of its text; needs option.tool_call_parser (docs/agents.md)"
        ),
    ),
    Setting(
        "option.tool_call_parser",
        "tool_call_parser",
        choice(*TOOL_CALL_PARSERS),
        None,
        doc="the model's tool-call format: `hermes` (Qwen, Hermes), `llama3_json`, `mistral`",
    ),
    Setting(
        "option.reasoning_parser",
        "reasoning_parser",
        choice(*REASONING_PARSERS),
        None,
        doc=(
            "`deepseek_r1` or `qwen3`: the model's `<think>` text answered as "
            "`reasoning_content`, apart from the answer"
        ),
    ),
    # LoRA adapters in <model dir>/adapters/<name>/ (PEFT folders), chosen per request.
    Setting(
        "option.enable_lora",
        "enable_lora",
        boolean,
        False,
        doc=(
            "serve the PEFT adapters in the model dir's adapters/ folder, chosen per request "
            "(docs/lora.md)"
        ),
    ),
    Setting(
        "option.max_loras", "max_loras", integer(1), 4, doc="adapters one step may mix"
    ),  # adapters in one step
    Setting(
        "option.max_lora_rank",
        "max_lora_rank",
        integer(1),
        16,
        doc="largest adapter rank; a larger one is refused",
    ),
    # Adapters kept loaded (the others are read from disk when asked for); None: max_loras.
    Setting(
        "option.max_cpu_loras",
        "max_cpu_loras",
        integer(1),
        None,
        doc=(
            "adapters kept in memory (the others are read again from disk); unset: option.max_loras"
        ),
    ),
    # A file the rolling engine appends each step's shape and phase times to, a JSON line a
    # step (benchmarks/step_floor.py reads it); unset: none is written.
    Setting(
        "option.step_trace",
        "step_trace",
        writable_file,
        None,
        doc=(
            "a file the rolling engine appends each step's shape and phase times to (benchmarks: "
            "step_floor)"
        ),
    ),
)

SETTINGS_BY_KEY = {setting.key: setting for setting in SETTINGS}


def normalized(name: str) -> str:
    """Key spelling used to match environment names: OPTION_ENTRYPOINT -> option.entryPoint,
    SERVING_MIN_WORKERS -> minWorkers."""
    return name.lower().replace("_", "")
