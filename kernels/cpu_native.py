"""Builds and loads the C++ CPU kernels (`csrc/cpu_ops.cpp`), once per machine.

The shared library is compiled with g++ for the vector ISA this CPU has (AVX-512 or AVX2:
at::vec picks its implementation from the CPU_CAPABILITY_* macro) and kept in
`$LMSERVE_CACHE_DIR/cpu_kernels/<torch version>-<ISA>-<source hash>/`, so the first start on
a machine builds it (~1 minute, logged) and later starts load it. Concurrent builders (the
ranks of one job, parallel test runs) meet at a file lock; the library is renamed into place
only when complete. Without a compiler, or with a CPU that has neither ISA, `native_ops()`
is None and the torch references serve (logged once).
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import importlib.machinery
import importlib.util
import logging
import os
import shutil
import subprocess
import sys
import sysconfig
import time
from pathlib import Path
from types import ModuleType

import torch

from lmserve.properties.config import default_cache_dir

log = logging.getLogger("lmserve.kernels")

SOURCE = Path(__file__).resolve().parent / "csrc" / "cpu_ops.cpp"
# The headers cpu_ops.cpp includes, one a job: any change to one is a new build.
HEADERS = sorted(SOURCE.parent.glob("*.h"))
_COMPILER = "g++"


def _module_name(isa: str) -> str:
    # One name per ISA: Python keeps an extension module by its name, so a process that loaded
    # one build would be handed that same module again for another ISA's library.
    return f"lmserve_cpu_ops_{isa}"


# at::vec's AVX-512 path needs F, BW, VL and DQ (what ATen's own AVX512 build targets).
_ISA_FLAGS = {
    "avx512": (
        ("avx512f", "avx512bw", "avx512vl", "avx512dq", "fma"),
        ["-DCPU_CAPABILITY=AVX512", "-DCPU_CAPABILITY_AVX512", "-mavx512f", "-mavx512bw"]
        + ["-mavx512vl", "-mavx512dq", "-mfma", "-mf16c"],
    ),
    "avx2": (
        ("avx2", "fma", "f16c"),
        ["-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2", "-mavx2", "-mfma", "-mf16c"],
    ),
}


def usable_isas(cpuinfo: str | None = None) -> list[str]:
    """The ISAs this CPU can run, best first, from the flags of /proc/cpuinfo."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return []
    flags: set[str] = set()
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            break
    return [isa for isa, (required, _) in _ISA_FLAGS.items() if flags.issuperset(required)]


def cpu_isa(cpuinfo: str | None = None) -> str | None:
    """ "avx512", "avx2" or None: what the kernels are built for on this CPU."""
    isas = usable_isas(cpuinfo)
    return isas[0] if isas else None


def compile_command(isa: str, output: Path) -> list[str]:
    from torch.utils.cpp_extension import include_paths, library_paths

    includes = [f"-I{path}" for path in [*include_paths(), sysconfig.get_paths()["include"]]]
    return [
        _COMPILER,
        str(SOURCE),
        "-o",
        str(output),
        "-shared",
        "-fPIC",
        "-O3",
        "-std=c++20",
        # HF's products and sums are separate roundings: no fused multiply-add where the
        # source writes `a * b + c` (the dot products ask for fmadd explicitly).
        "-ffp-contract=off",
        # ATen's parallel_for is inline OpenMP; libgomp resolves to the copy torch loaded.
        "-fopenmp",
        "-DTORCH_API_INCLUDE_EXTENSION_H",
        f"-DTORCH_EXTENSION_NAME={_module_name(isa)}",
        f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
        *_ISA_FLAGS[isa][1],
        *includes,
        *[f"-L{path}" for path in library_paths()],
        "-lc10",
        "-ltorch",
        "-ltorch_cpu",
        "-ltorch_python",
    ]


def build_dir(isa: str, cache_dir: Path | None = None) -> Path:
    digest = hashlib.sha256()
    for path in (SOURCE, *HEADERS):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    source_hash = digest.hexdigest()[:12]
    version = torch.__version__.replace("+", "_")
    root = cache_dir if cache_dir is not None else default_cache_dir()
    python = f"py{sys.version_info[0]}{sys.version_info[1]}"
    return root / "cpu_kernels" / f"torch{version}-{python}-{isa}-{source_hash}"


def build(isa: str, folder: Path) -> Path:
    """The compiled library in `folder`, compiling it unless a finished one is there."""
    library = folder / f"{_module_name(isa)}.so"
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one builder; the others wait, then load its result
        if library.exists():
            return library
        partial = folder / f"{_module_name(isa)}.{os.getpid()}.tmp.so"
        log.info("building the CPU kernels for %s into %s (once per machine)", isa, folder)
        started = time.monotonic()
        result = subprocess.run(
            compile_command(isa, partial), capture_output=True, text=True, check=False
        )
        if result.returncode != 0:
            partial.unlink(missing_ok=True)
            raise RuntimeError(f"g++ failed:\n{result.stderr[-4000:]}")
        os.replace(partial, library)
        log.info("built the CPU kernels in %.0f s", time.monotonic() - started)
    return library


def load(library: Path) -> ModuleType:
    name = library.name.split(".")[0]  # the module name the library was built with
    loader = importlib.machinery.ExtensionFileLoader(name, str(library))
    spec = importlib.util.spec_from_file_location(name, library, loader=loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


@functools.cache
def native_ops() -> ModuleType | None:
    """The compiled kernels, or None (the torch references serve instead, said once)."""
    isa = cpu_isa()
    if isa is None:
        log.warning("CPU kernels: this CPU has neither AVX2 nor AVX-512; torch reference ops")
        return None
    if shutil.which(_COMPILER) is None:
        log.warning("CPU kernels: no C++ compiler (g++) found; torch reference ops (slower)")
        return None
    try:
        module = load(build(isa, build_dir(isa)))
    except (OSError, RuntimeError, ImportError) as error:
        log.warning("CPU kernels unavailable, torch reference ops (slower): %s", error)
        return None
    log.info("CPU kernels loaded (%s, %d fp32 lanes)", isa, module.vector_width())
    return module


@functools.cache
def cpu_has_native_bf16() -> bool:
    """AVX512-BF16 or AMX: bf16 matmuls run natively (788 vs 195 GFLOP/s fp32 measured on an
    EPYC, benchmarks/README.md); without them bf16 is emulated and slower than fp32."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def ops_for(tensor: torch.Tensor) -> ModuleType | None:
    """The native kernels where they apply to `tensor` (a CPU tensor), else None."""
    return native_ops() if tensor.device.type == "cpu" else None
