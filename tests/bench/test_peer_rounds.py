"""serve_bench runs every peer once per W1 round, between pagewire's rounds, and reports its
totals over the rounds; a peer that fails in one round keeps that status and is not run again."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import serve_bench
from bench.peers.child import PeerOutcome


@pytest.fixture
def results(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> serve_bench.Results:
    monkeypatch.setattr(serve_bench, "chart", lambda data, path: None)  # no matplotlib work
    return serve_bench.Results(tmp_path, fresh=True)


def test_peer_rows_are_totals_over_rounds_and_a_failure_sticks(results, monkeypatch):
    outcomes = {
        "W1 transformers static, round 1/2": PeerOutcome(10.0, 1000, {"threads": 2}),
        "W1 transformers static, round 2/2": PeerOutcome(30.0, 1000, {"threads": 2}),
        "W1 transformers continuous, round 1/2": PeerOutcome(status="timed out after 5 s"),
    }
    calls: list[str] = []

    def fake_run_peer(label, command, requests, timeout_s):
        calls.append(label)
        return outcomes[label]

    monkeypatch.setattr(serve_bench, "run_peer", fake_run_peer)
    monkeypatch.setattr(serve_bench, "_peer_command",
                        lambda key, model_dir: None if key == "vllm" else ["peer", key])
    monkeypatch.setattr(serve_bench, "W1_ROUNDS", 2)
    peers = serve_bench.PeerRounds(Path("model"), ["hf-static", "hf-cb", "vllm"], 5.0, results)
    peers.run_round()
    peers.run_round()

    assert calls == ["W1 transformers static, round 1/2", "W1 transformers continuous, round 1/2",
                     "W1 transformers static, round 2/2"]
    rows = results.data["peers"]
    static = rows["transformers static"]
    assert (static["seconds"], static["output_tokens"], static["rounds"]) == (40.0, 2000, 2)
    assert static["tokens_per_s"] == pytest.approx(50.0)  # 2000 tokens in 40 s, not (100+33)/2
    assert rows["transformers continuous"]["status"] == "timed out after 5 s"
    assert rows["vLLM CPU"]["status"] == "not installed (make bench-peers)"


def test_a_failed_round_replaces_the_totals():
    total = PeerOutcome(10.0, 500, {"threads": 2})
    assert serve_bench.add_outcomes(total, PeerOutcome(status="failed")).status == "failed"
    assert serve_bench.add_outcomes(None, PeerOutcome(5.0, 100)).output_tokens == 100
