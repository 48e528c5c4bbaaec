"""`pagewire serve --lora-modules / --max-loras / --max-lora-rank`: from the command line to
the gateways' and runners' command lines (read, not started), and the gateway's own flag."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from gateway.config import add_gateway_arguments, config_from_args
from gateway.launcher import DEFAULT_MAX_LORAS, Child
from gpu_runner.__main__ import parse_args as runner_args
from tests.gateway.test_serve_dtype import runner_commands, started_children


def gateway_commands(children: list[Child]) -> list[list[str]]:
    return [child.command for child in children if child.name.startswith("gateway")]


def test_lora_modules_reach_every_gateway_and_turn_on_the_runners_slots(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    children = started_children(["--lora-modules", "sql=/a/sql", "chat=/a/chat",
                                 "--runners", "2", "--gateways", "2"], tmp_path, monkeypatch)
    for command in gateway_commands(children):
        at = command.index("--lora-modules")
        assert command[at + 1:at + 3] == ["sql=/a/sql", "chat=/a/chat"]
    # The runner's own parser reads what the launcher wrote.
    assert [runner_args(c).max_loras for c in runner_commands(children)] == [
        DEFAULT_MAX_LORAS] * 2


def test_max_loras_and_rank_are_passed_as_given(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    children = started_children(["--lora-modules", "sql=/a/sql", "--max-loras", "2",
                                 "--max-lora-rank", "64"], tmp_path, monkeypatch)
    [command] = runner_commands(children)
    assert (runner_args(command).max_loras, runner_args(command).max_lora_rank) == (2, 64)


def test_without_lora_flags_nothing_is_passed(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    children = started_children([], tmp_path, monkeypatch)
    [command] = runner_commands(children)
    assert "--max-loras" not in command and "--max-lora-rank" not in command
    assert all("--lora-modules" not in c for c in gateway_commands(children))


def test_the_gateway_flag_takes_name_path_pairs(capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    add_gateway_arguments(parser)
    config = config_from_args(parser.parse_args(["--lora-modules", "a=/x", "b/c:1=/y=z"]))
    assert config.lora_modules == [("a", "/x"), ("b/c:1", "/y=z")]
    with pytest.raises(SystemExit):
        parser.parse_args(["--lora-modules", "no-path"])
    assert "give name=path" in capsys.readouterr().err
