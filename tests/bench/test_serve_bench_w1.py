"""serve_bench's W1 treats every engine alike: one warm-up each before the rounds, a settle
before every timed run, each round its own order of the engines, the same prompts for every
engine within a round and new ones each round; every request's tokens are checked, and an
engine that falls short (a fake peer one token short) fails the bench and is stopped at once;
ratios are the median of per-round ratios with their spread."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from bench import serve_bench, step_profile, w1, workloads
from bench.peers import protocol
from bench.roofline import GemmPeak, MachinePeaks, Work
from bench.serve_report import markdown
from bench.timing import RequestTiming, RunSummary
from bench.workloads import BenchRequest
from tests.bench import fake_peer
from tests.helpers.services import pid_alive


@pytest.fixture(autouse=True)
def no_waiting(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    settles: list[str] = []
    monkeypatch.setattr(w1, "wait_until_quiet", lambda: settles.append("settle") or 0.25)
    monkeypatch.setattr(serve_bench, "chart", lambda data, path: None)  # no matplotlib work
    return settles


class FakeEngine:
    """Takes `seconds` per round; `short_in_round` makes one of its runs a token short."""

    def __init__(self, name: str, events: list[str], seconds: list[float],
                 short_in_round: int = -1) -> None:
        self.row = w1.W1Row(name, processes_started=1, warm_up=w1.WARM_UP)
        self.rows = [self.row]
        self.events, self.seconds, self.short_in_round = events, seconds, short_in_round
        self.prompts: list[list[list[int]]] = []

    def warm_up(self, requests: list[BenchRequest]) -> None:
        self.events.append(f"warm {self.row.name}")

    def run(self, round_index: int, requests: list[BenchRequest]) -> None:
        self.row.settle()
        self.events.append(f"{self.row.name} {round_index}")
        self.prompts.append([r.prompt_token_ids for r in requests])
        produced = [r.max_tokens for r in requests]
        if round_index == self.short_in_round:
            produced[3] -= 1
        w1.check_counts(self.row.name, requests, produced)
        self.row.add_round(self.seconds[round_index], sum(produced))


def test_rounds_rotate_warm_up_once_settle_before_every_run_and_share_prompts(
        no_waiting: list[str]) -> None:
    events: list[str] = []
    engines = [FakeEngine(name, events, [1.0, 1.0, 1.0]) for name in "abc"]
    orders = w1.run_rounds(engines, rounds=3)

    assert orders == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"]]
    assert events == ["warm a", "warm b", "warm c", "a 0", "b 0", "c 0",
                      "b 1", "c 1", "a 1", "c 2", "a 2", "b 2"]
    assert len(no_waiting) == 9  # one settle per timed run
    for engine in engines:
        assert engine.row.settle_waits_s == [0.25] * 3
        assert engine.prompts == engines[0].prompts  # the same prompts in each round
    assert len({str(prompts) for prompts in engines[0].prompts}) == 3  # new ones every round


def test_a_short_engine_fails_and_the_others_go_on() -> None:
    events: list[str] = []
    short = FakeEngine("short", events, [1.0, 1.0, 1.0], short_in_round=1)
    other = FakeEngine("other", events, [1.0, 1.0, 1.0])
    w1.run_rounds([short, other], rounds=3)

    assert short.row.status.startswith("failed in round 2: short: 1 of 32 requests produced")
    assert "request 3" in short.row.status
    assert "short 2" not in events and "other 2" in events
    assert len(short.row.round_tokens) == 1 and len(other.row.round_tokens) == 3


def test_every_engine_runs_after_several_others() -> None:
    names = list("abcde")
    orders = [w1.round_order(i, names) for i in range(4)]
    assert orders[:2] == [list("abecd"), list("bcade")]
    for name in names:
        positions = {order.index(name) for order in orders}
        before = {order[order.index(name) - 1] for order in orders if order.index(name)}
        assert len(positions) == 4 and len(before) >= 2, (name, orders)
    six = [w1.round_order(i, list("abcdef")) for i in range(6)]
    follows = {(order[k], order[k + 1]) for order in six for k in range(5)}
    assert len(follows) == 30  # even n over n rounds: every engine after every other once


def test_check_counts_names_the_request() -> None:
    requests = [BenchRequest([1], 5), BenchRequest([2], 7)]
    w1.check_counts("ok", requests, [5, 7])
    with pytest.raises(w1.ShortOutput, match="request 1: 8 of 7 tokens"):
        w1.check_counts("long", requests, [5, 8])
    with pytest.raises(w1.ShortOutput, match="1 token counts for 2 requests"):
        w1.check_counts("missing", requests, [5])


def test_ratios_are_medians_of_per_round_ratios_with_their_spread(tmp_path: Path) -> None:
    events: list[str] = []
    results = serve_bench.Results(tmp_path)
    pagewire = FakeEngine(serve_bench.PAGEWIRE, events, [1.0, 2.0, 1.0, 1.0])
    peer = FakeEngine("peer", events, [2.0, 2.0, 4.0, 3.0])
    serve_bench.run_w1([pagewire, peer], results)

    # Per round pagewire ÷ peer: 2, 1, 4, 3 -> median 2.5 (the totals' ratio would be 2.2).
    ratio = w1.per_round_ratio(pagewire.row.round_rates, peer.row.round_rates)
    assert ratio == w1.Ratio(2.5, 1.0, 4.0, 4)
    table = markdown(results.data)
    assert "| 2.50 (1.00–4.00) |" in table
    tokens = sum(r.max_tokens for seed in range(4) for r in w1.round_workload(seed))
    assert f"| {tokens} |" in table  # the verified total
    assert "| peer | 1 | one untimed W1-sized run (seed 99) after start | " \
           "0.2, 0.2, 0.2, 0.2 | 4 |" in table


def test_the_offline_way_replays_its_own_batches_on_the_ceiling_right_after_each_run(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    record_path = tmp_path / "rec"
    events: list[str] = []

    def fake_run(address: str, label: str, requests: list[BenchRequest],
                 allow_errors: bool = False) -> RunSummary:
        how = "offline" if requests[0].final_only else "streamed"
        events.append(how)
        with open(record_path, "a") as record:  # what the runner records
            record.write(how)
        return RunSummary(1.0 if how == "offline" else 2.0,
                          [RequestTiming(sent=0.0, output_tokens=r.max_tokens)
                           for r in requests])

    def fake_replay(runner: object, path: Path) -> float:
        assert path.read_text() == "offline"  # that run's batches alone
        events.append("replay")
        return 0.5

    def fake_work(config: object, path: Path, dtype: str) -> list[Work]:
        assert (config, path.read_text(), dtype) == ("config", "offline", "float32")
        return [Work(flops=1e9, bytes=1e9)]

    empty = step_profile.Snapshot({}, {}, {})
    monkeypatch.setattr(serve_bench, "_run", fake_run)
    monkeypatch.setattr(serve_bench, "replay", fake_replay)
    monkeypatch.setattr(serve_bench, "recorded_work", fake_work)
    monkeypatch.setattr(step_profile, "take_snapshot", lambda port: empty)
    results = serve_bench.Results(tmp_path)
    results.peaks = _peaks()
    runner = type("FakeRunner", (), {"config": "config"})()
    ceiling = serve_bench.Ceiling(runner, record_path, results.roofline("float32"))  # type: ignore[arg-type]
    offline = serve_bench.PagewireW1("addr", 0, True, ceiling)
    streamed = serve_bench.PagewireW1("addr", 0, False)
    w1.run_rounds([offline, streamed], rounds=2)

    # The warm-up; round 1: offline, streamed; round 2: streamed, offline.
    assert events == ["offline", "replay", "offline", "replay", "streamed",
                      "streamed", "offline", "replay"]
    assert offline.ceiling_row.round_tokens == offline.row.round_tokens
    assert len(offline.ceiling_row.settle_waits_s) == 2
    # Each round's forwards, timed by the replay (0.5 s) and by the offline run (1 s).
    tally = results.rooflines["float32"].by_way
    assert (tally["ceiling"].measured_s, tally["pagewire"].measured_s) == (1.0, 2.0)
    assert tally["ceiling"].flops == 2e9 and tally["ceiling"].forwards == 2


def _peaks() -> MachinePeaks:
    return MachinePeaks(2, {d: GemmPeak(d, 100.0, "plain", "x") for d in ("float32", "bfloat16")},
                        copy_gbs=10.0, triad_gbs=9.0, read_gbs=8.0)


def test_a_fake_peer_one_token_short_fails_the_bench(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    def fake_command(key: str, model_dir: Path, dtype: str) -> list[str]:
        mode = "short" if key == "hf-static" else "ok"
        return fake_peer.command(mode, tmp_path / key, str(model_dir), dtype)

    monkeypatch.setattr(serve_bench, "_peer_command", fake_command)
    monkeypatch.setattr(serve_bench, "resolve_model", lambda name: tmp_path)
    monkeypatch.setattr(sys, "argv", ["serve_bench", "--only", "hf-static,hf-cb",
                                      "--dtypes", "float32", "--results-dir", str(tmp_path)])
    with pytest.raises(SystemExit) as exit_info:
        serve_bench.main()

    assert exit_info.value.code == 1
    error = capsys.readouterr().err
    assert "serve_bench FAILED: transformers static: failed in its warm-up" in error
    last = workloads.offline_throughput(seed=w1.WARM_UP_SEED)[-1].max_tokens
    assert f"1 of 32 requests produced other than they asked, e.g. request 31: {last - 1} of " \
           f"{last} tokens" in error
    rows = {row["name"]: row for row in
            json.loads((tmp_path / "serve_bench.json").read_text())["w1"]["rows"]}
    assert rows["transformers static"]["rounds"] == 0
    assert (rows["transformers continuous"]["status"], rows["transformers continuous"]["rounds"]
            ) == ("", 4)  # the other peer was measured in every round
    assert "| transformers static | failed in its warm-up: " in \
        (tmp_path / "serve_bench.md").read_text()
    assert not pid_alive(int((tmp_path / "hf-static").read_text()))  # stopped when it failed


def test_a_peer_whose_seconds_exceed_the_parents_clock_fails(tmp_path: Path) -> None:
    peer = serve_bench.PeerW1("liar", fake_peer.command("slow-clock", tmp_path / "pid"), 30)
    with pytest.raises(RuntimeError, match=r"took 1000\.0 s of a run that took"):
        peer.warm_up(w1.round_workload(0))
    assert not pid_alive(int((tmp_path / "pid").read_text()))


def test_each_dtype_runs_its_own_w1_and_its_peers_load_that_dtype(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    commands: list[list[str]] = []

    def fake_command(key: str, model_dir: Path, dtype: str) -> list[str]:
        commands.append(fake_peer.command("ok", tmp_path / f"{key}-{dtype}", str(model_dir),
                                          dtype))
        return commands[-1]

    monkeypatch.setattr(serve_bench, "_peer_command", fake_command)
    monkeypatch.setattr(serve_bench, "resolve_model", lambda name: tmp_path)
    monkeypatch.setattr(sys, "argv", ["serve_bench", "--only", "hf-static,hf-cb",
                                      "--results-dir", str(tmp_path)])
    serve_bench.main()  # the default --dtypes: float32,bfloat16

    data = json.loads((tmp_path / "serve_bench.json").read_text())
    rows = {row["name"]: row for row in data["w1"]["rows"]}
    assert list(rows) == ["transformers static", "transformers continuous",
                          "transformers static bfloat16", "transformers continuous bfloat16"]
    for name in ("transformers static", "transformers continuous"):
        assert (rows[name]["dtype"], rows[name]["settings"]["dtype"]) == ("float32", "float32")
    static16 = rows["transformers static bfloat16"]
    # The dtype reached the peer's process: it reports the dtype it was started with.
    assert (static16["dtype"], static16["settings"]["dtype"], static16["rounds"]) == (
        "bfloat16", "bfloat16", serve_bench.OTHER_DTYPE_ROUNDS)
    assert rows["transformers static"]["rounds"] == w1.W1_ROUNDS
    assert data["w1"]["rounds_by_dtype"] == {"float32": 4, "bfloat16": 2}
    assert rows["transformers continuous bfloat16"]["status"].startswith("not run in bfloat16")
    assert len(commands) == 3  # continuous batching not started in bfloat16
    assert set(data["w1"]["orders"]) == {"float32", "bfloat16"}
    table = (tmp_path / "serve_bench.md").read_text()
    assert "| W1 offline throughput, bfloat16 (32 requests, 2 rounds) |" in table
    assert "| transformers continuous, bfloat16 | not run in bfloat16" in table


def test_the_dtype_reaches_the_runner_the_ceiling_and_each_peer(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    config = serve_bench.launch_config([], "bfloat16")
    flags = serve_bench.Launcher(config)._runner_flags()
    assert flags[flags.index("--dtype") + 1] == "bfloat16"
    assert serve_bench.ceiling_options(tmp_path, "bfloat16").dtype == "bfloat16"
    monkeypatch.setattr(serve_bench, "VLLM_PYTHON", Path(sys.executable))
    for key, leading in (("hf-static", 3), ("hf-cb", 3), ("vllm", 2)):
        command = serve_bench._peer_command(key, tmp_path, "bfloat16")
        assert command is not None
        # What the peer scripts parse after their own leading arguments.
        assert protocol.peer_args(command[leading:]) == protocol.PeerArgs(str(tmp_path),
                                                                           "bfloat16")
    assert serve_bench.parse_args([]).dtypes == ["float32", "bfloat16"]
    assert serve_bench.parse_args(["--dtypes", "bfloat16"]).dtypes == ["bfloat16"]
    assert serve_bench.parse_args(["--other-dtype-rounds", "4"]).other_dtype_rounds == 4
    for wrong in (["--dtypes", "float64"], ["--other-dtype-rounds", "5"]):
        with pytest.raises(SystemExit):
            serve_bench.parse_args(wrong)


def test_the_summary_shows_pagewire_across_dtypes_and_the_rooflines(tmp_path: Path) -> None:
    results = serve_bench.Results(tmp_path)
    results.peaks = _peaks()
    for dtype, seconds in (("float32", [2.0, 2.0, 2.0, 2.0]), ("bfloat16", [1.0, 2.0, 0.5, 1.0])):
        events: list[str] = []
        engines = [FakeEngine(serve_bench.row_name(name, dtype), events, times)
                   for name, times in ((serve_bench.PAGEWIRE, seconds),
                                       ("peer", [4.0, 4.0, 4.0, 4.0]))]
        for engine in engines:
            engine.row.dtype = dtype
        serve_bench.run_w1(engines, results, dtype)
        tally = results.roofline(dtype)
        assert tally is not None
        tally.add("ceiling", [Work(flops=100e9, bytes=1e9)], 2.0)
        tally.add("pagewire", [Work(flops=100e9, bytes=1e9)], 4.0)
    results.save()
    table = (tmp_path / "serve_bench.md").read_text()
    # Per round bfloat16 ÷ float32: 2, 1, 4, 2 -> median 2.
    assert "pagewire bfloat16 ÷ pagewire float32, median of rounds (min–max): " \
        "2.00 (1.00–4.00)." in table
    # Each dtype's rows against pagewire of that dtype: 4, 2, 8, 4 in bfloat16.
    lines = table.splitlines()
    assert any(line.startswith("| peer |") and "| 2.00 (2.00–2.00) |" in line for line in lines)
    assert any(line.startswith("| peer, bfloat16 |") and "| 4.00 (2.00–8.00) |" in line
               for line in lines)
    assert "| **pagewire** (3 services, gRPC), offline: each request `final_only`, bfloat16 |" \
        in table
    assert ("- ceiling (the runner replaying the offline run's batches), bfloat16: 50 GFLOP/s "
            "(50 % of 100 GFLOP/s GEMM peak)") in table
    assert "roofline bound 1.00 s of 4.00 s measured → 25 % (compute-bound)" in table
    assert "GEMM peak bfloat16: 100.0 GFLOP/s (plain, x)" in table
