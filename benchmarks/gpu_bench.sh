#!/usr/bin/env bash
# benchmarks/gpu_bench.py on a machine with an NVIDIA GPU (the device tool's: its python3 holds
# CUDA torch, triton and transformers). Prepare where pip has an index, then run there with
# .gpu_bench and .whl carried:
#   python -m lmserve.benchmarks.gpu_bench prepare
#   bash benchmarks/gpu_bench.sh [run options, e.g. --no-hf]
# Results (gpu_bench.json/.md/.log, profile.txt) go to $OUT, else bench-results/.
set -o pipefail
out=${OUT:-bench-results}
source tests/gpu_setup.sh "$out"
HF_HUB_OFFLINE=1 TRITON_CACHE_DIR=/tmp/triton-cache PYTHONUNBUFFERED=1 \
  timeout -k 10 "${GPU_BENCH_TIMEOUT_S:-360}" python3 -m lmserve.benchmarks.gpu_bench run \
  --out "$out" "$@" 2>&1 | tee "$out/gpu_bench.log"
