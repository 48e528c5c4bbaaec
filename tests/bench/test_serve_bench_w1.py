"""serve_bench's W1: the offline (final_only) and streamed runs swap order every round, the
ceiling replays the offline runs' batches only, the machine settles before every run and after
the last round, and the table's ratios are the totals'."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import serve_bench, step_profile
from bench.timing import RequestTiming, RunSummary
from bench.workloads import BenchRequest


@pytest.fixture
def results(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> serve_bench.Results:
    monkeypatch.setattr(serve_bench, "chart", lambda data, path: None)  # no matplotlib work
    return serve_bench.Results(tmp_path, fresh=True)


def test_offline_and_streamed_runs_alternate_and_the_ceiling_replays_offline_runs(
        results: serve_bench.Results, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    runs: list[tuple[str, bool]] = []
    events: list[str] = []

    record_path = tmp_path / "rec"

    def fake_run(address: str, label: str, requests: list[BenchRequest],
                 allow_errors: bool = False) -> RunSummary:
        final_only = {r.final_only for r in requests}
        assert len(final_only) == 1
        assert len({r.cache_salt for r in requests}) == 1
        runs.append((requests[0].cache_salt, final_only.pop()))
        events.append("offline" if runs[-1][1] else "streamed")
        with open(record_path, "a") as record:  # what the runner records
            record.write(events[-1])
        # 100 tokens: offline runs take 1 s, streamed ones 2 s.
        return RunSummary(1.0 if runs[-1][1] else 2.0,
                          [RequestTiming(sent=0.0, output_tokens=100)])

    def fake_replay(runner: object, path: Path) -> float:
        assert path.read_text() == "offline"  # that run's batches alone
        events.append("replay")
        return 0.5

    empty = step_profile.Snapshot({}, {}, {})
    monkeypatch.setattr(serve_bench, "_run", fake_run)
    monkeypatch.setattr(serve_bench, "replay", fake_replay)
    monkeypatch.setattr(serve_bench, "ModelRunner", lambda options: object())
    monkeypatch.setattr(serve_bench, "wait_until_quiet", lambda: events.append("settle") or 0.0)
    monkeypatch.setattr(step_profile, "take_snapshot", lambda port: empty)
    monkeypatch.setattr(serve_bench, "W1_ROUNDS", 2)
    results.start_pagewire()
    serve_bench.run_w1("addr", 0, record_path, Path("model"), results,
                       after_round=lambda: events.append("peers"))

    assert events == ["settle", "offline", "replay", "settle", "streamed", "peers",
                      "settle", "streamed", "settle", "offline", "replay", "peers", "settle"]
    assert len({salt for salt, _ in runs}) == 4  # no run reuses another's cached prompts
    pagewire = results.data["pagewire"]
    assert pagewire["w1"]["tokens_per_s"] == pytest.approx(100.0)
    assert pagewire["w1_streamed"]["tokens_per_s"] == pytest.approx(50.0)
    assert results.data["ceiling"]["tokens_per_s"] == pytest.approx(200.0)
    table = serve_bench.markdown(results.data)
    assert "| ceiling (runner alone, same batches) | 200.0 | 0.50 (efficiency) |" in table
    assert "| pagewire streamed: a message per step per request | 50.0 | 2.00 |" in table
    assert "pagewire streamed ÷ row: ceiling 0.25." in table
