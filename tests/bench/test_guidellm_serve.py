"""guidellm_serve's reading of GuideLLM 0.8.1's JSON report, without servers: a run whose every
completed request produced the tokens asked passes; errored requests (with GuideLLM's message),
short outputs and steps where no token came are flagged and leave the engine unranked; the
table puts each step's figures side by side with the pagewire ÷ vLLM ratio.

guidellm_report.json is a real report of this bench's `guidellm run` against pagewire (its
concurrent@1 and concurrent@4 steps, 20 s each, synthetic 256/128 tokens), trimmed to what the
bench reads: nine of its metrics with their four statuses (and fewer statistics), one request
per status with its prompt cut short."""

from __future__ import annotations

import copy
import itertools
import json
from pathlib import Path
from typing import Any

import pytest

from bench import guidellm_serve
from bench.guidellm_serve import check_step, engine_failures, summarize
from bench.harness import free_port

REPORT = json.loads((Path(__file__).parent / "guidellm_report.json").read_text())
OUT = 128


def report(**changes: Any) -> dict[str, Any]:
    """A copy of the real report; `changes` maps a step index to a function that edits it."""
    copied = copy.deepcopy(REPORT)
    for index, edit in changes.items():
        edit(copied["benchmarks"][int(index.removeprefix("step"))])
    return copied


def test_a_clean_report_gives_a_row_per_step_from_guidellms_own_figures() -> None:
    rows = summarize(report(), OUT)
    assert list(rows) == ["concurrent@1", "concurrent@4"]
    for step, benchmark in zip(rows.values(), REPORT["benchmarks"], strict=True):
        metrics = benchmark["metrics"]
        assert step["problems"] == []
        assert step["successful"] == metrics["request_totals"]["successful"] > 0
        assert step["errored"] == 0
        assert step["requests_per_s"] == metrics["requests_per_second"]["total"]["mean"]
        assert step["output_tokens_per_s"] == (
            metrics["output_tokens_per_second"]["total"]["mean"])
        ttft = metrics["time_to_first_token_ms"]["successful"]["percentiles"]
        assert (step["ttft_p50_ms"], step["ttft_p99_ms"]) == (ttft["p50"], ttft["p99"])
        assert step["itl_p50_ms"] == (
            metrics["inter_token_latency_ms"]["successful"]["percentiles"]["p50"])
        assert step["output_tokens_min"] == step["output_tokens_max"] == OUT
    assert rows["concurrent@4"]["streams"] == 4


# An errored request as GuideLLM 0.8.1 records it (from a real run against a server that
# answered 404): no request_args, no output, httpx's message with its second line.
ERRORED = {"type_": "generative_request_stats", "request_id": "25c50608", "response_id": None,
           "request_args": None, "output": None,
           "info": {"status": "errored", "error": "HTTPStatusError(\"Client error '404 Not "
                    "Found' for url 'http://127.0.0.1:36683/v1/chat/completions'\\nFor more "
                    "information check: https://developer.mozilla.org/en-US/docs/Web/HTTP/"
                    "Status/404\")"}}


def _errored(benchmark: dict[str, Any]) -> None:
    """Two of the step's completed requests errored."""
    benchmark["requests"]["errored"] = [copy.deepcopy(ERRORED), copy.deepcopy(ERRORED)]
    totals = benchmark["metrics"]["request_totals"]
    totals["successful"] -= 2
    totals["errored"] += 2


def test_errored_requests_fail_the_step_with_guidellms_message_and_the_servers() -> None:
    errored = report(step1=_errored)
    rows = summarize(errored, OUT)
    assert rows["concurrent@1"]["problems"] == []
    (problem,) = rows["concurrent@4"]["problems"]
    assert problem == ("2 requests errored: HTTPStatusError(\"Client error '404 Not Found' for "
                       "url 'http://127.0.0.1:36683/v1/chat/completions'")  # once, first line
    record = {"status": "", "steps": rows, "server_answer": "… sent again: HTTP 404: {…}"}
    assert engine_failures(record) == [f"concurrent@4: {problem}",
                                       "… sent again: HTTP 404: {…}"]


