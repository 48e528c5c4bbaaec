"""serve_bench's results as markdown tables and a chart (from the JSON it writes)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench import step_profile, w4
from bench.roofline import MachinePeaks, Roofline
from bench.w1 import Ratio, per_round_ratio

P99_TTFT_TARGET_S = 2.0
PAGEWIRE = "pagewire"
STREAMED = "pagewire streamed"
CEILING = "ceiling"
# The dtype with every row (pagewire streamed, transformers continuous) and W2, W3 and W4; the
# other dtypes of --dtypes get W1's other rows (serve_bench's docstring says why).
FULL_DTYPE = "float32"
# What the two ways of the roofline are called in the results.
ROOFLINE_WAYS = {"ceiling": "ceiling (the runner replaying the offline run's batches)",
                 "pagewire": "pagewire offline, end to end (the same batches)"}
_ROW_LABELS = {
    PAGEWIRE: "**pagewire** (3 services, gRPC), offline: each request `final_only`",
    STREAMED: "pagewire streamed: a message per step per request",
    CEILING: "ceiling (runner alone, same batches)",
}


def row_name(name: str, dtype: str) -> str:
    """A W1 row's name in its dtype: the full dtype's rows keep their plain names."""
    return name if dtype == FULL_DTYPE else f"{name} {dtype}"


def _dtype(row: dict[str, Any]) -> str:
    return str(row.get("dtype", FULL_DTYPE))


def _label(name: str, dtype: str) -> str:
    base = name.removesuffix(f" {dtype}") if dtype != FULL_DTYPE else name
    label = _ROW_LABELS.get(base, base)
    return label if dtype == FULL_DTYPE else f"{label}, {dtype}"


def _ratio_text(ratio: Ratio | None, rounds: int) -> str:
    if ratio is None:
        return "—"
    text = f"{ratio.median:.2f} ({ratio.low:.2f}–{ratio.high:.2f})"
    return text if ratio.rounds == rounds else f"{text}, {ratio.rounds} of {rounds} rounds"


def _rows(results: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {row["name"]: row for row in results.get("w1", {}).get("rows", [])}


def ratio_against(results: dict[str, Any], numerator: str, name: str) -> Ratio | None:
    """Per-round ratios of two rows, neither of which failed: a row that failed stops
    measuring, so its rounds are the first ones and pair with the other's by position."""
    rows = _rows(results)
    if any(key not in rows or rows[key]["status"] for key in (numerator, name)):
        return None
    return per_round_ratio(rows[numerator]["round_tokens_per_s"],
                           rows[name]["round_tokens_per_s"])


def _dtypes(rows: dict[str, dict[str, Any]]) -> list[str]:
    return list(dict.fromkeys(_dtype(row) for row in rows.values()))


def _w1_table(results: dict[str, Any]) -> list[str]:
    w1 = results.get("w1")
    if not w1:
        return []
    rows = _rows(results)
    lines: list[str] = []
    for dtype in _dtypes(rows):
        lines += _w1_dtype_table(results, dtype, _rounds(w1, dtype))
    pagewire_ratios = [
        f"pagewire {dtype} ÷ pagewire {FULL_DTYPE}, median of rounds (min–max): "
        f"{_ratio_text(ratio, _rounds(w1, dtype))}" for dtype in _dtypes(rows)
        if dtype != FULL_DTYPE
        and (ratio := ratio_against(results, row_name(PAGEWIRE, dtype), PAGEWIRE))]
    if pagewire_ratios:
        lines += ["", "Across dtypes (round i has the same prompts in every dtype): "
                  + "; ".join(pagewire_ratios) + "."]
    return lines + _roofline_lines(results) + _treatment_table(w1, rows)


def _rounds(w1: dict[str, Any], dtype: str) -> int:
    """W1's rounds in `dtype` (serve_bench runs fewer in the dtypes other than the full one)."""
    return int(w1.get("rounds_by_dtype", {}).get(dtype, w1["rounds"]))


