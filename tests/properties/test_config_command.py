"""`lmserve config --model-dir DIR`: the resolved configuration, one row per key with its value
and where it came from; a bad configuration exits 2 with a readable message."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from lmserve.properties.settings import SETTINGS


def run_config(model_dir: Path, environ: dict[str, str]) -> subprocess.CompletedProcess[str]:
    # A clean environment: nothing from the machine running the tests may leak in.
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(model_dir), **environ}
    return subprocess.run(
        [sys.executable, "-m", "lmserve.container.cli", "config", "--model-dir", str(model_dir)],
        capture_output=True,
        text=True,
        env=env,
        cwd=model_dir,
        timeout=60,
    )


def rows(stdout: str) -> dict[str, tuple[str, str]]:
    """key -> (value, source) from the printed table."""
    table: dict[str, tuple[str, str]] = {}
    for line in stdout.splitlines():
        key, value, source = re.split(r"\s{2,}", line.strip(), maxsplit=2)
        assert key not in table, f"{key} printed twice"
        table[key] = (value, source)
    return table


def test_lists_every_key_with_value_and_source(tmp_path):
    (tmp_path / "serving.properties").write_text(
        "# tuning for the demo\n"
        "engine = MPI\n"
        "option.dtype: bf16\n"
        "\n"
        "option.custom_flag=on\n"
        "option.max_rolling_batch_prefill_tokens=\\\n"
        "    2048\n",
        encoding="utf-8",
    )
    result = run_config(
        tmp_path,
        {"OPTION_MAX_ROLLING_BATCH_SIZE": "64", "SERVING_JOB_QUEUE_SIZE": "50"},
    )
    assert result.returncode == 0, result.stderr
    table = rows(result.stdout)
    assert set(table) == {setting.key for setting in SETTINGS} | {"option.custom_flag"}
    assert table["engine"] == ("'MPI'", "serving.properties line 2")
    assert table["option.dtype"] == ("'bf16'", "serving.properties line 3")
    assert table["option.max_rolling_batch_prefill_tokens"] == (
        "2048",
        "serving.properties line 6",
    )
    assert table["option.max_rolling_batch_size"] == ("64", "env OPTION_MAX_ROLLING_BATCH_SIZE")
    assert table["job_queue_size"] == ("50", "env SERVING_JOB_QUEUE_SIZE")
    assert table["batch_size"] == ("1", "default")
    assert table["option.task"] == ("'text-generation'", "default")
    assert table["option.paged_attention"] == ("True", "default")
    assert table["option.model_id"] == ("None", "default")
    assert table["option.rolling_batch"][0] == "'auto'"
    assert table["option.rolling_batch"][1] == "default (LMI's since 0.26)"
    value, source = table["option.custom_flag"]
    assert value == "'on'"
    assert source.startswith("serving.properties line 5") and "unknown" in source


def test_file_wins_over_environment_in_the_listing(tmp_path):
    (tmp_path / "serving.properties").write_text(
        "option.max_rolling_batch_size=8\n", encoding="utf-8"
    )
    result = run_config(tmp_path, {"OPTION_MAX_ROLLING_BATCH_SIZE": "64", "MAX_BATCH_SIZE": "16"})
    assert result.returncode == 0, result.stderr
    assert rows(result.stdout)["option.max_rolling_batch_size"] == (
        "8",
        "serving.properties line 1",
    )


def test_environment_only_without_a_properties_file(tmp_path):
    result = run_config(
        tmp_path,
        {
            "HF_MODEL_ID": "HuggingFaceTB/SmolLM2-135M",
            "MAX_BATCH_SIZE": "16",
            "OPTION_ENTRYPOINT": "djl_python.lmi_vllm.vllm_async_service",
            "OPTION_ENGINE": "MPI",
            "SERVING_MIN_WORKERS": "1",
        },
    )
    assert result.returncode == 0, result.stderr
    table = rows(result.stdout)
    assert table["option.model_id"] == ("'HuggingFaceTB/SmolLM2-135M'", "env HF_MODEL_ID")
    assert table["option.max_rolling_batch_size"] == ("16", "env MAX_BATCH_SIZE")
    assert table["option.entryPoint"] == (
        "'djl_python.lmi_vllm.vllm_async_service'",
        "env OPTION_ENTRYPOINT",
    )
    assert table["engine"] == ("'MPI'", "env OPTION_ENGINE")
    assert table["minWorkers"] == ("1", "env SERVING_MIN_WORKERS")
    assert table["option.rolling_batch"][0] == "'auto'"


def test_bad_config_exits_2_naming_every_bad_key(tmp_path):
    (tmp_path / "serving.properties").write_text(
        "engine=MPI\noption.dtype=fp8\nbatch_size=zero\n", encoding="utf-8"
    )
    result = run_config(tmp_path, {"OPTION_PAGED_ATTENTION": "maybe"})
    assert result.returncode == 2
    output = result.stdout + result.stderr
    assert "Traceback" not in output
    assert result.stdout.strip() == ""  # no half-resolved table
    assert "option.dtype='fp8'" in result.stderr and "serving.properties line 2" in result.stderr
    assert "fp32, fp16, bf16, auto" in result.stderr
    assert "batch_size='zero'" in result.stderr and "serving.properties line 3" in result.stderr
    assert "option.paged_attention='maybe'" in result.stderr
    assert "env OPTION_PAGED_ATTENTION" in result.stderr


def test_impossible_combination_exits_2(tmp_path):
    (tmp_path / "serving.properties").write_text(
        "engine=MPI\noption.rolling_batch=disable\n", encoding="utf-8"
    )
    result = run_config(tmp_path, {})
    assert result.returncode == 2
    assert "Traceback" not in result.stdout + result.stderr
    assert "option.rolling_batch='disable'" in result.stderr and "engine=MPI" in result.stderr


def test_lmi_guide_starter_config_is_served_by_the_rolling_batch(tmp_path):
    # The vLLM guide's serving.properties: engine=Python with option.rolling_batch=vllm.
    (tmp_path / "serving.properties").write_text(
        "engine=Python\noption.rolling_batch=vllm\noption.tensor_parallel_degree=1\n",
        encoding="utf-8",
    )
    result = run_config(tmp_path, {})
    assert result.returncode == 0, result.stderr
    table = rows(result.stdout)
    assert table["engine"][0] == "'MPI'"
    assert table["engine"][1].startswith("serving.properties line 1: Python, served as MPI")
    assert table["option.rolling_batch"] == ("'vllm'", "serving.properties line 2")
    assert (
        "engine=Python with option.rolling_batch=vllm: serving with lmserve's rolling batch"
        " over MPI ranks (tensor_parallel_degree=1)"
    ) in result.stderr


def test_bad_environment_value_exits_2(tmp_path):
    result = run_config(tmp_path, {"SERVING_MIN_WORKERS": "3", "SERVING_MAX_WORKERS": "2"})
    assert result.returncode == 2
    assert "Traceback" not in result.stdout + result.stderr
    assert "minWorkers=3" in result.stderr and "maxWorkers=2" in result.stderr


def test_syntax_error_exits_2_naming_the_line(tmp_path):
    (tmp_path / "serving.properties").write_text(
        "engine=MPI\n# ok\noption.model_id=\\u12\n", encoding="utf-8"
    )
    result = run_config(tmp_path, {})
    assert result.returncode == 2
    assert "Traceback" not in result.stdout + result.stderr
    assert "serving.properties" in result.stderr and "line 3" in result.stderr


def test_max_degree_is_one_on_a_cpu(tmp_path):
    (tmp_path / "serving.properties").write_text(
        "engine=MPI\noption.tensor_parallel_degree=max\n", encoding="utf-8"
    )
    result = run_config(tmp_path, {})
    assert result.returncode == 0, result.stderr
    assert rows(result.stdout)["option.tensor_parallel_degree"][0] == "1"