def test_the_body_sent_again_is_one_guidellm_sent_in_the_run() -> None:
    # GuideLLM keeps no body for an errored request: a completed one's has the same shape.
    body = guidellm_serve.sent_body(report(step1=_errored))
    assert body is not None
    assert {k: v for k, v in body.items() if k != "messages"} == {
        k: v for k, v in guidellm_serve.guidellm_body("SmolLM2-135M-Instruct", OUT).items()
        if k != "messages"}
    assert body["messages"][0]["role"] == "user"
    bare = report()
    for benchmark in bare["benchmarks"]:
        benchmark["requests"] = {"successful": [ERRORED], "errored": [], "incomplete": [],
                                 "total": None}
    assert guidellm_serve.sent_body(bare) is None


def test_short_outputs_and_steps_without_a_completed_request_are_flagged() -> None:
    def short(benchmark: dict[str, Any]) -> None:
        benchmark["metrics"]["output_token_count"]["successful"]["min"] = 97.0

    def nothing_completed(benchmark: dict[str, Any]) -> None:
        metrics = benchmark["metrics"]
        metrics["request_totals"]["incomplete"] += metrics["request_totals"]["successful"]
        metrics["request_totals"]["successful"] = 0
        for name, summary in metrics.items():
            if name != "request_totals":
                summary["successful"] = None

    def no_token_either(benchmark: dict[str, Any]) -> None:
        nothing_completed(benchmark)
        benchmark["metrics"]["output_tokens_per_second"]["total"] = None

    rows = summarize(report(step0=short, step1=nothing_completed), OUT)
    assert rows["concurrent@1"]["problems"] == [
        "completed requests produced 97-128 output tokens, not 128"]
    # the step ended before a request completed: no latencies, a note, not a failure
    assert rows["concurrent@4"]["problems"] == []
    assert rows["concurrent@4"]["notes"][0].startswith("no request completed within the step")
    assert rows["concurrent@4"]["ttft_p50_ms"] is None
    assert rows["concurrent@4"]["output_tokens_per_s"] > 0
    stalled = summarize(report(step1=no_token_either), OUT)["concurrent@4"]
    assert stalled["problems"] == ["no request completed and no output token came"]
    assert stalled["notes"] == []
    assert check_step(rows["concurrent@1"], 97) == [
        "completed requests produced 97-128 output tokens, not 97"]


def _data(pagewire: dict[str, Any], vllm: dict[str, Any]) -> dict[str, Any]:
    return {"measured_at": "2026-12-06T00:00:00+00:00", "command": "bench/guidellm_serve.py",
            "git": "abc", "cpus": 2, "load_average_before": 0.1, "guidellm_version": "0.8.1",
            "streams": [1, 4], "seconds": 60.0, "prompt_tokens": 256, "output_tokens": OUT,
            "seed": 42, "data_prefetch": 16, "engines": {
                "pagewire": {"name": "pagewire", "status": "", "steps": pagewire,
                             "command": "pagewire serve", "settings": {},
                             "default_sampling": {"temperature": 0.2, "top_p": 0.9}},
                "vllm": {"name": "vLLM CPU", "status": "", "steps": vllm,
                         "command": "vllm serve", "settings": {},
                         "default_sampling": "{'temperature': 0.2, 'top_p': 0.9}"}}}


