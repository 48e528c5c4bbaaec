"""openai_serve's reading of vLLM's client results, without servers: a run that completed every
request with exactly the tokens asked passes; failed requests, missing completions or short
outputs are flagged and leave the engine unranked; "sustained" follows the client's send times;
the targets and the table come from the rows."""

from __future__ import annotations

import math
from typing import Any

import pytest

from bench import openai_serve
from bench.openai_serve import Answer, Load, TransportRun, check, summarize, sustain_share
from bench.workloads import BenchRequest

N, OUT = 4, 16


def result(**changes: Any) -> dict[str, Any]:
    """A `vllm bench serve --save-detailed` result of N requests at 1 req/s that kept up: sent
    at 0, 1, 2, 3 s, each answered in 0.5 s."""
    raw: dict[str, Any] = {
        "duration": 3.5, "completed": N, "failed": 0, "total_input_tokens": N * 64,
        "total_output_tokens": N * OUT, "request_throughput": N / 3.5,
        "output_throughput": N * OUT / 3.5, "total_token_throughput": N * (64 + OUT) / 3.5,
        "max_concurrent_requests": 1,
        "output_lens": [OUT] * N, "start_times": [100.0, 101.0, 102.0, 103.0],
        "latencies": [0.5] * N, "errors": [""] * N,
    }
    for metric in openai_serve.METRICS:
        for stat, value in (("mean", 20.0), ("p50", 18.0), ("p99", 40.0)):
            raw[f"{stat}_{metric}_ms"] = value
    raw.update(changes)
    return raw


LOAD = Load(rate=1.0, num_prompts=N, input_len=64, output_len=OUT, seed=0)


def test_a_clean_run_passes_its_checks_and_is_sustained() -> None:
    row = summarize(result(), LOAD)
    assert row["problems"] == []
    assert row["sustained"] is True
    assert row["sustain_share"] == pytest.approx(1.0)
    assert row["offered_rate"] == pytest.approx(1.0)
    assert row["p99_ttft_ms"] == 40.0 and row["output_throughput"] == pytest.approx(N * OUT / 3.5)


def test_failed_requests_are_flagged_with_an_example() -> None:
    raw = result(completed=N - 1, failed=1, total_output_tokens=(N - 1) * OUT,
                 output_lens=[OUT, OUT, 0, OUT],
                 errors=["", "", "Traceback ...\nClientConnectorError: refused", ""])
    problems = check(raw, N, OUT)
    assert any("completed 3 of 4" in p for p in problems)
    assert any("1 requests failed, e.g. ClientConnectorError: refused" in p for p in problems)
    assert any("output tokens, not 4 × 16" in p for p in problems)
    assert any("1 of 4 requests produced other than 16 tokens" in p for p in problems)


def test_short_outputs_are_flagged_even_when_every_request_completed() -> None:
    raw = result(total_output_tokens=N * OUT - 1, output_lens=[OUT, OUT, OUT - 1, OUT])
    problems = check(raw, N, OUT)
    assert len(problems) == 2
    assert "request 2: 15" in problems[1]


def test_the_totals_alone_are_checked_without_per_request_details() -> None:
    raw = result(total_output_tokens=N * OUT - 3)
    del raw["output_lens"]
    assert check(raw, N, OUT) == ["61 output tokens, not 4 × 16 = 64"]


def test_a_growing_queue_is_not_sustained() -> None:
    # The same sends, but the last answer came 4 s after the last send (fastest: 0.5 s).
    raw = result(duration=3 + 4.0, latencies=[0.5, 1.5, 2.5, 4.0])
    row = summarize(raw, LOAD)
    assert row["sustain_share"] == pytest.approx(3 / (3 + 3.5))
    assert row["sustained"] is False


def test_rate_inf_has_no_sustain_verdict_and_no_details_falls_back_to_the_nominal_rate() -> None:
    assert sustain_share(result(), math.inf) is None
    bare = {k: v for k, v in result().items() if k not in ("start_times", "latencies")}
    assert sustain_share(bare, 2.0) == pytest.approx((N / 3.5) / 2.0)


