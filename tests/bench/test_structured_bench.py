"""bench/structured.py in its quickest form (the sim stage: one gateway over one simulated
runner, 4 streams of 16 tokens, 0 / 50 / 100 % constrained, one round): every token is counted
on the client and every constrained output follows its format; and the pure parts (which
requests are constrained, the format checks, the corpus verdicts, the ratios). The simulated
runner's masks: the nearest allowed token, and a batch whose masks never come failing alone.
No timing is asserted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from bench.sim_runner import CostModel, SimRunner, SimShape, nearest_allowed, sim_token
from bench.structured import (
    Answer,
    Case,
    Job,
    check_jobs,
    constrained_flags,
    follows_long_string,
    judge,
    long_string_schema,
    parse_args,
    summarise_rounds,
    take_chunk,
    ttft_schema,
    validation_error,
)
from gpu_runner.merging import PartialFailure, PendingStepError, merge_requests
from protos import runner_pb2

ROOT = Path(__file__).resolve().parents[2]


def test_quickest_sim_run_counts_every_token_and_checks_every_format(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "bench/structured.py", "--stages", "sim", "--sim-batches", "4",
         "--sim-max-tokens", "16", "--rounds", "1", "--settle-max-s", "0",
         "--results", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=240, check=False)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    data = json.loads((tmp_path / "structured.json").read_text())
    [point] = data["sim"]["points"]
    summary = point["throughput"]["summary"]
    assert set(summary) == {"0", "50", "100"}
    for share, row in summary.items():
        assert row["problems"] == [], row["problems"]
        assert row["tokens"] == 4 * 16  # counted on the client, request by request
        assert row["constrained"] == 4 * int(share) // 100
        assert row["tokens_per_s"] > 0 and row["gateway_cpu_us_per_token"] > 0
    for share in ("50", "100"):
        assert summary[share]["masked_rows"] > 0  # the gateway's metric
        assert summary[share]["runner_masked_rows"] > 0  # the sim runner's
        assert follows_long_string(summary[share]["constrained_example"])
        assert summary[share]["ratio_to_free"]["rounds"] == 1
    assert summary["0"]["masked_rows"] == 0
    assert "Throughput at GPU speed" in (tmp_path / "structured.md").read_text()


# ---- which requests, and the formats ------------------------------------------------------------
def test_constrained_flags_spread_the_share() -> None:
    assert constrained_flags(4, 50) == [False, True, False, True]
    assert constrained_flags(3, 0) == [False] * 3
    assert constrained_flags(3, 100) == [True] * 3
    assert sum(constrained_flags(256, 50)) == 128


def test_long_string_schema_outlasts_max_tokens() -> None:
    assert long_string_schema(64)["properties"]["text"]["minLength"] == 81 * 64 + 1


@pytest.mark.parametrize("text", ['', '{', '{"te', '{"text": "', '{"text":"abc def',
                                  '{\n  "text" : "a\\nb\\u00e9', '{"text": "x\\',
                                  '{"text": "\\u12'])
def test_beginnings_of_the_long_string_follow_it(text: str) -> None:
    assert follows_long_string(text)


@pytest.mark.parametrize("text", ['x', '{"tex"', '{"text": "a"', '{"text": "a"}', '["text"',
                                  '{"text": "bad \\q"', '{"text": "tab\t"'])
def test_other_texts_do_not(text: str) -> None:
    assert not follows_long_string(text)


def test_check_jobs_counts_tokens_and_formats() -> None:
    jobs = [Job([1], 3, False), Job([1], 3, True)]
    good = [Answer(tokens=3, usage_tokens=3, finish="length", text="anything"),
            Answer(tokens=3, usage_tokens=3, finish="length", text='{"text": "ab')]
    assert check_jobs(jobs, good) == []
    short = [Answer(tokens=2, finish="length"), Answer(tokens=3, finish="stop", text='{"a')]
    problems = check_jobs(jobs, short)
    assert any("2 tokens counted" in p for p in problems)
    assert any("ended 'stop'" in p for p in problems)
    assert any("does not follow" in p for p in problems)
    assert check_jobs(jobs[:1], [Answer(tokens=3, usage_tokens=4)])[0].startswith(
        "request 0 (free): usage says 4")


def test_take_chunk_counts_logprobs_entries_and_text() -> None:
    answer = Answer()
    take_chunk(answer, {"choices": [{"text": "ab", "logprobs": {"tokens": ["a", "b"]}}]})
    take_chunk(answer, {"choices": [{"text": "", "logprobs": {"tokens": ["\ufffd"]},
                                     "finish_reason": "length"}]})
    take_chunk(answer, {"choices": [], "usage": {"completion_tokens": 3}})
    assert (answer.text, answer.tokens, answer.usage_tokens, answer.finish) == \
        ("ab", 3, 3, "length")
    chat = Answer()
    take_chunk(chat, {"choices": [{"delta": {"role": "assistant"}}]})
    assert not chat.first
    take_chunk(chat, {"choices": [{"delta": {"content": "{"}}]})
    assert chat.first and chat.text == "{"
    # An error inside a stream (vLLM's way, after HTTP 200) keeps its code.
    refused = Answer(status=200)
    take_chunk(refused, {"error": {"message": "Grammar error", "code": 400}})
    assert refused.status == 400 and "Grammar error" in refused.error
    assert judge(Case("c", {}), refused)[0] == "refused"


def test_validation_and_verdicts() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"},
                                               "d": {"type": "string", "format": "date"}},
              "required": ["a"]}
    case = Case("c", schema)
    assert validation_error('{"a": 1}', schema) == ""
    assert "not JSON" in validation_error('{"a": ', schema)
    assert "is not of type" in validation_error('{"a": "x"}', schema)
    assert "is not a 'date'" in validation_error('{"a": 1, "d": "2024-13-45"}', schema)
    assert judge(case, Answer(finish="stop", text='{"a": 2}')) == ("valid", "")
    assert judge(case, Answer(finish="stop", text='{"b": 2}'))[0] == "INVALID"
    assert judge(case, Answer(finish="length", text='{"a": '))[0] == "length"
    assert judge(case, Answer(error="bad schema", status=400))[0] == "refused"
    assert judge(case, Answer(error="boom", status=500))[0] == "error"
    assert ttft_schema("x") != ttft_schema("y")


def test_ratios_are_per_round() -> None:
    def row(rate: float, cpu: float, masked: float) -> dict[str, Any]:
        return {"tokens_per_s": rate, "tokens": 100, "gateway_cpu_us_per_token": cpu,
                "masked_rows": masked, "problems": [], "constrained_example": None,
                "requests": 4, "constrained": 2}

    runs = {"0": [row(100, 10, 0), row(200, 10, 0)], "50": [row(90, 12, 50), row(100, 14, 50)]}
    summary = summarise_rounds(runs, [0, 50])
    assert summary["50"]["ratio_to_free"] == {"median": 0.7, "low": 0.5, "high": 0.9,
                                              "rounds": 2}
    assert summary["50"]["tokens_per_s"] == 95
    # (13 - 10) µs per token x 100 tokens / 50 masked rows.
    assert summary["50"]["extra_gateway_cpu_us_per_masked_row"] == pytest.approx(6.0)


def test_quick_defaults_and_refusals() -> None:
    quick = parse_args(["--quick"])
    assert quick.sim_batches == [64] and quick.rounds == 1 and quick.corpus_cases == 4
    full = parse_args([])
    assert full.sim_batches == [64, 256] and full.sim_shares == [0, 50, 100]
    for bad in (["--sim-shares", "50"], ["--cpu-shares", "0,150"], ["--rounds", "0"],
                ["--stages", "nope"], ["--engines", "tgi"]):
        with pytest.raises(SystemExit):
            parse_args(bad)


# ---- the simulated runner's masks --------------------------------------------------------------
def pack(rows: list[list[int]], vocab: int) -> bytes:
    bits = np.zeros((len(rows), -(-vocab // 32) * 32), dtype=np.uint8)
    for row, allowed in enumerate(rows):
        bits[row, allowed] = 1
    return np.packbits(bits, axis=1, bitorder="little").tobytes()


def plain_nearest(allowed: list[int], wanted: int) -> int:
    """The allowed token nearest `wanted`, the lower on a tie; `wanted` when none is."""
    if not allowed:
        return wanted
    return min(allowed, key=lambda token: (abs(token - wanted), token))


def test_nearest_allowed_matches_a_plain_search() -> None:
    rng = np.random.default_rng(0)
    for vocab in (49152, 100, 37):
        for _ in range(50):
            rows = [sorted(rng.choice(vocab, size=rng.integers(0, 6), replace=False).tolist())
                    for _ in range(4)]
            wanted = rng.integers(0, vocab, size=4).tolist()
            expected = [plain_nearest(allowed, w) for allowed, w in zip(rows, wanted, strict=True)]
            assert nearest_allowed(pack(rows, vocab), wanted, vocab) == expected
    assert nearest_allowed(pack([[10, 14]], 64), [12], 64) == [10]  # a tie: the lower


def batch(rows: int, client: str, step: int, follows: bool, masks: bytes = b""
          ) -> runner_pb2.ExecuteRequest:
    """`rows` decode rows, every one masked."""
    return runner_pb2.ExecuteRequest(
        client_id=client, step_id=step, num_new_tokens=[1] * rows,
        start_positions=[5] * rows, token_ids=[100 + i for i in range(rows)],
        slot_mapping=list(range(rows)), block_table_lens=[1] * rows,
        block_tables=list(range(rows)), do_sample=[True] * rows,
        temperatures=[0.0] * rows, top_ps=[1.0] * rows, top_ks=[0] * rows,
        min_ps=[0.0] * rows, seeds=[0] * rows, mask_seq_indices=list(range(rows)),
        masks=masks, masks_follow=follows)


def test_sim_runner_samples_under_masks_and_a_batch_without_its_masks_fails_alone() -> None:
    vocab = 64
    runner = SimRunner(CostModel.for_decode_step(0.0), SimShape(vocab_size=vocab),
                       mask_wait_s=0.2)
    inline = batch(1, "a", 1, False, pack([[40]], vocab))
    late = batch(2, "b", 7, True)
    runner.board.put("b", 7, pack([[3], [50, 60]], vocab))
    lost = batch(1, "c", 9, True)  # its SupplyMasks never comes
    for part in (inline, late, lost):
        runner._check(part)
    with pytest.raises(PartialFailure) as failure:
        runner._forward(merge_requests([inline, late, lost]), [inline, late, lost])
    assert list(failure.value.failed) == [2]
    assert isinstance(failure.value.failed[2], PendingStepError)
    # Rows: inline (1), late (2), lost (1); every prompt ends at position 6.
    nearest = nearest_allowed(pack([[50, 60]], vocab), [sim_token(101, 6, None, vocab)], vocab)
    assert list(failure.value.answer.token_ids) == [
        40, 3, *nearest, sim_token(100, 6, None, vocab)]  # the lost batch's row: unmasked
    assert runner.masked_rows == 4 and runner.mask_wait_s >= 0.2
