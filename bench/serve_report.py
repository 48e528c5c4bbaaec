"""serve_bench's results as markdown tables and a chart (from the JSON it writes)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench import step_profile, w4
from bench.w1 import Ratio, per_round_ratio

P99_TTFT_TARGET_S = 2.0
PAGEWIRE = "pagewire"
STREAMED = "pagewire streamed"
CEILING = "ceiling"
_ROW_LABELS = {
    PAGEWIRE: "**pagewire** (3 services, gRPC), offline: each request `final_only`",
    STREAMED: "pagewire streamed: a message per step per request",
    CEILING: "ceiling (runner alone, same batches)",
}


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


def _w1_table(results: dict[str, Any]) -> list[str]:
    w1 = results.get("w1")
    if not w1:
        return []
    rows, rounds = _rows(results), w1["rounds"]
    lines = [f"| W1 offline throughput (32 requests, {rounds} rounds) | output tok/s | "
             "tok/s per round | pagewire ÷ row: median of rounds (min–max) | verified tokens |",
             "|---|---:|---|---:|---:|"]
    for name, row in rows.items():
        label = _ROW_LABELS.get(name, name)
        if row["tokens_per_s"] is None or row["status"]:
            lines.append(f"| {label} | {row['status'] or '—'} | | | |")
            continue
        ratio = "1.00" if name == PAGEWIRE else _ratio_text(
            ratio_against(results, PAGEWIRE, name), rounds)
        if name == CEILING:
            ratio += " (efficiency)"
        rates = ", ".join(f"{rate:.1f}" for rate in row["round_tokens_per_s"])
        lines.append(f"| {label} | {row['tokens_per_s']:.1f} | {rates} | {ratio} | "
                     f"{row['verified_tokens']} |")
    shown = [f"{name} {_ratio_text(ratio_against(results, STREAMED, name), rounds)}"
             for name in rows if name not in (PAGEWIRE, STREAMED)
             and ratio_against(results, STREAMED, name)]
    if shown:
        lines += ["", f"pagewire streamed ÷ row, median of rounds (min–max): {', '.join(shown)}."]
    return lines + _treatment_table(w1, rows)


def _treatment_table(w1: dict[str, Any], rows: dict[str, dict[str, Any]]) -> list[str]:
    orders = "; ".join(", ".join(order) for order in w1.get("orders", []))
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
    lines = ["", "Settings: 2 CPU threads for every engine (pagewire's runner and transformers: "
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
    axis.set_xlabel("output tokens/s (W1, SmolLM2-135M, float32, 2-core CPU)")
    for y, value in enumerate(values):
        axis.text(value, y, f" {value:.0f}", va="center")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
