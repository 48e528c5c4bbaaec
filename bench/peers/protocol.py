"""How serve_bench talks to a peer it runs in a child process (standard library only, because
the vLLM peer imports it from its own virtual environment).

    PEER_SCRIPT MODEL_DIR WORKLOAD.json RESULT.json
The workload is a list of {"prompt_token_ids": [...], "max_tokens": N}. While it runs, the
peer prints `progress K` lines on stdout (K requests finished) for the parent's progress bar;
at the end it writes {"seconds": ..., "output_tokens": ..., "settings": {...}} to RESULT.json.
Its logs go to stderr.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PROGRESS_PREFIX = "progress "


@dataclass(frozen=True)
class PeerRequest:
    """One workload request as a peer sees it."""

    prompt_token_ids: list[int]
    max_tokens: int


@dataclass(frozen=True)
class PeerArgs:
    """The command line every peer script takes."""

    model_dir: str
    workload_path: Path
    result_path: Path


def parse_args(argv: list[str]) -> PeerArgs:
    if len(argv) != 3:
        raise SystemExit("usage: PEER_SCRIPT MODEL_DIR WORKLOAD.json RESULT.json")
    return PeerArgs(argv[0], Path(argv[1]), Path(argv[2]))


def write_workload(path: Path, requests: list[PeerRequest]) -> None:
    path.write_text(json.dumps(
        [{"prompt_token_ids": r.prompt_token_ids, "max_tokens": r.max_tokens} for r in requests]))


def read_workload(path: Path) -> list[PeerRequest]:
    return [PeerRequest(list(r["prompt_token_ids"]), int(r["max_tokens"]))
            for r in json.loads(path.read_text())]


def report_progress(finished: int) -> None:
    print(f"{PROGRESS_PREFIX}{finished}", flush=True)


def parse_progress(line: str) -> int | None:
    """The finished count of a `progress K` line; None for any other line."""
    if not line.startswith(PROGRESS_PREFIX):
        return None
    try:
        return int(line[len(PROGRESS_PREFIX):])
    except ValueError:
        return None


def write_result(path: Path, seconds: float, output_tokens: int,
                 settings: dict[str, Any]) -> None:
    path.write_text(json.dumps(
        {"seconds": seconds, "output_tokens": output_tokens, "settings": settings}))


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
