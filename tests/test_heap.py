"""The collector settings a started service runs with (common/heap.py), in fresh processes: a
test process's own heap and collector stay as they are."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_python(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT,
                          capture_output=True, text=True, timeout=60, check=True)
    return done.stdout.strip()


def test_freeze_moves_the_heap_out_of_view_and_keeps_the_thresholds() -> None:
    out = run_python("""
        import gc
        from common.heap import freeze_start_up_heap
        before = gc.get_threshold()
        assert gc.get_freeze_count() == 0
        freeze_start_up_heap()
        print(gc.get_freeze_count() > 1000, gc.get_threshold() == before)
    """)
    assert out == "True True"


def test_a_service_freezes_its_heap_once_it_serves() -> None:
    """run_until_signal (every service's main ends in it) freezes before it waits."""
    out = run_python("""
        import gc, os, signal, threading
        from common import server
        class Service:
            grace_s = 0.0
            def stop(self):
                print("stopped", gc.get_freeze_count() > 1000)
        threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGTERM)).start()
        print("exit", server.run_until_signal(Service()))
    """)
    assert out.splitlines() == ["stopped True", "exit 0"]
