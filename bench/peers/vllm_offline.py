"""vLLM (CPU) as a benchmark peer: runs one offline workload and writes its timings as JSON.

Runs inside the separate vLLM environment made by `make bench-peers`, never the project's:
    .venv-vllm/bin/python bench/peers/vllm_offline.py MODEL_DIR WORKLOAD.json RESULT.json
The workload is a list of {"prompt_token_ids": [...], "max_tokens": N}; every request ignores
EOS and decodes greedily, as pagewire does in the same benchmark.
"""

from __future__ import annotations

import json
import os
import sys
import time


def main() -> None:
    model_dir, workload_path, result_path = sys.argv[1:4]
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    with open(workload_path) as file:
        requests = json.load(file)
    # LLM(...) starts worker processes: it must be created under `if __name__ == "__main__"`.
    llm = LLM(model=model_dir, dtype="float32", max_model_len=2048, seed=0)
    prompts = [TokensPrompt(prompt_token_ids=r["prompt_token_ids"]) for r in requests]
    params = [
        SamplingParams(max_tokens=r["max_tokens"], ignore_eos=True, temperature=0.0)
        for r in requests
    ]
    llm.generate(prompts[:1], params[:1], use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    output_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    with open(result_path, "w") as file:
        json.dump({"seconds": elapsed, "output_tokens": output_tokens}, file)


if __name__ == "__main__":
    main()
