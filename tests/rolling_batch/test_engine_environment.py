"""What the engine processes' environment does to their memory."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from lmserve.rolling_batch.engine.mpi_launch import engine_environment


def _transparent_huge_pages() -> str:
    try:
        setting = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return "never"
    return setting.split("[", 1)[1].split("]", 1)[0]


@pytest.mark.skipif(
    _transparent_huge_pages() not in ("madvise", "always"), reason="huge pages are off here"
)
def test_engine_processes_keep_big_buffers_in_huge_pages():
    """Weights and the KV cache are streamed every step; huge pages save TLB misses there."""
    code = (
        "import torch; weights = torch.ones(64 << 20);"
        "print(next(line.split()[1] for line in open('/proc/self/smaps_rollup')"
        " if line.startswith('AnonHugePages')))"
    )
    run = subprocess.run(
        [sys.executable, "-c", code], env=engine_environment(), capture_output=True, text=True
    )
    assert int(run.stdout) >= 128 << 10  # kB: most of the 256 MiB tensor
