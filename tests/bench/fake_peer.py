"""A stand-in peer that speaks bench/peers/protocol.py, for serve_bench's tests.

    fake_peer.py MODE PID_FILE [--dtype DTYPE] MODEL_DIR
MODE: `ok` (every request gets its max_tokens), `short` (the last request of every run gets
one token fewer), `slow-clock` (reports 1000 s for every run), `crash` (exits 3 at its first
run), `hang` (starts a child and sleeps). Each result's settings carry the peer's pid, so a
test can see one process serve every run, and the dtype it was started with; except in `hang`
mode it also writes the pid to PID_FILE.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.peers.protocol import (  # noqa: E402
    PeerRequest,
    RunResult,
    peer_args,
    peer_command,
    report_progress,
    serve,
)


def command(mode: str, pid_file: Path, model_dir: str = "model",
            dtype: str = "float32") -> list[str]:
    """The command line that starts this fake peer (serve_bench adds nothing to it)."""
    return peer_command([sys.executable, str(Path(__file__).resolve()), mode, str(pid_file)],
                        model_dir, dtype)


def main() -> None:
    mode, pid_file = sys.argv[1:3]
    dtype = peer_args(sys.argv[3:]).dtype
    if mode != "hang":
        Path(pid_file).write_text(str(os.getpid()))

    def run(requests: list[PeerRequest]) -> RunResult:
        if mode == "crash":
            print("boom", file=sys.stderr)
            sys.exit(3)
        if mode == "hang":
            child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
            Path(pid_file).write_text(str(child.pid))
            time.sleep(600)
        counts = [r.max_tokens for r in requests]
        if mode == "short":
            counts[-1] -= 1
        for finished in range(1, len(requests) + 1):
            report_progress(finished)
        return RunResult(1000.0 if mode == "slow-clock" else 1e-4, counts, {"pid": os.getpid(),
                                                                        "dtype": dtype})

    serve(run)


if __name__ == "__main__":
    main()
