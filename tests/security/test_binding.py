"""Where the services listen by default: loopback only, for each service and for
`pagewire serve` (its children's command lines are read, no process is started)."""

from __future__ import annotations

from pathlib import Path

import pytest

from block_service.__main__ import parse_args as block_service_args
from gateway.cli import build_parser as cli_parser
from gateway.launcher import Child, LaunchConfig, Launcher
from gateway.server import build_parser as gateway_parser
from gpu_runner.__main__ import parse_args as runner_args


def test_every_service_binds_loopback_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("BLOCK_SERVICE", "RUNNER", "GATEWAY"):
        monkeypatch.delenv(f"PAGEWIRE_{name}_HOST", raising=False)
    assert block_service_args([]).host == "127.0.0.1"
    assert runner_args([]).host == "127.0.0.1"
    assert gateway_parser().parse_args([]).host == "127.0.0.1"
    assert cli_parser().parse_args(["serve"]).host == "127.0.0.1"


def child_hosts(host: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """The --host each child of `pagewire serve --host <host>` is given."""
    started: list[Child] = []
    monkeypatch.setattr(Launcher, "_start_children",
                        lambda self, children: started.extend(children))
    Launcher(LaunchConfig(host=host, log_dir=tmp_path)).start()
    return {child.name: child.command[child.command.index("--host") + 1] for child in started}


def test_serve_binds_every_service_to_loopback_by_default(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert child_hosts("127.0.0.1", tmp_path, monkeypatch) == {
        "block_service": "127.0.0.1", "gpu_runner": "127.0.0.1", "gateway": "127.0.0.1"}


def test_serve_keeps_internal_services_on_loopback_when_the_gateway_is_public(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    hosts = child_hosts("0.0.0.0", tmp_path, monkeypatch)
    assert hosts["gateway"] == "0.0.0.0"
    assert hosts["block_service"] == "127.0.0.1" and hosts["gpu_runner"] == "127.0.0.1"
