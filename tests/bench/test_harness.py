"""bench/harness.py: the helpers every bench shares (ports, percentiles, result files, the
processes a bench starts and reads)."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from bench.harness import (
    ProcessCounters,
    free_port_run,
    percentile,
    proc_stat,
    run_header,
    save_results,
    service_counters,
    wait_for,
)
from gateway.launcher import _PORT_FLOOR, _ephemeral_low

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("count", [1, 2, 4])
def test_a_port_run_is_free_to_bind_and_starts_below_the_ephemeral_range(count: int) -> None:
    base = free_port_run(count)
    with contextlib.ExitStack() as stack:
        for port in range(base, base + count):
            stack.enter_context(socket.socket()).bind(("127.0.0.1", port))
    low = _ephemeral_low()
    if low > _PORT_FLOOR + 1000:  # the launcher draws below the range where it leaves room
        assert base < low


def test_percentile_is_the_nearest_measured_rank() -> None:
    values = [5.0, 1.0, 4.0, 2.0, 3.0]
    assert percentile(values, 0.5) == 3.0
    assert percentile(values, 0.0) == 1.0
    assert percentile(values, 0.99) == 5.0
    assert percentile(values, 1.0) == 5.0
    assert percentile([], 0.5) == 0.0


def test_the_header_names_the_command_as_run_from_the_checkout() -> None:
    header = run_header("bench/x.py", ["--quick", "--runs", "2"])
    assert list(header) == ["command", "measured_at"]
    assert header["command"] == ".venv/bin/python bench/x.py --quick --runs 2"
    assert header["measured_at"].endswith("+00:00")


def test_saved_results_name_no_folder_of_this_machine(tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]
                                                      ) -> None:
    """Results are committed: the checkout, the home and the temp folder are written as any
    machine has them."""
    data = {"command": f"{ROOT}/.venv/bin/pagewire serve --model {Path.home()}/.cache/m",
            "logs": f"{tempfile.gettempdir()}/openai-serve-x"}
    save_results(tmp_path, "t", data, f"`{ROOT}/bench/x.py` {Path.home()}/a")
    written = (tmp_path / "t.json").read_text() + (tmp_path / "t.md").read_text()
    for folder in (ROOT, Path.home(), Path(tempfile.gettempdir())):
        assert f"{folder}/" not in written
    assert json.loads((tmp_path / "t.json").read_text()) == {
        "command": ".venv/bin/pagewire serve --model ~/.cache/m",
        "logs": "$TMPDIR/openai-serve-x"}
    assert capsys.readouterr().out == f"\n`{ROOT}/bench/x.py` {Path.home()}/a\n"  # as given
    save_results(tmp_path / "quiet", "t", data, "table", echo=False)
    assert capsys.readouterr().out == ""
    assert (tmp_path / "quiet" / "t.md").read_text() == "table"


def test_wait_for_names_what_it_waited_for() -> None:
    wait_for("nothing", lambda: True, [], 1.0)
    with pytest.raises(RuntimeError, match="timed out waiting for the moon"):
        wait_for("the moon", lambda: False, [], 0.3)
    exited = subprocess.Popen([sys.executable, "-c", "pass"])
    exited.wait()
    with pytest.raises(RuntimeError, match="a process exited while waiting for the sun"):
        wait_for("the sun", lambda: False, [exited], 30.0)


def test_this_process_counters_add_up() -> None:
    counters = service_counters(os.getpid())
    assert isinstance(counters, ProcessCounters)
    assert counters.cpu_s >= counters.kernel_s >= 0.0
    assert counters.switches > 0
    assert int(proc_stat(f"/proc/{os.getpid()}/stat")[1]) == os.getppid()
