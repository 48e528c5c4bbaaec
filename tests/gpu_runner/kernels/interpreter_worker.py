"""The worker process of the interpreted kernel tests (see conftest.py for why)."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from typing import Any, TypeVar

Result = TypeVar("Result")


def enable_interpreter() -> None:
    """Worker initializer: runs before the worker unpickles (imports) any test case."""
    if "triton" in sys.modules:
        raise RuntimeError("triton was imported before TRITON_INTERPRET could be set")
    os.environ["TRITON_INTERPRET"] = "1"


class InterpreterWorker:
    """Runs module-level functions on picklable arguments in the interpreter process."""

    def __init__(self, executor: ProcessPoolExecutor) -> None:
        self._executor = executor

    def run(self, function: Callable[..., Result], *args: Any) -> Result:
        return self._executor.submit(function, *args).result()
