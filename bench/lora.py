"""What LoRA adapters cost a forward: decode steps of the default model in the runner core,
every row on the base model against rows spread over 1 or 8 adapters, side by side.

Adapters are random PEFT adapters of SmolLM2-135M made here (peft, no download), in three
shapes: rank 8 on q/v (PEFT's default targets for Llama), rank 16 on q/k/v/o, rank 16 on
every projection. Each case decodes `--steps` tokens of a batch whose sequences hold a
128-token prompt; the base run and the adapter run alternate round by round in one process
(same model, same cache, same threads) and each figure is the median over rounds, in wall
and CPU time (this process's, from /proc). The table gives the ratio base / adapters (1.0:
free) and the added time per adapter in the batch.

    python bench/lora.py [--batches 1 8 32] [--rounds 5] [--steps 8]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.harness import git_state, proc_stat, run_header, save_results
from common.model_store import resolve_model
from gpu_runner.runner import ModelRunner, RunnerOptions
from tests.helpers.lora_adapters import ATTENTION, MLP, make_peft_adapter
from tests.helpers.paged_driver import PagedDriver

RESULTS = Path(__file__).resolve().parent / "results"
PROMPT_LEN = 128
SHAPES = {  # name -> (rank, targets)
    "r8 q,v": (8, ("q_proj", "v_proj")),
    "r16 q,k,v,o": (16, ATTENTION),
    "r16 all": (16, ATTENTION + MLP),
}
ADAPTER_COUNTS = (1, 8)
TICK_S = 1 / os.sysconf("SC_CLK_TCK")


def cpu_s() -> float:
    fields = proc_stat("/proc/self/stat")
    return (int(fields[11]) + int(fields[12])) * TICK_S


def decode_ms(runner: ModelRunner, batch: int, adapters: list[str], steps: int, seed: int
              ) -> tuple[float, float]:
    """(wall, CPU) ms per decode step of `batch` sequences, sequence i on adapters[i % n]
    (none when `adapters` is empty)."""
    driver = PagedDriver(lambda b: runner.execute(b).token_ids, runner.block_size,
                         runner.num_blocks)
    rng = np.random.default_rng(seed)
    seqs = [driver.add(rng.integers(3, 40000, PROMPT_LEN).tolist()) for _ in range(batch)]
    for i, seq in enumerate(seqs):
        seq.adapter = adapters[i % len(adapters)] if adapters else ""
    driver.step(seqs)  # the prompts
    driver.step(seqs)  # a first decode, untimed
    wall, cpu = time.perf_counter(), cpu_s()
    for _ in range(steps):
        driver.step(seqs)
    result = ((time.perf_counter() - wall) / steps * 1e3, (cpu_s() - cpu) / steps * 1e3)
    for seq in seqs:
        driver.free(seq)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args(argv)
    base = resolve_model(None)
    folder = Path(tempfile.mkdtemp(prefix="pagewire-lora-bench-"))
    runner = ModelRunner(RunnerOptions(model=str(base), max_loras=max(ADAPTER_COUNTS),
                                       max_lora_rank=16, max_model_len=1024))
    assert runner.lora is not None
    names: dict[str, list[str]] = {}
    for shape, (rank, targets) in SHAPES.items():
        names[shape] = []
        for i in range(max(ADAPTER_COUNTS)):
            name = f"{shape.replace(' ', '_').replace(',', '')}-{i}"
            path = make_peft_adapter(base, folder / name, rank, targets, seed=i)
            runner.lora.register(runner.lora.read(name, str(path)))
            names[shape].append(name)
    rows = []
    for batch in args.batches:
        for shape in SHAPES:
            for count in ADAPTER_COUNTS:
                if count > batch:
                    continue
                base_runs, lora_runs = [], []
                for round_index in range(args.rounds):
                    pair = [(base_runs, []), (lora_runs, names[shape][:count])]
                    for runs, adapters in pair if round_index % 2 == 0 else pair[::-1]:
                        runs.append(decode_ms(runner, batch, adapters, args.steps,
                                              seed=round_index))
                row = _row(batch, shape, count, base_runs, lora_runs)
                rows.append(row)
                print(_line(row), flush=True)
    data = {**run_header("bench/lora.py", argv), "git": git_state(),
            "model": "SmolLM2-135M-Instruct", "dtype": "float32", "prompt_len": PROMPT_LEN,
            "rounds": args.rounds, "steps": args.steps, "rows": rows}
    save_results(RESULTS, "lora", data, _table(data))
    return 0


def _row(batch: int, shape: str, count: int, base_runs: list[tuple[float, float]],
         lora_runs: list[tuple[float, float]]) -> dict[str, object]:
    base_wall = statistics.median(r[0] for r in base_runs)
    base_cpu = statistics.median(r[1] for r in base_runs)
    lora_wall = statistics.median(r[0] for r in lora_runs)
    lora_cpu = statistics.median(r[1] for r in lora_runs)
    return {"batch": batch, "adapters": count, "shape": shape,
            "base_ms": round(base_wall, 2), "lora_ms": round(lora_wall, 2),
            "base_cpu_ms": round(base_cpu, 2), "lora_cpu_ms": round(lora_cpu, 2),
            "ratio": round(base_wall / lora_wall, 3),
            "cpu_ratio": round(base_cpu / lora_cpu, 3),
            "added_ms_per_adapter": round((lora_wall - base_wall) / count, 2)}


def _line(row: dict[str, object]) -> str:
    return (f"| {row['batch']} | {row['shape']} | {row['adapters']} | {row['base_ms']} | "
            f"{row['lora_ms']} | {row['ratio']} | {row['cpu_ratio']} | "
            f"{row['added_ms_per_adapter']} |")


def _table(data: dict[str, object]) -> str:
    header = (f"# LoRA decode steps, {data['model']} {data['dtype']}, runner core\n\n"
              f"`{data['command']}` at {data['measured_at']} ({data['git']}); median of "
              f"{data['rounds']} rounds of {data['steps']} steps, prompts of "
              f"{data['prompt_len']} tokens.\n\n"
              "| batch | adapter shape | adapters | base ms/step | with adapters ms/step | "
              "ratio (wall) | ratio (CPU) | added ms per adapter |\n"
              "|---|---|---|---|---|---|---|---|\n")
    rows = data["rows"]
    assert isinstance(rows, list)
    return header + "\n".join(_line(row) for row in rows) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