def _w1_dtype_table(results: dict[str, Any], dtype: str, rounds: int) -> list[str]:
    """The rows of one dtype, each against pagewire of that dtype."""
    pagewire, streamed = row_name(PAGEWIRE, dtype), row_name(STREAMED, dtype)
    rows = {name: row for name, row in _rows(results).items() if _dtype(row) == dtype}
    lines = ["", f"| W1 offline throughput, {dtype} (32 requests, {rounds} rounds) | "
             "output tok/s | tok/s per round | pagewire ÷ row: median of rounds (min–max) | "
             "verified tokens |", "|---|---:|---|---:|---:|"]
    for name, row in rows.items():
        label = _label(name, dtype)
        if row["tokens_per_s"] is None or row["status"]:
            lines.append(f"| {label} | {row['status'] or '—'} | | | |")
            continue
        ratio = "1.00" if name == pagewire else _ratio_text(
            ratio_against(results, pagewire, name), rounds)
        if name == row_name(CEILING, dtype):
            ratio += " (efficiency)"
        rates = ", ".join(f"{rate:.1f}" for rate in row["round_tokens_per_s"])
        lines.append(f"| {label} | {row['tokens_per_s']:.1f} | {rates} | {ratio} | "
                     f"{row['verified_tokens']} |")
    shown = [f"{name} {_ratio_text(ratio_against(results, streamed, name), rounds)}"
             for name in rows if name not in (pagewire, streamed)
             and ratio_against(results, streamed, name)]
    if shown:
        lines += ["", f"pagewire streamed ÷ row, median of rounds (min–max): {', '.join(shown)}."]
    return lines


def _roofline_lines(results: dict[str, Any]) -> list[str]:
    """The machine's peaks and W1's forwards against them (bench/roofline.py)."""
    measured = results.get("roofline")
    if not measured or "peaks" not in measured:
        return []
    peaks = MachinePeaks.from_dict(measured["peaks"])
    lines = ["", "Roofline (bench/roofline.py): the machine's limits, measured at the start "
             "of the bench: " + "; ".join(peaks.describe()) + ". W1's offline runs against "
             "them: each recorded forward's FLOPs and bytes (weights, KV cache) counted from "
             "its shapes, its bound the larger of FLOPs ÷ GEMM peak and bytes ÷ bandwidth, "
             "summed over every round; the fraction is that bound ÷ the measured time:", ""]
    for ways in measured.get("dtypes", {}).values():
        for way, text in ROOFLINE_WAYS.items():
            if way in ways:
                lines.append(f"- {text}, {Roofline.from_dict(ways[way]).describe()}")
    return lines


def _treatment_table(w1: dict[str, Any], rows: dict[str, dict[str, Any]]) -> list[str]:
    by_dtype = w1.get("orders", {})
    if isinstance(by_dtype, list):  # results written before --dtypes: float32's alone
        by_dtype = {FULL_DTYPE: by_dtype}
    orders = " — ".join(f"{dtype}: " + "; ".join(", ".join(order) for order in by_round)
                        for dtype, by_round in by_dtype.items())
    lines = ["", f"Every row alike: W1's prompts differ per round (seeds {w1['seeds']}) and are "
             "the same for every engine within a round; each row's output tokens are counted "
             "on the client, request by request, and must equal what was asked (the ceiling "
             "replays the offline run's batches: its tokens are that run's). The order of the "
             f"engines in each round: {orders or '—'}. How each row was treated:", "",
             "| row | processes started | warm-up | settle before each timed run: waits "
             "(s) | timed runs |", "|---|---:|---|---|---:|"]
    for name, row in rows.items():
        waits = ", ".join(f"{wait:.1f}" for wait in row["settle_waits_s"])
        lines.append(f"| {name} | {row['processes_started']} | {row['warm_up']} | "
                     f"{waits or '—'} | {row['rounds']} |")
    return lines


