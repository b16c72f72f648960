# chattts-triton: `make demo` and `make test` are all a new user needs. `make help` lists the rest.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
BUILD ?= build
ASSETS ?=
SIZE ?= full
REPO ?= $(BUILD)/repo
FORMATS ?= torchscript
DTYPE ?= auto
HTTP_PORT ?= 8000
GRPC_PORT ?= 8001
METRICS_PORT ?= 8002
HOST ?=
GRPC_URL ?= 127.0.0.1:$(GRPC_PORT)
GATEWAY_HOST ?= 127.0.0.1
GATEWAY_PORT ?= 8080
WYOMING_PORT ?= 10200
GPUS ?=
INSTANCES ?= 1
PROTOCOL ?= grpc
USERS ?= 4
SPAWN_RATE ?= 1
DURATION ?= 60s
MAX_CONCURRENCY ?= 64
STEP_SECONDS ?= 20
TARGET = $(or $(HOST),127.0.0.1:$(if $(filter http,$(PROTOCOL)),$(HTTP_PORT),$(GRPC_PORT)))
SOAK_SECONDS ?= 1800
PERF_CONCURRENCY ?= 1,8,64,256
FRAMES ?= 150
GPU_MEMORY_GB ?=
PYTEST_ARGS ?=

ifeq ($(strip $(ASSETS)),)
ASSETS_DIR := $(BUILD)/assets-$(SIZE)
ASSETS_DEP := $(BUILD)/assets-$(SIZE)/.complete
SYNTHETIC := --synthetic
else
ASSETS_DIR := $(ASSETS)
ASSETS_DEP :=
SYNTHETIC :=
endif

.DEFAULT_GOAL := help
.PHONY: help setup lint test test-fast assets export configure serve gateway wyoming demo loadtest sweep perf soak bundle client-wheel clean

help: ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | sed -E 's/:.*## /\t/' | column -t -s $$'\t'

$(VENV)/.installed: requirements.txt pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q --no-cache-dir -r requirements.txt  # no second copy of torch's CUDA wheels in pip's cache
	$(PY) -m pip install -q --no-deps -e .
	@touch $@

setup: $(VENV)/.installed ## build .venv with the pinned dependencies (idempotent)

lint: setup ## ruff over the whole tree (pyproject.toml's [tool.ruff])
	$(VENV)/bin/ruff check .

test: lint ## lint, then the whole suite: unit, export parity, end-to-end against a real tritonserver
	$(PY) -m pytest $(PYTEST_ARGS)

test-fast: setup ## unit tests only (no server, no full-size weights)
	$(PY) -m pytest -m "not e2e and not slow" $(PYTEST_ARGS)

$(BUILD)/assets-$(SIZE)/.complete: | setup
	$(PY) -m export.synthetic $(BUILD)/assets-$(SIZE) --size $(SIZE)
	@touch $@

assets: $(BUILD)/assets-$(SIZE)/.complete ## write random-weight assets of the upstream architecture (SIZE=full|tiny)

export: setup $(ASSETS_DEP) ## export ASSETS=DIR (default: synthetic) into REPO (FORMATS, DTYPE, GPUS, INSTANCES, GPT_COMPILE=0 for the TorchScript step on GPUs)
	$(PY) -m export --assets $(ASSETS_DIR) --out $(REPO) --formats $(FORMATS) --dtype $(DTYPE) --gpus "$(GPUS)" --instances $(INSTANCES) $(if $(GPT_COMPILE),$(if $(filter 0,$(GPT_COMPILE)),--no-gpt-compile,--gpt-compile))

configure: setup ## set instance groups of REPO: GPUS=0,1 INSTANCES=2 (empty GPUS: CPU), GPT_COMPILE=1|0, GPU_MEMORY_GB=15 (size for a 15-GiB card)
	$(PY) -m chattts_triton.repo_config --repo $(REPO) --gpus "$(GPUS)" --instances $(INSTANCES) $(if $(GPT_COMPILE),$(if $(filter 0,$(GPT_COMPILE)),--no-gpt-compile,--gpt-compile)) $(if $(GPU_MEMORY_GB),--gpu-memory-gb $(GPU_MEMORY_GB))

