"""bench/gateway_step.py runs the runner loop's per-step work over the real block-service core
and checks that every row decoded a token per step."""

from __future__ import annotations

import pytest

from bench import gateway_step


def test_every_row_decodes_a_token_per_step(capsys: pytest.CaptureFixture[str]) -> None:
    assert gateway_step.main(["--rows", "8", "--steps", "6", "--warm-steps", "3",
                              "--stream-interval", "2"]) == 0
    out = capsys.readouterr().out
    assert "8 decoding rows, stream interval 2, 6 steps" in out