def _data(pagewire_rates: dict[str, Any], vllm_rates: dict[str, Any]) -> dict[str, Any]:
    return {"measured_at": "2026-12-02T00:00:00+00:00", "command": "bench/openai_serve.py",
            "git": "abc", "cpus": 2, "load_average_before": 0.1, "input_len": 64,
            "output_len": OUT, "num_prompts": N, "seed": 0, "warm_up_prompts": 2,
            "engines": {
                "pagewire": {"name": "pagewire", "status": "", "rates": pagewire_rates,
                             "command": "pagewire serve", "settings": {}},
                "vllm": {"name": "vLLM CPU", "status": "", "rates": vllm_rates,
                         "command": "vllm serve", "settings": {}}}}


def _rows(p99_ttft: float, throughput: float, problems: list[str] | None = None
          ) -> dict[str, Any]:
    rows = {}
    for rate, load in (("1", LOAD), ("inf", Load(math.inf, N, 64, OUT, 0))):
        raw = result(p99_ttft_ms=p99_ttft, output_throughput=throughput)
        rows[rate] = summarize(raw, load)
        if problems:
            rows[rate]["problems"] = problems
    return rows


def test_targets_compare_throughput_at_inf_and_ttft_where_vllm_sustains() -> None:
    data = _data(_rows(30.0, 120.0), _rows(40.0, 100.0))
    goals = openai_serve.targets(data)
    assert goals["throughput_at_inf"] == {"ratio": pytest.approx(1.2), "met": True}
    assert goals["ttft_p99_where_vllm_sustains"] == {"1": {"ratio": pytest.approx(0.75),
                                                           "met": True}}
    data["targets"] = goals
    text = openai_serve.markdown(data)
    assert "| rate 1 req/s | pagewire | vLLM CPU | pagewire ÷ vLLM |" in text
    assert "1.200× — met" in text and "0.750× — met" in text


def test_an_engine_that_failed_a_check_is_not_ranked() -> None:
    data = _data(_rows(30.0, 120.0, problems=["3 output tokens short"]), _rows(40.0, 100.0))
    goals = openai_serve.targets(data)
    assert goals == {"not_evaluated": "pagewire failed its checks (not ranked)"}
    data["targets"] = goals
    text = openai_serve.markdown(data)
    assert "**pagewire FAILED** (not ranked)" in text
    assert "FAILED: 3 output tokens short" in text


def test_w1_counts_and_greedy_comparison() -> None:
    requests = [BenchRequest([1, 2, 3], 2), BenchRequest([4, 5], 3)]
    grpc = TransportRun(1.0, [Answer("a b", [7, 8], 2), Answer("c d e", [9, 10, 11], 3)])
    http = TransportRun(1.1, [Answer("a b", None, 2), Answer("c d x", None, 3)])
    openai_serve.verify_counts("grpc", requests, grpc)
    openai_serve.verify_counts("http", requests, http)
    same = openai_serve.compare_answers(grpc, http)
    assert same["differ"] == 1 and same["examples"] == [
        {"request": 1, "first_difference_at_char": 4}]
    short = TransportRun(1.0, [Answer("a", None, 1), Answer("c d e", None, 3)])
    with pytest.raises(RuntimeError, match=r"request 0 returned \[1\] tokens, asked 2"):
        openai_serve.verify_counts("http", requests, short)
    # usage says 2 but only one token id came: counted on the client, it is short
    lying = TransportRun(1.0, [Answer("a", [7], 2), Answer("c d e", [9, 10, 11], 3)])
    with pytest.raises(RuntimeError, match="request 0 returned"):
        openai_serve.verify_counts("grpc", requests, lying)


def test_targets_wait_for_the_same_prompts_and_the_client_log_says_how_it_aligned() -> None:
    assert openai_serve.prompt_alignment("WARNING: /tokenize unavailable, skipping") == (
        "unavailable")
    assert openai_serve.prompt_alignment("WARNING: tokenizer mismatch (server=250, "
                                         "expected=256), re-aligning prompts.") == "re-aligned"
    assert openai_serve.prompt_alignment("Starting main benchmark run...") == "as generated"
    pagewire = _rows(30.0, 120.0)
    pagewire["1"]["total_input_tokens"] += 5
    goals = openai_serve.targets(_data(pagewire, _rows(40.0, 100.0)))
    assert goals == {"not_evaluated": "the engines did not get the same prompts (prompt "
                                      "tokens at 1: 261 vs 256)"}
