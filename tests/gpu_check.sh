#!/usr/bin/env bash
# The suite's GPU half: the Triton kernels compiled for real against their torch references,
# and the engine on CUDA against HF transformers (on a machine without a GPU the same tests run
# the kernels in Triton's interpreter, or skip). For a machine with an NVIDIA GPU whose python3
# already holds CUDA torch, triton, transformers and pytest, run from the repository root:
#   bash tests/gpu_check.sh [LOG_DIR]   # install.log and gpu_tests.log go there (default /tmp)
# lmserve's other needs that such a machine may lack come as wheels in .whl/ (tests/gpu_setup.sh;
# `python -m lmserve.benchmarks.gpu_bench prepare` downloads them where pip has an index).
set -o pipefail
log_dir=${1:-/tmp}
source tests/gpu_setup.sh "$log_dir"
HF_HUB_OFFLINE=1 TRITON_CACHE_DIR=/tmp/triton-cache timeout -k 10 300 python3 -m pytest -q -ra \
  -p no:cacheprovider --durations=8 tests/kernels/test_kv_store.py \
  tests/kernels/test_paged_attention.py tests/kernels/test_weight_only_matmul.py \
  tests/kernels/test_paged_attention_tiled.py tests/rolling_batch/test_step_inputs.py \
  tests/rolling_batch/test_cuda_graphs.py \
  tests/rolling_batch/test_cuda_engine.py 2>&1 | tee "$log_dir/gpu_tests.log"
