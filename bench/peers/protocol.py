"""How serve_bench talks to a peer it runs in a child process (standard library only, because
the vLLM peer imports it from its own virtual environment).

    PEER_SCRIPT [--dtype DTYPE] MODEL_DIR
The peer loads its model once, in DTYPE (float32 by default; serve_bench runs W1 once per dtype
of its --dtypes, each peer in the dtype of the pagewire rows it is compared with), and then
serves runs for as long as serve_bench keeps it, as pagewire's services stay up across the
rounds of a benchmark: every engine keeps one process for its warm-up and all its timed rounds.
serve_bench writes one line per run on the peer's stdin, {"workload": PATH, "result": PATH},
and closes stdin when it is done with the peer.

A workload is a list of {"prompt_token_ids": [...], "max_tokens": N} (with "adapter": PATH, a
PEFT LoRA adapter's folder, for a request on an adapter: the peer is then started with
`--max-loras N --max-lora-rank R`). While a run goes, the
peer prints `progress K` lines on stdout (K requests finished) for the parent's progress bar;
at its end it writes {"seconds": ..., "output_tokens": [per request, in workload order],
"settings": {...}} to the result path and prints `done`. The token counts are what the peer's
own API handed back for each request; serve_bench checks each against `max_tokens`, and
checks the seconds against its own clock from command to `done`. Logs go to stderr (a line on
stdout that is not the protocol's goes to the peer's log too).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PROGRESS_PREFIX = "progress "
DTYPES = ("float32", "bfloat16")
DONE = "done"


@dataclass(frozen=True)
class PeerRequest:
    """One workload request as a peer sees it."""

    prompt_token_ids: list[int]
    max_tokens: int
    adapter: str = ""  # a LoRA adapter's folder; "" for the base model


@dataclass(frozen=True)
class RunResult:
    """What a peer reports for one run: its timed seconds, the tokens each request produced
    (workload order) and the settings it ran with."""

    seconds: float
    output_tokens: list[int]
    settings: dict[str, Any]


# A peer's engine: runs one workload and reports it.
Engine = Callable[[list[PeerRequest]], RunResult]


def write_workload(path: Path, requests: list[PeerRequest]) -> None:
    path.write_text(json.dumps(
        [{"prompt_token_ids": r.prompt_token_ids, "max_tokens": r.max_tokens,
          **({"adapter": r.adapter} if r.adapter else {})} for r in requests]))


def read_workload(path: Path) -> list[PeerRequest]:
    return [PeerRequest(list(r["prompt_token_ids"]), int(r["max_tokens"]),
                        str(r.get("adapter", ""))) for r in json.loads(path.read_text())]


def run_command(workload: Path, result: Path) -> str:
    """The stdin line that asks a peer for one run."""
    return json.dumps({"workload": str(workload), "result": str(result)}) + "\n"


def read_result(path: Path) -> RunResult:
    measured = json.loads(path.read_text())
    return RunResult(float(measured["seconds"]), [int(n) for n in measured["output_tokens"]],
                     dict(measured.get("settings", {})))


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


@dataclass(frozen=True)
class PeerArgs:
    """A peer's command line: the model folder and the dtype to load it in."""

    model_dir: str
    dtype: str = "float32"
    max_loras: int = 0  # LoRA adapters one batch may use; 0: none served
    max_lora_rank: int = 16


def peer_args(argv: list[str]) -> PeerArgs:
    """Parses `[--dtype DTYPE] [--max-loras N --max-lora-rank R] MODEL_DIR` (what follows the
    peer's own leading arguments)."""
    parser = argparse.ArgumentParser(
        usage="PEER_SCRIPT [--dtype DTYPE] [--max-loras N --max-lora-rank R] MODEL_DIR "
              "(then run commands on stdin)")
    parser.add_argument("--dtype", default="float32", choices=DTYPES)
    parser.add_argument("--max-loras", type=int, default=0)
    parser.add_argument("--max-lora-rank", type=int, default=16)
    parser.add_argument("model_dir")
    args = parser.parse_args(argv)
    return PeerArgs(args.model_dir, args.dtype, args.max_loras, args.max_lora_rank)


def peer_command(script: list[str], model_dir: str, dtype: str, max_loras: int = 0,
                 max_lora_rank: int = 16) -> list[str]:
    """The command line that starts a peer (`script`: its interpreter, file and own leading
    arguments) for `model_dir` in `dtype`, serving LoRA adapters with `max_loras`; the
    inverse of peer_args."""
    lora = ["--max-loras", str(max_loras), "--max-lora-rank", str(max_lora_rank)] \
        if max_loras else []
    return [*script, "--dtype", dtype, *lora, model_dir]


def serve(engine: Engine) -> None:
    """Answers run commands from stdin until it closes."""
    for line in sys.stdin:
        if not line.strip():
            continue
        command = json.loads(line)
        outcome = engine(read_workload(Path(command["workload"])))
        Path(command["result"]).write_text(json.dumps(
            {"seconds": outcome.seconds, "output_tokens": outcome.output_tokens,
             "settings": outcome.settings}))
        print(DONE, flush=True)
