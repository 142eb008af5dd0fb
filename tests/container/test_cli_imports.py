"""`lmserve serve` never imports the benchmarks (load generator, plots): only `lmserve bench`
does. Each check runs in a fresh interpreter, so nothing this test process imported counts."""

from __future__ import annotations

import json
import subprocess
import sys

PARSE_AND_LIST = """
import json, sys
from lmserve.container import cli
args = cli.build_parser({command!r}).parse_args({argv!r})
print(json.dumps([name for name in sys.modules if name.startswith("lmserve.benchmarks")]))
"""


def benchmark_modules_after_parsing(argv: list[str]) -> list[str]:
    code = PARSE_AND_LIST.format(command=argv[0], argv=argv)
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    return json.loads(result.stdout.splitlines()[-1])


def test_serve_imports_no_benchmark_module():
    assert benchmark_modules_after_parsing(["serve", "--model-dir", "/opt/ml/model"]) == []


def test_config_imports_no_benchmark_module():
    assert benchmark_modules_after_parsing(["config"]) == []


def test_bench_still_gets_its_own_arguments():
    assert "lmserve.benchmarks.bench_cli" in benchmark_modules_after_parsing(
        ["bench", "--url", "http://127.0.0.1:8080"]
    )
    result = subprocess.run(
        [sys.executable, "-m", "lmserve.container.cli", "bench", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "--url" in result.stdout and "--num-requests" in result.stdout
