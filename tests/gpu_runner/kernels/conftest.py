"""Runs the kernel tests' CPU cases in a worker process that imports triton interpreted.

Why a worker process: Triton reads TRITON_INTERPRET once, when triton is imported; from
then on every ``@triton.jit`` function in the process, triton's own ``tl.zeros`` or
``tl.max`` included, is compiled-only or interpreted for good. Setting the variable in this
conftest or at the top of a test module only works if nothing imported triton earlier in
the pytest session, which depends on which files are collected and in what order (another
package's test, or tests/gpu_runner/conftest.py importing the runner, comes first). A spawned worker
starts with a fresh interpreter: `enable_interpreter` sets the variable before anything in
it can import triton, whatever the pytest process did, and the pytest process itself never
imports triton for the CPU cases, so it leaves the session as it found it. On a CUDA
machine the GPU tests import the kernels in the pytest process and compile them for real.
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor

import pytest

from tests.gpu_runner.kernels.interpreter_worker import InterpreterWorker, enable_interpreter


@pytest.fixture(scope="session")
def interpreter() -> Iterator[InterpreterWorker]:
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(
        max_workers=1, mp_context=context, initializer=enable_interpreter
    ) as executor:
        yield InterpreterWorker(executor)
