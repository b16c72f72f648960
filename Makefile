# chattts-triton: `make demo` and `make test` are all a new user needs. `make help` lists the rest.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
BUILD ?= build
ASSETS ?=
SIZE ?= full
REPO ?= $(BUILD)/repo
HTTP_PORT ?= 8000
GRPC_PORT ?= 8001
METRICS_PORT ?= 8002
GPUS ?=
INSTANCES ?= 1
PYTEST_ARGS ?=

.DEFAULT_GOAL := help
.PHONY: help setup test test-fast assets export configure serve demo clean

help: ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | sed -E 's/:.*## /\t/' | column -t -s $$'\t'

$(VENV)/.installed: requirements.txt pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements.txt
	$(PY) -m pip install -q --no-deps -e .
	@touch $@

setup: $(VENV)/.installed ## build .venv with the pinned dependencies (idempotent)

test: setup ## run the whole test suite (unit, export parity, end-to-end against a real tritonserver)
	$(PY) -m pytest $(PYTEST_ARGS)

test-fast: setup ## unit tests only (no server, tiny weights)
	$(PY) -m pytest -m "not e2e and not slow" $(PYTEST_ARGS)

$(BUILD)/assets-$(SIZE)/.complete: | setup
	$(PY) -m export.synthetic $(BUILD)/assets-$(SIZE) --size $(SIZE)
	@touch $@

assets: $(BUILD)/assets-$(SIZE)/.complete ## write synthetic random-weight assets (SIZE=full|tiny)

clean: ## remove build outputs (keeps .venv)
	rm -rf $(BUILD)
