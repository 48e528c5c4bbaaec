"""The transformers peers' token counts: continuous batching's wait loop, against a stand-in
manager with transformers' queue semantics (finished results in completion order, None on a
timeout), and static batching's per-row counts."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from bench.peers import hf
from bench.peers.protocol import PeerRequest


@dataclass
class FakeResult:
    request_id: str
    generated_tokens: list[int]
    finished: bool = True

    def is_finished(self) -> bool:
        return self.finished


@dataclass
class FakeManager:
    """Hands out `results` one per get_result; after them, None (a timeout) while running."""

    results: list[FakeResult | None]
    running: bool = True

    def get_result(self, request_id: str | None = None,
                   timeout: float | None = None) -> FakeResult | None:
        assert request_id is None, "the loop must not wait on one request id"
        return self.results.pop(0) if self.results else None

    def is_running(self) -> bool:
        return self.running


def test_results_in_any_order_are_all_counted(monkeypatch: pytest.MonkeyPatch) -> None:
    progress: list[int] = []
    monkeypatch.setattr(hf, "report_progress", progress.append)
    manager = FakeManager([FakeResult("b", [1, 2, 3]), None, FakeResult("warm", [9]),
                           FakeResult("a", [4], finished=False), FakeResult("a", [4, 5])])
    assert hf._finish(manager, ["a", "b"]) == {"a": 2, "b": 3}
    assert progress == [1, 2]
    assert manager.results == []


def test_a_generation_loop_that_stops_is_an_error() -> None:
    manager = FakeManager([FakeResult("a", [1])], running=False)
    with pytest.raises(RuntimeError, match="stopped with requests pending"):
        hf._finish(manager, ["a", "b"])


def test_static_rows_count_to_their_first_eos_and_at_most_what_was_asked() -> None:
    eos = 2
    requests = [PeerRequest([7, 8], 3), PeerRequest([9], 3), PeerRequest([5], 1)]
    # Left-padded to width 2, then four generated tokens per row.
    rows = [[7, 8, 11, 12, 13, 14], [eos, 9, 11, eos, eos, eos], [eos, 5, 11, 12, 13, 14]]
    assert hf.generated_counts(rows, 2, eos, requests) == [3, 2, 1]
