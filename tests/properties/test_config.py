"""load_config: serving.properties + environment -> one validated ServingConfig, with the source
of every value (docs/configuration.md, as DJL Serving's LMI container reads them)."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import pytest

from lmserve.properties.config import ConfigError, ResolvedConfig, ServingConfig, load_config
from lmserve.properties.settings import SETTINGS

CONFIG_LOGGER = "lmserve.properties.config"


def write(model_dir: Path, text: str) -> Path:
    (model_dir / "serving.properties").write_text(text, encoding="utf-8")
    return model_dir


def load(
    model_dir: Path,
    text: str | None = None,
    environ: dict[str, str] | None = None,
    num_devices: int | None = None,
) -> ResolvedConfig:
    if text is not None:
        write(model_dir, text)
    return load_config(model_dir, environ or {}, num_devices=num_devices)


def problems_of(model_dir: Path, text: str = "", environ=None, num_devices=None) -> list[str]:
    with pytest.raises(ConfigError) as caught:
        load(model_dir, text, environ, num_devices)
    return caught.value.problems


# --- defaults -------------------------------------------------------------------------------

# The contract's table, with LMI's default since 0.26 (option.rolling_batch=auto for every
# engine, so no engine configured means the rolling batch over MPI ranks) and the values that
# say what lmserve does (prefix caching on with paged attention, as vLLM's).
CONTRACT_DEFAULTS = {
    "engine": "MPI",
    "batch_size": 1,
    "max_batch_delay": 100,
    "job_queue_size": 1000,
    "min_workers": 1,
    "max_workers": 1,
    "port": 8080,
    "max_request_size": 64 * 1024 * 1024,  # DJL ConfigManager's DEF_MAX_REQUEST_SIZE
    "model_id": None,  # the model dir itself, decided by the model store
    "revision": None,
    "task": "text-generation",
    "tensor_parallel_degree": 1,
    "rolling_batch": "auto",
    "mpi_mode": False,
    "max_rolling_batch_size": 32,
    "max_rolling_batch_prefill_tokens": 4096,
    "scheduling_policy": "shortest_first",
    "paged_attention": True,
    "block_size": 16,
    "num_kv_blocks": None,
    "cpu_kv_cache_fraction": 0.25,
    "restart_engine_on_failure": False,
    "dtype": "auto",
    "max_model_len": None,  # the model's max positions
    "trust_remote_code": False,
    "entry_point": None,
    "install_requirements": True,
    "output_formatter": "json",
    "tgi_compat": False,
    "predict_timeout": 120,
    "model_loading_timeout": 240,
    "gpu_memory_utilization": 0.9,
    "enable_prefix_caching": True,
    "enable_chunked_prefill": True,
    "quantize": None,
    "model_impl": "auto",  # vLLM's default: native where the family has a module
    "load_format": "auto",  # the checkpoint's weights
    "enforce_eager": True,  # until lmserve's CUDA graphs are checked on a GPU (LMI: false)
    "speculative_draft_model": None,
    "speculative_length": 5,
    # LMI's: tool calls are read only when turned on with the model's format.
    "enable_auto_tool_choice": False,
    "tool_call_parser": None,
    "reasoning_parser": None,
    "enable_lora": False,
    "max_loras": 4,
    "max_lora_rank": 16,
    "max_cpu_loras": 4,
    "step_trace": None,
    "extra_options": {},
}


@pytest.mark.parametrize("with_folder", [False, True])
def test_defaults_match_the_contract(tmp_path, with_folder):
    resolved = load_config(tmp_path if with_folder else None, {}, num_devices=4)
    assert resolved.config.to_dict() == CONTRACT_DEFAULTS
    assert resolved.config.uses_rolling_batch is True


def test_default_sources(tmp_path):
    sources = load_config(tmp_path, {}).sources
    assert set(sources) == {setting.key for setting in SETTINGS}
    assert sources["engine"] == "inferred from option.rolling_batch"
    assert sources["option.rolling_batch"] == "default (LMI's since 0.26)"
    others = {key: sources[key] for key in sources if key not in ("engine", "option.rolling_batch")}
    assert len(others) == len(SETTINGS) - 2
    assert set(others.values()) == {"default"}


def test_empty_properties_file_gives_the_defaults(tmp_path):
    assert load(tmp_path, "# nothing set\n\n").config.to_dict() == CONTRACT_DEFAULTS


def test_a_folder_named_serving_properties_is_not_read(tmp_path):
    (tmp_path / "serving.properties").mkdir()
    assert load_config(tmp_path, {}).config.to_dict() == CONTRACT_DEFAULTS


# --- keys from the file ---------------------------------------------------------------------


def test_plain_server_keys_from_the_file(tmp_path):
    resolved = load(
        tmp_path,
        "engine=Python\n"
        "batch_size=4\n"
        "max_batch_delay = 250\n"
        "job_queue_size: 77\n"
        "minWorkers 2\n"
        "maxWorkers=3\n"
        "port=9000\n"
        "max_request_size=1024\n",
    )
    config = resolved.config
    assert (config.engine, config.batch_size, config.max_batch_delay) == ("Python", 4, 250)
    assert (config.job_queue_size, config.min_workers, config.max_workers) == (77, 2, 3)
    assert (config.port, config.max_request_size) == (9000, 1024)
    assert [resolved.sources[key] for key in ("engine", "minWorkers", "max_request_size")] == [
        "serving.properties line 1",
        "serving.properties line 5",
        "serving.properties line 8",
    ]


@pytest.mark.parametrize(
    ("line", "field", "value"),
    [
        ("option.model_id=s3://bucket/prefix/", "model_id", "s3://bucket/prefix/"),
        ("option.model_id = org/model  ", "model_id", "org/model"),
        ("option.revision=abc123", "revision", "abc123"),
        ("option.task=text-generation", "task", "text-generation"),
        ("option.task=Text-Generation", "task", "text-generation"),
        ("option.mpi_mode=true", "mpi_mode", True),
        ("option.tensor_parallel_degree=1", "tensor_parallel_degree", 1),
        ("option.rolling_batch=disable", "rolling_batch", "disable"),
        ("option.max_rolling_batch_size=64", "max_rolling_batch_size", 64),
        ("option.max_rolling_batch_prefill_tokens=512", "max_rolling_batch_prefill_tokens", 512),
        ("option.scheduling_policy=FCFS", "scheduling_policy", "fcfs"),
        ("option.paged_attention=false", "paged_attention", False),
        ("option.paged_attention=FALSE", "paged_attention", False),
        ("option.dtype=fp16", "dtype", "fp16"),
        ("option.dtype=bf16", "dtype", "bf16"),
        ("option.dtype=fp32", "dtype", "fp32"),
        ("option.dtype=BF16", "dtype", "bf16"),
        ("option.dtype=float16", "dtype", "fp16"),
        ("option.dtype=bfloat16", "dtype", "bf16"),
        ("option.dtype=float32", "dtype", "fp32"),
        ("option.max_model_len=2048", "max_model_len", 2048),
        ("option.trust_remote_code=true", "trust_remote_code", True),
        ("option.trust_remote_code=True", "trust_remote_code", True),
        ("option.entryPoint=my_model.py", "entry_point", "my_model.py"),
        ("option.output_formatter=jsonlines", "output_formatter", "jsonlines"),
        ("option.output_formatter=sse", "output_formatter", "sse"),
        ("option.output_formatter=my_formatter", "output_formatter", "my_formatter"),
        ("option.output_formatter=fmt.text:shape", "output_formatter", "fmt.text:shape"),
        ("option.tgi_compat=true", "tgi_compat", True),
        ("option.predict_timeout=30", "predict_timeout", 30),
        ("option.model_loading_timeout=1200", "model_loading_timeout", 1200),
        ("option.gpu_memory_utilization=0.5", "gpu_memory_utilization", 0.5),
        ("option.gpu_memory_utilization=1", "gpu_memory_utilization", 1.0),
        ("option.enable_prefix_caching=false", "enable_prefix_caching", False),
        ("option.enable_prefix_caching=true", "enable_prefix_caching", True),
        ("option.paged_attention=false", "enable_prefix_caching", False),
        ("option.enable_chunked_prefill=true", "enable_chunked_prefill", True),
        ("option.quantize=", "quantize", None),
        ("option.quantize=INT4", "quantize", "int4"),
        ("option.quantize=int8", "quantize", "int8"),
        ("option.quantize=AWQ", "quantize", "awq"),
        ("option.quantize=gptq", "quantize", "gptq"),
        ("option.speculative_draft_model=[ngram]", "speculative_draft_model", "ngram"),
        ("option.speculative_draft_model=NGRAM", "speculative_draft_model", "ngram"),
        ("option.speculative_length=3", "speculative_length", 3),
        ("option.enable_lora=true", "enable_lora", True),
        ("option.max_loras=8", "max_loras", 8),
        ("option.max_lora_rank=64", "max_lora_rank", 64),
        ("option.max_loras=8", "max_cpu_loras", 8),  # follows max_loras unless set
        ("option.max_cpu_loras=10", "max_cpu_loras", 10),
        ("option.step_trace=/tmp/steps.jsonl", "step_trace", "/tmp/steps.jsonl"),
        ("batch_size = 2   ", "batch_size", 2),  # trailing spaces around numbers are fine
    ],
)
def test_option_keys_reach_their_field_with_the_prefix_stripped(tmp_path, line, field, value):
    resolved = load(tmp_path, "# header\n" + line + "\n")
    assert getattr(resolved.config, field) == value
    assert resolved.sources[line.split("=")[0].strip()] == "serving.properties line 2"
    assert resolved.config.extra_options == {}


def test_engine_and_rolling_batch_names_are_case_insensitive(tmp_path):
    config = load(tmp_path, "engine=mpi\noption.rolling_batch=LMI-DIST\n").config
    assert (config.engine, config.rolling_batch) == ("MPI", "lmi-dist")
    config = load(tmp_path, "engine=python\noption.rolling_batch=DISABLE\n").config
    assert (config.engine, config.rolling_batch) == ("Python", "disable")


def test_unknown_option_is_kept_with_a_warning(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger=CONFIG_LOGGER):
        resolved = load(tmp_path, "option.dtype=fp16\noption.my_custom_flag = on and off\n")
    assert resolved.config.extra_options == {"my_custom_flag": "on and off"}
    assert resolved.sources["option.my_custom_flag"] == "serving.properties line 2"
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "option.my_custom_flag" in warnings[0] and "on and off" in warnings[0]
    assert "serving.properties line 2" in warnings[0]


def test_unknown_option_keeps_its_raw_text(tmp_path):
    resolved = load(tmp_path, "option.prompt_prefix = You are  helpful.  \n")
    assert resolved.config.extra_options == {"prompt_prefix": "You are  helpful.  "}


def test_unknown_plain_key_is_ignored_with_a_warning(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger=CONFIG_LOGGER):
        resolved = load(tmp_path, "batch_size=2\nfancy_server_knob=7\n")
    assert resolved.config.batch_size == 2
    assert resolved.config.extra_options == {}
    assert "fancy_server_knob" not in resolved.sources
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("fancy_server_knob" in message for message in warnings)


def test_known_keys_give_no_warning(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger=CONFIG_LOGGER):
        load(tmp_path, "engine=MPI\noption.dtype=bf16\n", {"OPTION_MAX_MODEL_LEN": "1024"})
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []


def test_duplicate_key_the_later_line_wins(tmp_path):
    resolved = load(tmp_path, "batch_size=2\nport=1\nbatch_size=3\n")
    assert resolved.config.batch_size == 3
    assert resolved.sources["batch_size"] == "serving.properties line 3"


def test_continued_and_escaped_values_reach_the_config(tmp_path):
    resolved = load(
        tmp_path,
        "# model\n"
        "option.model_id = s3://my-bucket/\\\n"
        "                  models/llama/\n"
        "option.entryPoint=\\u006dodel.py\n",
    )
    assert resolved.config.model_id == "s3://my-bucket/models/llama/"
    assert resolved.config.entry_point == "model.py"
    assert resolved.sources["option.model_id"] == "serving.properties line 2"
    assert resolved.sources["option.entryPoint"] == "serving.properties line 4"


def test_syntax_error_in_the_file_is_a_config_error_naming_file_and_line(tmp_path):
    problems = problems_of(tmp_path, "engine=MPI\noption.dtype=\\u00zz\n")
    assert len(problems) == 1
    assert "serving.properties" in problems[0] and "line 2" in problems[0]


# --- environment ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "text", "field", "value", "key"),
    [
        ("OPTION_MAX_ROLLING_BATCH_SIZE", "48", "max_rolling_batch_size", 48, None),
        ("OPTION_DTYPE", "fp16", "dtype", "fp16", None),
        ("OPTION_MODEL_ID", "org/model", "model_id", "org/model", None),
        ("OPTION_TRUST_REMOTE_CODE", "true", "trust_remote_code", True, None),
        ("OPTION_ENTRYPOINT", "custom.py", "entry_point", "custom.py", "option.entryPoint"),
        ("OPTION_ENGINE", "MPI", "engine", "MPI", "engine"),
        ("SERVING_MIN_WORKERS", "1", "min_workers", 1, "minWorkers"),
        ("SERVING_MAX_WORKERS", "4", "max_workers", 4, "maxWorkers"),
        ("SERVING_JOB_QUEUE_SIZE", "10", "job_queue_size", 10, "job_queue_size"),
        ("SERVING_BATCH_SIZE", "8", "batch_size", 8, "batch_size"),
        ("SERVING_MAX_BATCH_DELAY", "5", "max_batch_delay", 5, "max_batch_delay"),
        ("SERVING_PORT", "8443", "port", 8443, "port"),
        ("HF_MODEL_ID", "org/model", "model_id", "org/model", "option.model_id"),
        ("HF_REVISION", "v2", "revision", "v2", "option.revision"),
        ("HF_TASK", "text-generation", "task", "text-generation", "option.task"),
        ("MAX_BATCH_SIZE", "16", "max_rolling_batch_size", 16, None),
        ("MAX_BATCH_PREFILL_TOKENS", "1000", "max_rolling_batch_prefill_tokens", 1000, None),
        ("MAX_CONCURRENT_REQUESTS", "64", "job_queue_size", 64, "job_queue_size"),
        ("HF_MODEL_TRUST_REMOTE_CODE", "true", "trust_remote_code", True, None),
        ("SAGEMAKER_STARTUP_TIMEOUT", "600", "model_loading_timeout", 600, None),
        ("SAGEMAKER_MODEL_SERVER_TIMEOUT_SECONDS", "240", "predict_timeout", 240, None),
        ("SAGEMAKER_MAX_REQUEST_SIZE", "1000", "max_request_size", 1000, "max_request_size"),
        (
            "SAGEMAKER_MAX_PAYLOAD_IN_MB",
            "10",
            "max_request_size",
            10 * 1024 * 1024,
            "max_request_size",
        ),
    ],
)
def test_environment_variable_sets_its_key(tmp_path, name, text, field, value, key):
    resolved = load_config(tmp_path, {name: text}, num_devices=4)
    assert getattr(resolved.config, field) == value
    key = key or "option." + field
    assert resolved.sources[key] == f"env {name}"
    assert resolved.config.extra_options == {}


@pytest.mark.parametrize("name", ["TENSOR_PARALLEL_DEGREE", "SM_NUM_GPUS"])
def test_tensor_parallel_degree_from_lmi_and_sagemaker_names(name):
    resolved = load_config(None, {name: "2"}, num_devices=4)
    assert resolved.config.tensor_parallel_degree == 2
    assert resolved.config.engine == "MPI"  # more than one rank needs the MPI engine
    assert resolved.sources["option.tensor_parallel_degree"] == f"env {name}"


def test_sagemaker_num_model_workers_sets_min_and_max_workers():
    resolved = load_config(None, {"SAGEMAKER_NUM_MODEL_WORKERS": "2"})
    assert (resolved.config.min_workers, resolved.config.max_workers) == (2, 2)
    assert resolved.sources["minWorkers"] == "env SAGEMAKER_NUM_MODEL_WORKERS"
    assert resolved.sources["maxWorkers"] == "env SAGEMAKER_NUM_MODEL_WORKERS"


def test_sagemaker_max_request_size_wins_over_max_payload_in_mb():
    environ = {"SAGEMAKER_MAX_REQUEST_SIZE": "5000", "SAGEMAKER_MAX_PAYLOAD_IN_MB": "10"}
    resolved = load_config(None, environ)
    assert resolved.config.max_request_size == 5000
    assert resolved.sources["max_request_size"] == "env SAGEMAKER_MAX_REQUEST_SIZE"


def test_hf_model_id_alone_deploys_without_a_properties_file():
    resolved = load_config(
        None, {"HF_MODEL_ID": "HuggingFaceTB/SmolLM2-135M", "HF_REVISION": "main"}
    )
    assert resolved.config.model_id == "HuggingFaceTB/SmolLM2-135M"
    assert resolved.config.revision == "main"
    assert resolved.sources["option.model_id"] == "env HF_MODEL_ID"


def test_unknown_option_env_is_kept_lower_cased(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger=CONFIG_LOGGER):
        resolved = load_config(tmp_path, {"OPTION_FOO_BAR": "Baz"})
    assert resolved.config.extra_options == {"foo_bar": "Baz"}
    assert resolved.sources["option.foo_bar"] == "env OPTION_FOO_BAR"
    assert any("option.foo_bar" in r.getMessage() for r in caplog.records)


def test_option_engine_is_the_engine_not_an_option(tmp_path):
    resolved = load_config(tmp_path, {"OPTION_ENGINE": "MPI"})
    assert resolved.config.engine == "MPI"
    assert resolved.config.rolling_batch == "auto"
    assert "engine" not in resolved.config.extra_options


def test_unrelated_environment_variables_are_ignored(tmp_path, caplog):
    environ = {
        "PATH": "/usr/bin",
        "HOME": "/root",
        "SERVING_UNRELATED_TOOL": "x",
        "SERVING_": "y",
        "OPTION_": "z",
        "BATCH_SIZE": "9",
        "DTYPE": "fp8",
    }
    with caplog.at_level(logging.WARNING, logger=CONFIG_LOGGER):
        resolved = load_config(tmp_path, environ)
    assert resolved.config.to_dict() == CONTRACT_DEFAULTS
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []


# --- precedence -----------------------------------------------------------------------------


def test_file_wins_over_option_env(tmp_path):
    resolved = load(
        tmp_path,
        "option.max_rolling_batch_size=8\n",
        {"OPTION_MAX_ROLLING_BATCH_SIZE": "16", "MAX_BATCH_SIZE": "24"},
    )
    assert resolved.config.max_rolling_batch_size == 8
    assert resolved.sources["option.max_rolling_batch_size"] == "serving.properties line 1"


def test_file_wins_over_serving_env(tmp_path):
    resolved = load(
        tmp_path,
        "\njob_queue_size=5\n",
        {"SERVING_JOB_QUEUE_SIZE": "50", "MAX_CONCURRENT_REQUESTS": "500"},
    )
    assert resolved.config.job_queue_size == 5
    assert resolved.sources["job_queue_size"] == "serving.properties line 2"


def test_file_wins_over_option_engine(tmp_path):
    resolved = load(tmp_path, "engine=Python\nbatch_size=2\n", {"OPTION_ENGINE": "MPI"})
    assert resolved.config.engine == "Python"
    assert resolved.sources["engine"] == "serving.properties line 1"


def test_file_wins_over_named_lmi_variables(tmp_path):
    resolved = load(
        tmp_path,
        "option.model_id=/opt/ml/model/llama\noption.tensor_parallel_degree=1\n",
        {"HF_MODEL_ID": "org/other", "TENSOR_PARALLEL_DEGREE": "4", "SM_NUM_GPUS": "8"},
        num_devices=8,
    )
    assert resolved.config.model_id == "/opt/ml/model/llama"
    assert resolved.config.tensor_parallel_degree == 1
    assert resolved.sources["option.tensor_parallel_degree"] == "serving.properties line 2"


@pytest.mark.parametrize(
    ("option_name", "named", "key", "field"),
    [
        ("OPTION_MODEL_ID", "HF_MODEL_ID", "option.model_id", "model_id"),
        ("OPTION_REVISION", "HF_REVISION", "option.revision", "revision"),
    ],
)
def test_option_env_wins_over_named_lmi_variable(option_name, named, key, field):
    resolved = load_config(None, {option_name: "from-option", named: "from-named"})
    assert getattr(resolved.config, field) == "from-option"
    assert resolved.sources[key] == f"env {option_name}"


def test_option_task_wins_over_hf_task():
    resolved = load_config(None, {"OPTION_TASK": "text-generation", "HF_TASK": "fill-mask"})
    assert resolved.config.task == "text-generation"
    assert resolved.sources["option.task"] == "env OPTION_TASK"


def test_option_env_wins_over_tensor_parallel_degree_and_sm_num_gpus():
    environ = {
        "OPTION_TENSOR_PARALLEL_DEGREE": "2",
        "TENSOR_PARALLEL_DEGREE": "4",
        "SM_NUM_GPUS": "8",
    }
    resolved = load_config(None, environ, num_devices=8)
    assert resolved.config.tensor_parallel_degree == 2
    assert resolved.sources["option.tensor_parallel_degree"] == "env OPTION_TENSOR_PARALLEL_DEGREE"


def test_lmi_name_wins_over_sagemaker_alias():
    resolved = load_config(None, {"TENSOR_PARALLEL_DEGREE": "2", "SM_NUM_GPUS": "4"}, 4)
    assert resolved.config.tensor_parallel_degree == 2
    assert resolved.sources["option.tensor_parallel_degree"] == "env TENSOR_PARALLEL_DEGREE"


@pytest.mark.parametrize(
    ("lmi_name", "tgi_name", "field", "key"),
    [
        (
            "OPTION_MAX_ROLLING_BATCH_SIZE",
            "MAX_BATCH_SIZE",
            "max_rolling_batch_size",
            "option.max_rolling_batch_size",
        ),
        (
            "OPTION_MAX_ROLLING_BATCH_PREFILL_TOKENS",
            "MAX_BATCH_PREFILL_TOKENS",
            "max_rolling_batch_prefill_tokens",
            "option.max_rolling_batch_prefill_tokens",
        ),
        ("SERVING_JOB_QUEUE_SIZE", "MAX_CONCURRENT_REQUESTS", "job_queue_size", "job_queue_size"),
    ],
)
def test_lmi_env_wins_over_tgi_alias(lmi_name, tgi_name, field, key):
    resolved = load_config(None, {lmi_name: "11", tgi_name: "99"})
    assert getattr(resolved.config, field) == 11
    assert resolved.sources[key] == f"env {lmi_name}"


@pytest.mark.parametrize(
    ("lmi_name", "sagemaker_name", "field", "key"),
    [
        (
            "OPTION_PREDICT_TIMEOUT",
            "SAGEMAKER_MODEL_SERVER_TIMEOUT_SECONDS",
            "predict_timeout",
            "option.predict_timeout",
        ),
        (
            "OPTION_MODEL_LOADING_TIMEOUT",
            "SAGEMAKER_STARTUP_TIMEOUT",
            "model_loading_timeout",
            "option.model_loading_timeout",
        ),
        ("SERVING_MIN_WORKERS", "SAGEMAKER_NUM_MODEL_WORKERS", "min_workers", "minWorkers"),
        ("SERVING_MAX_REQUEST_SIZE", "SAGEMAKER_MAX_REQUEST_SIZE", "max_request_size", None),
        ("SERVING_MAX_REQUEST_SIZE", "SAGEMAKER_MAX_PAYLOAD_IN_MB", "max_request_size", None),
    ],
)
def test_lmi_env_wins_over_sagemaker_name(lmi_name, sagemaker_name, field, key):
    resolved = load_config(None, {lmi_name: "11", sagemaker_name: "99"})
    assert getattr(resolved.config, field) == 11
    assert resolved.sources[key or field] == f"env {lmi_name}"


def test_file_wins_over_sagemaker_names(tmp_path):
    resolved = load(
        tmp_path,
        "option.predict_timeout=30\nmax_request_size=2048\n",
        {"SAGEMAKER_MODEL_SERVER_TIMEOUT_SECONDS": "600", "SAGEMAKER_MAX_PAYLOAD_IN_MB": "100"},
    )
    assert (resolved.config.predict_timeout, resolved.config.max_request_size) == (30, 2048)
    assert resolved.sources["max_request_size"] == "serving.properties line 2"


def test_option_trust_remote_code_wins_over_hf_model_trust_remote_code():
    environ = {"OPTION_TRUST_REMOTE_CODE": "false", "HF_MODEL_TRUST_REMOTE_CODE": "true"}
    resolved = load_config(None, environ)
    assert resolved.config.trust_remote_code is False
    assert resolved.sources["option.trust_remote_code"] == "env OPTION_TRUST_REMOTE_CODE"


def test_empty_lmi_name_counts_as_unset():
    resolved = load_config(None, {"TENSOR_PARALLEL_DEGREE": "", "SM_NUM_GPUS": "2"}, 2)
    assert resolved.config.tensor_parallel_degree == 2
    assert resolved.sources["option.tensor_parallel_degree"] == "env SM_NUM_GPUS"
    assert load_config(None, {"HF_MODEL_ID": ""}).config.model_id is None


def test_every_source_at_once(tmp_path):
    resolved = load(
        tmp_path,
        "engine=MPI\n",
        {
            "OPTION_DTYPE": "bf16",
            "HF_MODEL_ID": "org/m",
            "MAX_BATCH_SIZE": "12",
            "SERVING_MAX_WORKERS": "1",
        },
    )
    assert resolved.sources["engine"] == "serving.properties line 1"
    assert resolved.sources["option.dtype"] == "env OPTION_DTYPE"
    assert resolved.sources["option.model_id"] == "env HF_MODEL_ID"
    assert resolved.sources["option.max_rolling_batch_size"] == "env MAX_BATCH_SIZE"
    assert resolved.sources["maxWorkers"] == "env SERVING_MAX_WORKERS"
    assert resolved.sources["option.rolling_batch"] == "default (LMI's since 0.26)"
    assert resolved.sources["batch_size"] == "default"


# --- engine / rolling batch inference -------------------------------------------------------

FROM_ROLLING = "inferred from option.rolling_batch"
LINE_1 = "serving.properties line 1"


@pytest.mark.parametrize(
    ("text", "num_devices", "engine", "rolling_batch", "engine_source"),
    [
        # LMI's default since 0.26: option.rolling_batch=auto, whatever the engine.
        ("", 1, "MPI", "auto", FROM_ROLLING),
        ("option.rolling_batch=auto\n", 1, "MPI", "auto", FROM_ROLLING),
        ("option.rolling_batch=vllm\n", 1, "MPI", "vllm", FROM_ROLLING),
        ("option.rolling_batch=scheduler\n", 1, "MPI", "scheduler", FROM_ROLLING),
        ("option.rolling_batch=lmi-dist\n", 1, "MPI", "lmi-dist", FROM_ROLLING),
        ("option.rolling_batch=disable\n", 1, "Python", "disable", FROM_ROLLING),
        ("option.tensor_parallel_degree=2\n", 2, "MPI", "auto", FROM_ROLLING),
        ("option.tensor_parallel_degree=max\n", 1, "MPI", "auto", FROM_ROLLING),
        ("engine=MPI\n", 1, "MPI", "auto", LINE_1),
        ("engine=MPI\noption.rolling_batch=vllm\n", 1, "MPI", "vllm", LINE_1),
        ("engine=Python\noption.rolling_batch=disable\n", 1, "Python", "disable", LINE_1),
        # An old DJL dynamic-batching config names batch_size, not option.rolling_batch.
        ("engine=Python\nbatch_size=4\n", 1, "Python", "disable", LINE_1),
        ("batch_size=4\n", 1, "Python", "disable", FROM_ROLLING),
        # The LMI guides' starter configs: engine=Python with a rolling batch runs over MPI.
        ("engine=Python\n", 1, "MPI", "auto", f"{LINE_1}: Python, served as MPI"),
        ("engine=Python\noption.rolling_batch=vllm\n", 1, "MPI", "vllm", f"{LINE_1}: Python"),
        ("engine=Python\noption.rolling_batch=lmi-dist\n", 1, "MPI", "lmi-dist", LINE_1),
        ("engine=Python\noption.rolling_batch=scheduler\n", 1, "MPI", "scheduler", LINE_1),
        ("engine=Python\noption.rolling_batch=auto\n", 1, "MPI", "auto", LINE_1),
        ("engine=Python\noption.mpi_mode=true\n", 1, "MPI", "auto", LINE_1),
        ("engine=Python\noption.mpi_mode=true\nbatch_size=1\n", 1, "MPI", "auto", LINE_1),
    ],
)
def test_engine_and_rolling_batch_inference(
    tmp_path, text, num_devices, engine, rolling_batch, engine_source
):
    resolved = load(tmp_path, text, num_devices=num_devices)
    assert (resolved.config.engine, resolved.config.rolling_batch) == (engine, rolling_batch)
    assert resolved.config.uses_rolling_batch == (rolling_batch != "disable")
    assert resolved.sources["engine"].startswith(engine_source)


@pytest.mark.parametrize(
    ("text", "fragments"),
    [
        (
            "engine=Python\noption.rolling_batch=vllm\noption.tensor_parallel_degree=2\n",
            [
                "engine=Python with option.rolling_batch=vllm:",
                "lmserve's rolling batch over MPI ranks (tensor_parallel_degree=2)",
            ],
        ),
        (
            "engine=Python\n",
            [
                "engine=Python with option.rolling_batch=auto (the default):",
                "rolling batch over MPI ranks",
                "option.rolling_batch=disable gives dynamic batching",
            ],
        ),
        ("engine=Python\noption.mpi_mode=true\n", ["engine=Python with option.mpi_mode=true:"]),
        ("", ["no engine configured:", "rolling batch", "rolling_batch=disable gives dynamic"]),
        (
            "engine=MPI\noption.rolling_batch=lmi-dist\n",
            [
                "option.rolling_batch=lmi-dist: serving with lmserve's rolling batch",
            ],
        ),
        ("batch_size=8\n", ["batch_size=8 with no option.rolling_batch: dynamic batching"]),
    ],
)
def test_the_engine_choice_is_one_line_that_says_what_serves(tmp_path, text, fragments):
    line = load(tmp_path, text, num_devices=2).engine_line
    assert line is not None and "\n" not in line
    for fragment in fragments:
        assert fragment in line


@pytest.mark.parametrize(
    "text", ["engine=MPI\n", "engine=Python\noption.rolling_batch=disable\n", "engine=MPI\n\n"]
)
def test_a_plainly_stated_engine_needs_no_explaining(tmp_path, text):
    assert load(tmp_path, text).engine_line is None


@pytest.mark.parametrize(
    ("text", "ignored"),
    [
        (
            "engine=Python\noption.rolling_batch=disable\noption.max_rolling_batch_size=8\n"
            "option.paged_attention=false\n",
            ["option.max_rolling_batch_size (serving.properties line 3)", "option.paged_attention"],
        ),
        ("engine=MPI\nmax_batch_delay=50\n", ["max_batch_delay (serving.properties line 2)"]),
        ("engine=MPI\noption.max_rolling_batch_size=8\n", []),
        ("batch_size=4\nmax_batch_delay=50\n", []),
    ],
)
def test_keys_the_chosen_batching_never_reads_are_named(tmp_path, text, ignored):
    found = load(tmp_path, text).ignored
    assert len(found) == len(ignored)
    for fragment, line in zip(ignored, found):
        assert line.startswith(fragment) and "ignored" in line


def test_default_rolling_batch_says_where_it_came_from(tmp_path):
    sources = load(tmp_path, "engine=MPI\n").sources
    assert sources["option.rolling_batch"] == "default (LMI's since 0.26)"
    sources = load(tmp_path, "engine=Python\nbatch_size=3\n").sources
    assert sources["option.rolling_batch"] == "inferred from batch_size"
    sources = load(tmp_path, "option.rolling_batch=auto\n").sources
    assert sources["option.rolling_batch"] == LINE_1
    assert sources["engine"] == FROM_ROLLING


@pytest.mark.parametrize(("num_devices", "expected"), [(8, 8), (2, 2), (1, 1), (None, 1)])
def test_tensor_parallel_degree_max_is_the_device_count(tmp_path, num_devices, expected):
    resolved = load(tmp_path, "option.tensor_parallel_degree=MAX\n", num_devices=num_devices)
    assert resolved.config.tensor_parallel_degree == expected
    assert resolved.sources["option.tensor_parallel_degree"] == "serving.properties line 1"


def test_tensor_parallel_degree_is_unchecked_without_a_device_count(tmp_path):
    assert load(tmp_path, "option.tensor_parallel_degree=64\n").config.tensor_parallel_degree == 64


def test_tensor_parallel_degree_equal_to_device_count_is_fine(tmp_path):
    config = load(tmp_path, "option.tensor_parallel_degree=4\n", num_devices=4).config
    assert config.tensor_parallel_degree == 4


def test_equal_min_and_max_workers_are_fine(tmp_path):
    config = load(tmp_path, "minWorkers=3\nmaxWorkers=3\n").config
    assert (config.min_workers, config.max_workers) == (3, 3)


# --- validation -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "num_devices", "fragments"),
    [
        # wrong int / int below minimum
        ("batch_size=two", None, ["batch_size='two'", "line 1", "an integer >= 1"]),
        ("batch_size=2.5", None, ["batch_size='2.5'", "an integer >= 1"]),
        ("batch_size=0", None, ["batch_size='0'", "an integer >= 1"]),
        ("max_batch_delay=-1", None, ["max_batch_delay='-1'", "an integer >= 0"]),
        ("job_queue_size=", None, ["job_queue_size=''", "an integer >= 1"]),
        ("port=http", None, ["port='http'", "an integer"]),
        ("maxWorkers=0", None, ["maxWorkers='0'", "an integer >= 1"]),
        (
            "option.max_rolling_batch_size=lots",
            None,
            ["option.max_rolling_batch_size='lots'", "an integer >= 1"],
        ),
        (
            "option.max_rolling_batch_prefill_tokens=-5",
            None,
            ["option.max_rolling_batch_prefill_tokens='-5'", "an integer >= 1"],
        ),
        ("option.max_model_len=0", None, ["option.max_model_len='0'", "an integer >= 1"]),
        ("option.predict_timeout=1m", None, ["option.predict_timeout='1m'", "an integer >= 1"]),
        (
            "option.tensor_parallel_degree=all",
            None,
            ["option.tensor_parallel_degree='all'", "an integer >= 1", '"max"'],
        ),
        (
            "option.tensor_parallel_degree=0",
            None,
            ["option.tensor_parallel_degree='0'", "an integer >= 1", '"max"'],
        ),
        # bad bool
        ("option.paged_attention=yes", None, ["option.paged_attention='yes'", "true or false"]),
        ("option.trust_remote_code=1", None, ["option.trust_remote_code='1'", "true or false"]),
        ("option.tgi_compat=on", None, ["option.tgi_compat='on'", "true or false"]),
        # bad enum
        ("engine=TensorRT", None, ["engine='TensorRT'", "one of Python, MPI"]),
        ("option.dtype=fp8", None, ["option.dtype='fp8'", "one of fp32, fp16, bf16, auto"]),
        ("option.dtype=int8", None, ["option.dtype='int8'", "fp32", "fp16", "bf16", "auto"]),
        (
            "option.rolling_batch=trtllm",
            None,
            [
                "option.rolling_batch='trtllm'",
                "one of auto, scheduler, lmi-dist, vllm, disable",
            ],
        ),
        # bad float range
        (
            "option.gpu_memory_utilization=1.5",
            None,
            ["option.gpu_memory_utilization='1.5'", "a number in (0.0, 1.0]"],
        ),
        (
            "option.gpu_memory_utilization=0",
            None,
            ["option.gpu_memory_utilization='0'", "a number in (0.0, 1.0]"],
        ),
        (
            "option.gpu_memory_utilization=-0.1",
            None,
            ["option.gpu_memory_utilization='-0.1'", "(0.0, 1.0]"],
        ),
        (
            "option.gpu_memory_utilization=ninety",
            None,
            ["option.gpu_memory_utilization='ninety'", "(0.0, 1.0]"],
        ),
        ("option.gpu_memory_utilization=nan", None, ["'nan'", "(0.0, 1.0]"]),
        # bad output formatter
        (
            "option.output_formatter=json-lines",
            None,
            ["option.output_formatter='json-lines'", "json, jsonlines, sse", "model.py"],
        ),
        ("option.output_formatter=", None, ["option.output_formatter=''", "jsonlines"]),
        # methods not served are refused, not ignored
        ("option.quantize=fp8", None, ["option.quantize='fp8'", "int4", "awq", "not served"]),
        ("option.quantize=bitsandbytes", None, ["option.quantize='bitsandbytes'", "int4"]),
        (
            "option.speculative_draft_model=TinyLlama/TinyLlama-1.1B",
            None,
            ["option.speculative_draft_model='TinyLlama/TinyLlama-1.1B'", "[ngram]", "not served"],
        ),
        ("option.speculative_length=0", None, ["option.speculative_length='0'", ">= 1"]),
        (
            "engine=Python\noption.rolling_batch=disable\noption.quantize=int4",
            None,
            ["option.quantize=int4 with option.rolling_batch='disable'", "rolling_batch=auto"],
        ),
        ("option.load_format=pt", None, ["option.load_format='pt'", "auto, dummy"]),
        (
            "engine=Python\noption.rolling_batch=disable\noption.load_format=dummy",
            None,
            ["option.load_format=dummy with option.rolling_batch='disable'", "load_format=auto"],
        ),
        # impossible combinations
        (
            "option.tensor_parallel_degree=4",
            2,
            ["option.tensor_parallel_degree=4", "2 device", "an integer <= 2", '"max"'],
        ),
        (
            "engine=Python\noption.rolling_batch=disable\noption.tensor_parallel_degree=2",
            2,
            [
                "option.tensor_parallel_degree=2",
                "option.rolling_batch='disable'",
                "expected 1",
                "rolling_batch=auto",
            ],
        ),
        (
            "engine=MPI\noption.rolling_batch=disable",
            None,
            ["option.rolling_batch='disable'", "engine=MPI", "auto", "engine=Python"],
        ),
        (
            "engine=MPI\noption.rolling_batch=disable\noption.tensor_parallel_degree=2",
            2,
            ["option.rolling_batch='disable'", "engine=MPI"],
        ),
        (
            "option.mpi_mode=true\noption.rolling_batch=disable",
            None,
            ["option.mpi_mode=true", "option.rolling_batch='disable'", "mpi_mode=false"],
        ),
        (
            "engine=Python\nbatch_size=4\noption.mpi_mode=true",
            None,
            ["batch_size=4", "option.rolling_batch='auto'", "batch_size=1"],
        ),
        # parsed options lmserve does not implement are refused, not ignored
        (
            "option.task=text2text-generation",
            None,
            ["option.task='text2text-generation'", "expected text-generation", "only task"],
        ),
        (
            "option.enable_prefix_caching=true\noption.paged_attention=false",
            None,
            ["option.enable_prefix_caching=true", "contiguous layout", "paged_attention=true"],
        ),
        (
            "option.max_loras=8\noption.max_cpu_loras=2",
            None,
            ["option.max_cpu_loras=2 < option.max_loras=8", "option.max_cpu_loras >= 8"],
        ),
        (
            "option.enable_chunked_prefill=false",
            None,
            [
                "option.enable_chunked_prefill='false'",
                "expected true",
                "option.max_rolling_batch_prefill_tokens in chunks",
            ],
        ),
        (
            "option.enable_chunked_prefill=maybe",
            None,
            ["option.enable_chunked_prefill='maybe'", "true or false"],
        ),
        (
            "option.scheduling_policy=priority",
            None,
            ["option.scheduling_policy='priority'", "one of shortest_first, fcfs"],
        ),
        (
            "option.step_trace=/no/such/folder/steps.jsonl",
            None,
            ["option.step_trace='/no/such/folder/steps.jsonl'", "an existing folder"],
        ),
        (
            "batch_size=4\noption.rolling_batch=auto",
            None,
            ["batch_size=4", "option.rolling_batch='auto'", "batch_size=1"],
        ),
        (
            "batch_size=2\nengine=MPI",
            None,
            ["batch_size=2", "rolling_batch='auto'", "batch_size=1"],
        ),
        (
            "minWorkers=3\nmaxWorkers=2",
            None,
            ["minWorkers=3", "maxWorkers=2", "minWorkers <= maxWorkers"],
        ),
    ],
)
def test_each_invalid_setting_is_one_problem_naming_key_value_and_allowed(
    tmp_path, text, num_devices, fragments
):
    problems = problems_of(tmp_path, text + "\n", num_devices=num_devices)
    assert len(problems) == 1, problems
    for fragment in fragments:
        assert fragment in problems[0]


@pytest.mark.parametrize(
    ("environ", "fragments"),
    [
        ({"OPTION_DTYPE": "fp8"}, ["option.dtype='fp8'", "env OPTION_DTYPE", "bf16"]),
        ({"SERVING_BATCH_SIZE": "x"}, ["batch_size='x'", "env SERVING_BATCH_SIZE", "integer"]),
        ({"SM_NUM_GPUS": "eight"}, ["option.tensor_parallel_degree='eight'", "env SM_NUM_GPUS"]),
        ({"MAX_BATCH_SIZE": "0"}, ["option.max_rolling_batch_size='0'", "env MAX_BATCH_SIZE"]),
        (
            {"HF_MODEL_TRUST_REMOTE_CODE": "yes"},
            ["option.trust_remote_code='yes'", "env HF_MODEL_TRUST_REMOTE_CODE", "true or false"],
        ),
        (
            {"HF_MODEL_QUANTIZE": "nf4"},
            ["option.quantize='nf4'", "env HF_MODEL_QUANTIZE", "int4"],
        ),
        ({"OPTION_ENGINE": "Rust"}, ["engine='Rust'", "env OPTION_ENGINE", "Python, MPI"]),
        ({"HF_TASK": "fill-mask"}, ["option.task='fill-mask'", "env HF_TASK", "text-generation"]),
        (
            {"SAGEMAKER_MAX_PAYLOAD_IN_MB": "ten"},
            ["max_request_size='ten'", "env SAGEMAKER_MAX_PAYLOAD_IN_MB", "integer"],
        ),
        (
            {"SAGEMAKER_STARTUP_TIMEOUT": "-1"},
            ["option.model_loading_timeout='-1'", "env SAGEMAKER_STARTUP_TIMEOUT", "integer"],
        ),
    ],
)
def test_invalid_environment_values_name_the_variable(environ, fragments):
    with pytest.raises(ConfigError) as caught:
        load_config(None, environ)
    assert len(caught.value.problems) == 1
    for fragment in fragments:
        assert fragment in caught.value.problems[0]


def test_tensor_parallel_degree_above_devices_from_environment(tmp_path):
    problems = problems_of(tmp_path, environ={"SM_NUM_GPUS": "8"}, num_devices=4)
    assert len(problems) == 1
    assert "option.tensor_parallel_degree=8" in problems[0] and "4 device" in problems[0]


def test_every_problem_is_reported_in_one_error(tmp_path):
    text = (
        "batch_size=x\n"
        "option.dtype=fp8\n"
        "option.paged_attention=maybe\n"
        "option.gpu_memory_utilization=2\n"
        "minWorkers=5\n"
        "maxWorkers=2\n"
        "option.tensor_parallel_degree=16\n"
    )
    with pytest.raises(ConfigError) as caught:
        load(tmp_path, text, {"OPTION_OUTPUT_FORMATTER": "not valid"}, num_devices=8)
    problems = caught.value.problems
    expected = [
        "batch_size='x' (serving.properties line 1)",
        "option.dtype='fp8' (serving.properties line 2)",
        "option.paged_attention='maybe' (serving.properties line 3)",
        "option.gpu_memory_utilization='2' (serving.properties line 4)",
        "option.output_formatter='not valid' (env OPTION_OUTPUT_FORMATTER)",
        "minWorkers=5 > maxWorkers=2",
        "option.tensor_parallel_degree=16",
    ]
    assert len(problems) == len(expected), problems
    for fragment in expected:
        assert sum(fragment in problem for problem in problems) == 1, fragment
    message = str(caught.value)
    assert all(problem in message for problem in problems)
    assert message.count("\n") == len(problems)  # one problem per line


def test_config_error_is_a_value_error(tmp_path):
    with pytest.raises(ValueError):
        load(tmp_path, "batch_size=-3\n")


def test_bad_value_and_impossible_combination_are_both_reported(tmp_path):
    problems = problems_of(tmp_path, "batch_size=2\noption.rolling_batch=auto\nport=x\n")
    assert len(problems) == 2
    assert any("port='x'" in p for p in problems)
    assert any("batch_size=2" in p and "option.rolling_batch='auto'" in p for p in problems)


# --- the ServingConfig object ---------------------------------------------------------------


def test_round_trip_through_dict(tmp_path):
    config = load(
        tmp_path,
        "engine=MPI\noption.dtype=bf16\noption.model_id=org/m\noption.custom=1\n",
        {"OPTION_MAX_MODEL_LEN": "2048"},
    ).config
    as_dict = config.to_dict()
    assert as_dict["extra_options"] == {"custom": "1"}
    assert as_dict["max_model_len"] == 2048
    again = ServingConfig.from_dict(as_dict)
    assert again == config
    assert again.to_dict() == as_dict


def test_from_dict_builds_the_config_given():
    values = dict(CONTRACT_DEFAULTS, engine="MPI", rolling_batch="vllm", extra_options={"a": "b"})
    config = ServingConfig.from_dict(values)
    assert config.engine == "MPI" and config.uses_rolling_batch
    assert config.extra_options == {"a": "b"}


def test_from_dict_rejects_unknown_fields():
    with pytest.raises(TypeError):
        ServingConfig.from_dict(dict(CONTRACT_DEFAULTS, no_such_field=1))


def test_to_dict_is_a_copy(tmp_path):
    config = load(tmp_path, "option.custom=1\n").config
    as_dict = config.to_dict()
    as_dict["batch_size"] = 99
    as_dict["extra_options"]["custom"] = "changed"
    assert config.batch_size == 1
    assert config.extra_options == {"custom": "1"}


@pytest.mark.parametrize(
    "field", ["engine", "batch_size", "extra_options", "tensor_parallel_degree"]
)
def test_config_is_frozen(field):
    config = load_config(None, {}).config
    before = getattr(config, field)
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(config, field, "changed")
    assert getattr(config, field) == before


# --- form feed is Java whitespace ----------------------------


def test_form_feed_separated_key_and_value(tmp_path):
    assert load(tmp_path, "engine\fMPI\n").config.engine == "MPI"


def test_max_degree_resolves_to_what_the_caller_says_max_means(tmp_path):
    (tmp_path / "serving.properties").write_text("option.tensor_parallel_degree=max\n")
    on_cpu = load_config(tmp_path, {}, num_devices=16, max_tensor_parallel=1).config
    on_gpus = load_config(tmp_path, {}, num_devices=4).config
    assert on_cpu.tensor_parallel_degree == 1 and on_cpu.engine == "MPI"
    assert on_gpus.tensor_parallel_degree == 4 and on_gpus.engine == "MPI"


# --- a model dir with its own handler (model.py) ---------------------------------------------


@pytest.mark.parametrize("properties", ["", "engine=Python\n", "engine=Python\nbatch_size=4\n"])
def test_a_user_handler_serves_with_dynamic_batching(tmp_path, properties):
    (tmp_path / "serving.properties").write_text(properties)
    resolved = load_config(tmp_path, {}, num_devices=1, user_handler=True)
    assert (resolved.config.engine, resolved.config.rolling_batch) == ("Python", "disable")
    assert "the model's own handle() serves" in resolved.engine_line


@pytest.mark.parametrize("properties", ["engine=MPI\n", "option.rolling_batch=vllm\n"])
def test_a_user_handler_with_the_rolling_batch_is_refused(tmp_path, properties):
    (tmp_path / "serving.properties").write_text(properties)
    with pytest.raises(ConfigError, match="runs with engine=Python and dynamic batching"):
        load_config(tmp_path, {}, num_devices=1, user_handler=True)


def test_agent_options_read_lmi_names_and_auto_tool_choice_needs_a_parser():
    environ = {
        "OPTION_ENABLE_AUTO_TOOL_CHOICE": "true",
        "OPTION_TOOL_CALL_PARSER": "Hermes",
        "OPTION_REASONING_PARSER": "qwen3",
    }
    config = load_config(None, environ).config
    assert (config.enable_auto_tool_choice, config.tool_call_parser) == (True, "hermes")
    assert config.reasoning_parser == "qwen3"
    with pytest.raises(ConfigError) as caught:
        load_config(None, {"OPTION_ENABLE_AUTO_TOOL_CHOICE": "true"})
    assert "option.tool_call_parser" in str(caught.value)
    with pytest.raises(ConfigError) as caught:
        load_config(None, {"OPTION_TOOL_CALL_PARSER": "xml"})
    assert "hermes, llama3_json, mistral" in str(caught.value)
