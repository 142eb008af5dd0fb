#!/usr/bin/env bash
# The suite's GPU half: the Triton kernels compiled for real against their torch references,
# and the engine on CUDA against HF transformers (on a machine without a GPU the same tests run
# the kernels in Triton's interpreter, or skip). For a machine with an NVIDIA GPU whose python3
# already holds CUDA torch, triton, transformers and pytest, run from the repository root:
#   bash tests/gpu_check.sh [LOG_DIR]   # install.log and gpu_tests.log go there (default /tmp)
# lmserve's other needs that such a machine may lack (msgspec) can come as wheels in .whl/,
# downloaded beforehand where pip has an index:
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#     --platform manylinux_2_17_x86_64 -d .whl msgspec
set -o pipefail
log_dir=${1:-/tmp}
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/lmserve-site .whl/*.whl
  export PYTHONPATH=/tmp/lmserve-site${PYTHONPATH:+:$PYTHONPATH}
fi
# lmserve.* maps the repository's top-level folders (pyproject.toml); offline, no build isolation.
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >"$log_dir/install.log" 2>&1 \
  || { echo "installing lmserve failed:"; tail -n 5 "$log_dir/install.log"; exit 3; }
nvidia-smi -L
python3 -c "import torch, triton; print('torch', torch.__version__, '| triton', triton.__version__)"
HF_HUB_OFFLINE=1 TRITON_CACHE_DIR=/tmp/triton-cache timeout -k 10 300 python3 -m pytest -q -ra \
  -p no:cacheprovider --durations=8 tests/kernels/test_kv_store.py \
  tests/kernels/test_paged_attention.py tests/kernels/test_weight_only_matmul.py \
  tests/rolling_batch/test_cuda_engine.py 2>&1 | tee "$log_dir/gpu_tests.log"
