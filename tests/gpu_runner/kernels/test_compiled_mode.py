"""The kernels outside the interpreter, on a machine without a GPU.

Both tests run a fresh Python process without TRITON_INTERPRET, so the pytest process never
imports triton (see conftest.py).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[3]


def run_compiled_mode(arguments: list[str], cache_dir: Path) -> subprocess.CompletedProcess:
    environment = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    environment["PYTHONPATH"] = str(REPO_ROOT)
    # A private cache: every run really compiles instead of finding an earlier result.
    environment["TRITON_CACHE_DIR"] = str(cache_dir)
    return subprocess.run(
        [sys.executable, *arguments],
        cwd=REPO_ROOT,
        env=environment,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


@pytest.mark.slow
def test_every_kernel_compiles_for_sm90_without_a_gpu(tmp_path: Path) -> None:
    # bf16 takes the native 16-bit tl.dot path (fp16's too), fp32 the upcast "ieee" one.
    result = run_compiled_mode(
        ["-m", "tests.gpu_runner.kernels.aot_compile", "bf16", "fp32"], tmp_path
    )
    assert result.returncode == 0, result.stderr[-4000:]
    compiled = [line.split(" ok ")[0] for line in result.stdout.splitlines() if " ok " in line]
    kernels = ["store_kv", "decode_partition", "decode_reduce", "prefill"]
    assert compiled == [f"{dtype} {name}" for dtype in ("bf16", "fp32") for name in kernels]


CPU_LAUNCH_WITHOUT_INTERPRETER = """
import torch
from gpu_runner.kernels import store_kv
rows = torch.zeros((2, 1, 16))
cache = torch.zeros((1, 16, 1, 16))
try:
    store_kv(rows, rows, cache, cache, torch.arange(2))
except RuntimeError as error:
    print(error)
"""


def test_cpu_tensors_without_the_interpreter_get_a_clear_error(tmp_path: Path) -> None:
    result = run_compiled_mode(["-c", CPU_LAUNCH_WITHOUT_INTERPRETER], tmp_path)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "set TRITON_INTERPRET=1 before triton is first imported" in result.stdout