serve: setup ## run Triton on REPO in the foreground, bound to 127.0.0.1 (HTTP_PORT, GRPC_PORT, METRICS_PORT)
	$(PY) -m chattts_triton.serve --repo $(REPO) --http-port $(HTTP_PORT) --grpc-port $(GRPC_PORT) --metrics-port $(METRICS_PORT) --log-file $(BUILD)/tritonserver.log

gateway: setup ## OpenAI-compatible speech gateway in the foreground against a running server: GRPC_URL= GATEWAY_HOST= GATEWAY_PORT= (REPO's voices)
	$(PY) -m gateway --grpc-url $(GRPC_URL) --host $(GATEWAY_HOST) --port $(GATEWAY_PORT) $(if $(wildcard $(REPO)/manifest.json),--repo $(REPO))

wyoming: setup ## Wyoming text-to-speech server for Home Assistant against a running server: GRPC_URL= GATEWAY_HOST= WYOMING_PORT= (REPO's voices)
	$(PY) -m gateway.wyoming --grpc-url $(GRPC_URL) --host $(GATEWAY_HOST) --port $(WYOMING_PORT) $(if $(wildcard $(REPO)/manifest.json),--repo $(REPO))

demo: export ## set up, export (ASSETS=DIR or synthetic noise), serve, synthesise build/demo.wav over gRPC, stream it, build/demo.mp3 through the speech gateway, stop
	$(PY) -m client.demo --repo $(REPO) --out $(BUILD)/demo.wav $(SYNTHETIC)

loadtest: setup ## Locust (headless) against a running server: HOST= PROTOCOL=grpc|http USERS= SPAWN_RATE= DURATION= -> build/loadtest
	$(PY) -m loadtest.run --host $(TARGET) --protocol $(PROTOCOL) --users $(USERS) --spawn-rate $(SPAWN_RATE) --duration $(DURATION) --out $(BUILD)/loadtest

sweep: setup ## concurrency sweep 1,2,4..MAX_CONCURRENCY: HOST= PROTOCOL= MAX_CONCURRENCY= STEP_SECONDS= -> build/sweep/sweep.{md,csv,json,png}
	$(PY) -m loadtest.sweep --url $(TARGET) --protocol $(PROTOCOL) --max-concurrency $(MAX_CONCURRENCY) --step-seconds $(STEP_SECONDS) --metrics-url $(firstword $(subst :, ,$(TARGET))):$(METRICS_PORT) --out $(BUILD)/sweep

perf: setup ## Triton's perf_analyzer against a running server (gRPC): HOST= PERF_CONCURRENCY=1,8,64,256 FRAMES=150 -> build/perf
	$(PY) -m bench.perf --url $(or $(HOST),127.0.0.1:$(GRPC_PORT)) --concurrency $(PERF_CONCURRENCY) --frames $(FRAMES) --out $(BUILD)/perf

soak: setup ## reliability soak: 70 % of saturation on the tiny CPU server (SOAK_SECONDS=1800), writes build/soak/soak.json
	CHATTTS_SOAK_SECONDS=$(SOAK_SECONDS) CHATTTS_SOAK_OUT=$(BUILD)/soak $(PY) -m pytest -m soak -s --timeout=$$(( $(SOAK_SECONDS) + 900 )) tests/test_soak.py $(PYTEST_ARGS)

bundle: setup ## gather wheels + tritonserver files for a GPU host without a package index (into .bundle/)
	$(PY) -m tools.bundle .bundle

client-wheel: setup ## the client alone (chattts-triton-client, import chattts_client: numpy + tritonclient, no torch) -> build/dist/
	$(PY) -m pip wheel --no-deps -q -w $(BUILD)/dist packaging/client
	@ls $(BUILD)/dist/chattts_triton_client-*.whl

clean: ## remove build outputs (keeps .venv)
	rm -rf $(BUILD) packaging/client/build packaging/client/src
