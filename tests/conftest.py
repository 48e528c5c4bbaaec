"""Session fixtures shared by every test package."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# Runner processes started by the tests (they inherit this environment) take the panel kernel
# for decode rows and MKL sgemm above without measuring kernels at start: the measurement
# costs seconds per runner, dozens of runners start in a run, and which kernel wins is not
# what those tests check (tests/gpu_runner/test_linear.py checks the tuning and every kernel's
# parity; a test that wants the tuned start sets the flag itself).
os.environ.setdefault("PAGEWIRE_RUNNER_LINEAR_BACKEND", "panels")
# Before any test imports grpc: the block service's journal forks a child for each snapshot
# (in-process servers and cores in the tests too), which gRPC's fork support would fill with
# gRPC threads (block_service/journal.py, GRPC_FORK_SUPPORT). `python -m block_service` sets
# it itself.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "0")


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """The default model (SmolLM2-135M-Instruct) as a converted Hugging Face folder
    (converted once into the pagewire cache, then reused across runs)."""
    from common.model_store import resolve_model

    return resolve_model(None)
