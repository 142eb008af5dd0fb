# Sourced by tests/gpu_check.sh and benchmarks/gpu_bench.sh on a machine with an NVIDIA GPU whose
# python3 already holds CUDA torch, triton and transformers (the device tool's image): the
# wheels in .whl/ (what that image lacks: msgspec, pyzmq, flask, gunicorn, mpich, ...; written
# by `python -m lmserve.benchmarks.gpu_bench prepare` where pip has an index) into a private
# prefix, then lmserve from this checkout. Exports PYTHONPATH, PATH (mpiexec) and
# LD_LIBRARY_PATH (mpich's libmpi, which mpi4py opens) for what follows.
#   source tests/gpu_setup.sh LOG_DIR
setup_log_dir=${1:-/tmp}
mkdir -p "$setup_log_dir"
if compgen -G ".whl/*.whl" >/dev/null; then
  # --prefix, not --target: --target drops the lib/ folder that holds libmpi.so.
  python3 -m pip install -q --no-index --no-deps --no-compile --prefix /tmp/lmserve-prefix \
    .whl/*.whl >"$setup_log_dir/wheels.log" 2>&1 \
    || { echo "installing .whl/ failed:"; tail -n 5 "$setup_log_dir/wheels.log"; exit 3; }
  for site in /tmp/lmserve-prefix/lib/python3*/site-packages; do
    export PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH}
  done
  export PATH=/tmp/lmserve-prefix/bin:$PATH
  export LD_LIBRARY_PATH=/tmp/lmserve-prefix/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
fi
# lmserve.* maps the repository's top-level folders (pyproject.toml); offline, no build isolation.
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . \
  >"$setup_log_dir/install.log" 2>&1 \
  || { echo "installing lmserve failed:"; tail -n 5 "$setup_log_dir/install.log"; exit 3; }
nvidia-smi -L
python3 -c "import torch, triton; print('torch', torch.__version__, '| triton', triton.__version__)"
