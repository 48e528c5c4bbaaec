"""`pagewire serve --dtype`: from the command line to every runner's command line (the children's
commands are read, no process is started)."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from gateway.cli import build_parser, launch_config
from gateway.launcher import RUNNER_DTYPES, Child, Launcher
from gpu_runner.__main__ import parse_args as runner_args
from gpu_runner.runner import DTYPES


def started_children(argv: list[str], tmp_path: Path,
                     monkeypatch: pytest.MonkeyPatch) -> list[Child]:
    """The children `pagewire serve <argv>` would start, in order."""
    started: list[Child] = []
    monkeypatch.setattr(Launcher, "_start_children",
                        lambda self, children: started.extend(children))
    args = build_parser().parse_args(["serve", "--log-dir", str(tmp_path), *argv])
    Launcher(launch_config(args)).start()
    return started


def runner_commands(children: list[Child]) -> list[list[str]]:
    """The arguments after `python -m gpu_runner` of each runner."""
    return [child.command[3:] for child in children if child.name.startswith("gpu_runner")]


@pytest.mark.parametrize("dtype", RUNNER_DTYPES)
def test_dtype_reaches_every_runner_and_only_runners(
        dtype: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    children = started_children(["--dtype", dtype, "--runners", "2", "--gateways", "2"],
                                tmp_path, monkeypatch)
    commands = runner_commands(children)
    assert len(commands) == 2
    # The runner's own parser reads the flag the launcher wrote.
    assert [runner_args(command).dtype for command in commands] == [dtype, dtype]
    others = [child for child in children if not child.name.startswith("gpu_runner")]
    assert len(others) == 3 and all("--dtype" not in child.command for child in others)


def test_without_dtype_the_runner_keeps_its_default(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PAGEWIRE_RUNNER_DTYPE", raising=False)
    [command] = runner_commands(started_children([], tmp_path, monkeypatch))
    assert "--dtype" not in command
    assert runner_args(command).dtype is None  # float32 on CPU, bfloat16 on CUDA


def test_an_unknown_dtype_is_refused_before_anything_starts(
        capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--dtype", "int8"])
    assert "invalid choice: 'int8'" in capsys.readouterr().err


def test_the_cli_offers_the_runner_s_dtypes() -> None:
    assert set(RUNNER_DTYPES) == set(DTYPES)


def test_free_ports_lie_below_the_ephemeral_range() -> None:
    # A service binds its port only after start-up: a port from the ephemeral range could be
    # taken meanwhile by an outgoing connection.
    from gateway import launcher

    low = launcher._ephemeral_low()
    ports = {launcher.free_port() for _ in range(20)}
    if low > launcher._PORT_FLOOR + 1000:
        assert all(launcher._PORT_FLOOR <= port < low for port in ports)
    for port in ports:  # free: bindable now
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))