def test_the_table_sets_the_engines_side_by_side_per_step_with_the_ratio() -> None:
    pagewire = summarize(report(), OUT)

    def slower(benchmark: dict[str, Any]) -> None:
        for status in ("total", "successful"):
            benchmark["metrics"]["output_tokens_per_second"][status]["mean"] /= 2

    vllm = summarize(report(step0=slower, step1=slower), OUT)
    text = guidellm_serve.markdown(_data(pagewire, vllm))
    assert "| concurrent@4 | pagewire | vLLM CPU | pagewire ÷ vLLM |" in text
    tok_s = pagewire["concurrent@4"]["output_tokens_per_s"]
    assert f"| output tok/s | {tok_s:,.1f} | {tok_s / 2:,.1f} | 2.00 |" in text
    assert "| checks | ok | ok | |" in text and "FAILED" not in text
    data = _data(pagewire, vllm)
    data["engines"]["vllm"] |= {"client_cpu_s": 12.4, "client_wall_s": 100.0}
    assert "GuideLLM used 12 CPU-s over its 100 s (12% of one core)" in (
        guidellm_serve.markdown(data))


def test_an_engine_that_failed_is_named_and_its_step_says_why() -> None:
    data = _data(summarize(report(step1=_errored), OUT), summarize(report(), OUT))
    data["engines"]["vllm"]["status"] = "failed: vllm server exited with 1 while starting"
    text = guidellm_serve.markdown(data)
    assert "**pagewire FAILED** (not ranked): concurrent@4: 2 requests errored" in text
    assert "**vLLM CPU FAILED** (not ranked): failed: vllm server exited with 1" in text
    assert "| checks | ok | ok | |" in text  # concurrent@1
    assert "FAILED: 2 requests errored" in text


def test_the_command_is_guidellms_run_with_a_registry_option_each() -> None:
    server = guidellm_serve.Server("vllm", [], {}, 8123, Path("/nonexistent.log"),
                                   served_name="SmolLM2-135M-Instruct")
    command = guidellm_serve.guidellm_command(
        server, Path("/models/a,b"), [1, 4, 16], {"kind": "max_duration", "seconds": 60.0},
        256, OUT, 42, Path("/tmp/out.json"))
    options = {flag: value for flag, value in itertools.pairwise(command)
               if flag.startswith("--")}
    assert command[:2] == [str(guidellm_serve.GUIDELLM), "run"]
    assert options["--backend"] == ("kind=openai_http,target=http://127.0.0.1:8123,"
                                    "model=SmolLM2-135M-Instruct")
    assert command[command.index("--override") + 1:][:2] == ["profile.streams", "1,4,16"]
    assert options["--constraint"] == "kind=max_duration,seconds=60.0"
    assert options["--data"] == "kind=synthetic_text,prompt_tokens=256,output_tokens=128"
    assert options["--data-loader"] == "kind=pytorch,prefetch_factor=16"
    # a folder with a comma goes as JSON, which GuideLLM's options also take
    assert json.loads(options["--tokenizer"]) == {"kind": "huggingface_auto",
                                                  "model": "/models/a,b"}


def test_default_sampling_falls_back_to_vllms_start_up_log(tmp_path: Path) -> None:
    log = tmp_path / "vllm.log"
    log.write_text("WARNING 12-06 [model.py:1894] Default vLLM sampling parameters have been "
                   "overridden by the model's `generation_config.json`: `{'temperature': 0.2, "
                   "'top_p': 0.9}`. If this is not intended, please relaunch vLLM instance "
                   "with `--generation-config vllm`.\n")
    server = guidellm_serve.Server("vllm", [], {}, free_port(), log)
    assert guidellm_serve.default_sampling(server) == (
        "{'temperature': 0.2, 'top_p': 0.9} (from the model's `generation_config.json`)")


@pytest.mark.parametrize("text, streams", [("1,4,16", [1, 4, 16]), ("8", [8])])
def test_arguments(text: str, streams: list[int]) -> None:
    args = guidellm_serve.parse_args(["--streams", text, "--quick", "--engines", "vllm"])
    assert args.streams == streams and args.engines == ["vllm"]
    assert args.seconds == guidellm_serve.QUICK_STEP_SECONDS
    assert guidellm_serve.parse_args([]).seconds == guidellm_serve.STEP_SECONDS
