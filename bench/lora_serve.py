"""W1 with LoRA: every request on the base model against the same requests spread over 8
adapters (request i on adapter i mod 8); pagewire through its three services and, where
`make bench-peers` installed it, vLLM CPU with its own LoRA support, side by side.

Each engine is one process for the whole bench (pagewire: one `pagewire serve` stack with the
bench's settings, bench/serve_bench.py) serving the default model with the same 8 random PEFT
adapters (pagewire `--lora-modules --max-loras 8`, vLLM `enable_lora`, `max_loras=8`); both
ways run on it, after one untimed warm-up run of each way. Each round has its own prompts
(W1's, seeded by the round: no run can hit an earlier one's prefix cache), the same for every
engine and way, and runs every (engine, way) once, in an order rotated round by round, after
the machine settles. Every request must produce exactly its max_tokens (counted on the
client, or by the peer's API), or the bench fails. Figures: output tokens per second, the
median over rounds of each round's adapters ÷ base ratio, and pagewire's services' CPU per
output token (from /proc).

    python bench/lora_serve.py [--shape "r16 q,k,v,o"] [--rounds 4] [--no-vllm]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import workloads
from bench.harness import git_state, run_header, save_results, service_counters
from bench.lora import SHAPES
from bench.peers.child import PeerProcess
from bench.peers.protocol import PeerRequest, peer_command
from bench.serve_bench import VLLM_PYTHON, _run, launch_config
from bench.w1 import WARM_UP_SEED, check_counts, round_seed, wait_until_quiet
from common.model_store import resolve_model
from gateway.launcher import Launcher
from tests.helpers.lora_adapters import make_peft_adapter

RESULTS = Path(__file__).resolve().parent / "results"
NUM_ADAPTERS = 8
WAYS = ("base", "8 adapters")
PEER_TIMEOUT_S = 1800.0  # the first run includes vLLM's start


class PagewireEngine:
    """pagewire serving the adapters (by name), through its three services."""

    name = "pagewire"

    def __init__(self, adapters: list[tuple[str, str]], rank: int) -> None:
        config = replace(launch_config([]), lora_modules=adapters, max_loras=NUM_ADAPTERS,
                         max_lora_rank=rank)
        self._names = [name for name, _ in adapters]
        self._launcher = Launcher(config)
        self._launcher.start()
        self._pids = [c.process.pid for c in self._launcher.children if c.process]

    def run(self, label: str, requests: list[workloads.BenchRequest], way: str
            ) -> dict[str, float]:
        asked = [replace(r, model=self._names[i % NUM_ADAPTERS] if way != "base" else "",
                         cache_salt=label, final_only=True) for i, r in enumerate(requests)]
        cpu_before = sum(service_counters(pid).cpu_s for pid in self._pids)
        summary = _run(self._launcher.gateway_address, label, asked)
        cpu_s = sum(service_counters(pid).cpu_s for pid in self._pids) - cpu_before
        check_counts(label, asked, [t.output_tokens for t in summary.timings])
        return {"seconds": summary.seconds, "tokens_per_s": summary.tokens_per_s,
                "services_cpu_ms_per_token": cpu_s / summary.output_tokens * 1e3}

    def close(self) -> None:
        self._launcher.request_stop()
        self._launcher.stop()


class VllmEngine:
    """vLLM CPU (offline `LLM.generate`, bench/peers/vllm_offline.py) with a LoRARequest per
    adapter request."""

    name = "vLLM CPU"

    def __init__(self, model_dir: Path, adapters: list[tuple[str, str]], rank: int) -> None:
        self._paths = [path for _, path in adapters]
        self._process = PeerProcess(peer_command(
            [str(VLLM_PYTHON), str(Path(__file__).resolve().parent / "peers" /
                                   "vllm_offline.py")],
            str(model_dir), "float32", NUM_ADAPTERS, rank))

    def run(self, label: str, requests: list[workloads.BenchRequest], way: str
            ) -> dict[str, float]:
        asked = [PeerRequest(r.prompt_token_ids, r.max_tokens,
                             self._paths[i % NUM_ADAPTERS] if way != "base" else "")
                 for i, r in enumerate(requests)]
        outcome = self._process.run(label, asked, PEER_TIMEOUT_S)
        if outcome.status:
            raise RuntimeError(f"{label}: {outcome.status}")
        check_counts(label, requests, outcome.output_tokens)
        return {"seconds": outcome.seconds,
                "tokens_per_s": sum(outcome.output_tokens) / outcome.seconds}

    def close(self) -> None:
        self._process.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="r16 q,k,v,o", choices=list(SHAPES))
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--no-vllm", action="store_true", help="pagewire alone")
    args = parser.parse_args(argv)
    rank, targets = SHAPES[args.shape]
    base = resolve_model(None)
    folder = Path(tempfile.mkdtemp(prefix="pagewire-lora-serve-"))
    adapters = [(f"lora-{i}", str(make_peft_adapter(base, folder / f"lora-{i}", rank, targets,
                                                    seed=i))) for i in range(NUM_ADAPTERS)]
    engines: list[PagewireEngine | VllmEngine] = [PagewireEngine(adapters, rank)]
    if not args.no_vllm and VLLM_PYTHON.exists():
        engines.append(VllmEngine(base, adapters, rank))
    runs: dict[str, dict[str, list[dict[str, float]]]] = {
        e.name: {way: [] for way in WAYS} for e in engines}
    try:
        warm_up = workloads.offline_throughput(seed=WARM_UP_SEED)
        for engine in engines:
            for way in WAYS:
                engine.run(f"{engine.name} warm-up, {way}", warm_up, way)
        pairs = [(engine, way) for engine in engines for way in WAYS]
        for round_index in range(args.rounds):
            requests = workloads.offline_throughput(seed=round_seed(round_index))
            shift = round_index % len(pairs)
            for engine, way in pairs[shift:] + pairs[:shift]:
                wait_until_quiet()
                label = f"{engine.name} W1 {way}, round {round_index + 1}/{args.rounds}"
                runs[engine.name][way].append(engine.run(label, requests, way))
    finally:
        for engine in engines:
            engine.close()
    data = {**run_header("bench/lora_serve.py", argv), "git": git_state(),
            "model": "SmolLM2-135M-Instruct", "dtype": "float32", "shape": args.shape,
            "adapters": NUM_ADAPTERS, "requests": len(requests), "rounds": args.rounds,
            "runs": runs, "summary": {name: _summary(r) for name, r in runs.items()}}
    slug = args.shape.replace(" ", "_").replace(",", "")
    save_results(RESULTS, f"lora_serve_{slug}", data, _table(data))
    return 0


def _summary(runs: dict[str, list[dict[str, float]]]) -> dict[str, float]:
    base, lora = runs[WAYS[0]], runs[WAYS[1]]
    ratios = [a["tokens_per_s"] / b["tokens_per_s"] for a, b in zip(lora, base, strict=True)]
    summary = {"base_tokens_per_s": round(statistics.median(r["tokens_per_s"] for r in base), 1),
               "lora_tokens_per_s": round(statistics.median(r["tokens_per_s"] for r in lora), 1),
               "ratio": round(statistics.median(ratios), 3),
               "ratio_min": round(min(ratios), 3), "ratio_max": round(max(ratios), 3)}
    if "services_cpu_ms_per_token" in base[0]:
        for way, rows in (("base", base), ("lora", lora)):
            summary[f"{way}_cpu_ms_per_token"] = round(
                statistics.median(r["services_cpu_ms_per_token"] for r in rows), 2)
    return summary


def _table(data: dict[str, object]) -> str:
    summaries = data["summary"]
    assert isinstance(summaries, dict)
    lines = [f"# W1 with LoRA adapters, {data['model']} {data['dtype']}\n",
             f"`{data['command']}` at {data['measured_at']} ({data['git']}); "
             f"{data['requests']} requests per run, {data['adapters']} adapters of shape "
             f"{data['shape']}, request i on adapter i mod {data['adapters']}; "
             f"{data['rounds']} rounds.\n",
             "| engine | base tok/s | 8 adapters tok/s | adapters ÷ base: median (min–max) | "
             "services CPU ms / token, base / adapters |",
             "|---|---:|---:|---:|---:|"]
    for name, s in summaries.items():
        cpu = (f"{s['base_cpu_ms_per_token']} / {s['lora_cpu_ms_per_token']}"
               if "base_cpu_ms_per_token" in s else "–")
        lines.append(f"| {name} | {s['base_tokens_per_s']} | {s['lora_tokens_per_s']} | "
                     f"{s['ratio']} ({s['ratio_min']}–{s['ratio_max']}) | {cpu} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