def _w2_table(pagewire: dict[str, Any]) -> list[str]:
    on, off = pagewire.get("w2_cache_on"), pagewire.get("w2_cache_off")
    if not (on or off):
        return []
    lines = ["", "| W2 shared 512-token prefix (64 requests) | TTFT p50 s | TTFT p99 s | "
             "tok/s | cached prompt tokens |", "|---|---:|---:|---:|---:|"]
    for label, row in (("prefix caching on", on), ("prefix caching off", off)):
        if row:
            lines.append(f"| {label} | {row['ttft_p50_s']:.3f} | {row['ttft_p99_s']:.3f} | "
                         f"{row['tokens_per_s']:.1f} | {row['cached_tokens']:.0f} |")
    if on and off:
        lines.append(f"| on ÷ off TTFT p50 speed-up | "
                     f"{off['ttft_p50_s'] / on['ttft_p50_s']:.1f}× | | | |")
    return lines


def _w3_table(w3: dict[str, Any]) -> list[str]:
    lines = ["", f"| W3 online, Poisson, {w3['duration_s']:.0f} s per rate | TTFT p50 | "
             "TTFT p99 | TPOT p50 | TPOT p99 | latency p50 | latency p99 | tok/s | refused |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for rate, row in w3["rates"].items():
        lines.append(
            f"| {rate} req/s | {row['ttft_p50_s']:.2f} | {row['ttft_p99_s']:.2f} | "
            f"{row['tpot_p50_s'] * 1000:.0f} ms | {row['tpot_p99_s'] * 1000:.0f} ms | "
            f"{row['latency_p50_s']:.2f} | {row['latency_p99_s']:.2f} | "
            f"{row['tokens_per_s']:.1f} | {row['refused']:.0f} |")
    lines.append(f"\nHighest rate held with p99 TTFT ≤ {P99_TTFT_TARGET_S:.0f} s: "
                 f"{w3['best_rate_per_s']} req/s.")
    return lines


def _settings_notes(results: dict[str, Any]) -> list[str]:
    lines = ["", "Settings: each row's dtype is its table's (pagewire's runner: `--dtype`, "
             "transformers: `dtype`, vLLM: `LLM(dtype=...)`); "
             "2 CPU threads for every engine (pagewire's runner and transformers: "
             "torch's default, one per core; vLLM: its worker bound to both cores with "
             "VLLM_CPU_OMP_THREADS_BIND, 2 GiB KV cache with VLLM_CPU_KVCACHE_SPACE). "
             "Each peer runs in its own process, kept for all rounds, with a time limit per run."]
    for name, row in _rows(results).items():
        if row.get("settings"):
            shown = ", ".join(f"{k}={v}" for k, v in row["settings"].items())
            lines.append(f"- {name}: {shown}")
    if "measured_at" in results:
        lines.append(f"\nMeasured (UTC): {results['measured_at']}, "
                     f"{results.get('bench_seconds', 0.0) / 60:.0f} minutes.")
    return lines


def markdown(results: dict[str, Any]) -> str:
    pagewire = results.get("pagewire", {})
    lines = _w1_table(results) + _w2_table(pagewire)
    if "w3" in pagewire:
        lines += _w3_table(pagewire["w3"])
    if "w4" in results:
        lines += w4.markdown(results["w4"])
    profiles = {name: pagewire[key] for key, name in
                (("w1_profile", "offline"), ("w1_streamed_profile", "streamed"))
                if key in pagewire}
    if profiles:
        lines += step_profile.markdown(profiles)
    lines += _settings_notes(results)
    return "\n".join(lines) + "\n"


def chart(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bars = [(name, row["tokens_per_s"]) for name, row in _rows(results).items()
            if row["tokens_per_s"] is not None and not row["status"]]
    names, values = [name for name, _ in bars][::-1], [value for _, value in bars][::-1]
    figure, axis = plt.subplots(figsize=(8, 4))
    axis.barh(names, values, color="#3b7dd8")
    axis.set_xlabel("output tokens/s (W1, SmolLM2-135M, 2-core CPU)")
    for y, value in enumerate(values):
        axis.text(value, y, f" {value:.0f}", va="center")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
