"""Hugging Face transformers as benchmark peers: static batching and continuous batching.

Run by serve_bench in a child process (see bench/peers/protocol.py):
    .venv/bin/python bench/peers/hf.py {static,continuous} MODEL_DIR WORKLOAD.json RESULT.json
Both run greedy, float32, on the CPU with torch's default thread count (every core, as
pagewire's runner), EOS ignored, over the same token-id prompts and output lengths as
pagewire. Throughput counts only the tokens each request asked for.

Continuous batching is sized explicitly. Left to itself on a CPU, transformers sizes its paged
cache from system RAM (about 8 GB of KV cache here, 14 GB resident before the first token, a
20 s allocation) with an 8192-token batch budget; its SDPA path attends every query of a batch
over the KV of every request in that batch (masked), so an 8192-token prefill batch costs
quadratic time and memory. Here the cache holds exactly the workload (pages of pagewire's
block size) and the batch budget is pagewire's.
"""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.peers.protocol import (  # noqa: E402
    PeerRequest,
    parse_args,
    read_workload,
    report_progress,
    write_result,
)

# The same as pagewire's block size and token budget per step in serve_bench.
PAGE_SIZE = 16
MAX_BATCH_TOKENS = 2048
MAX_REQUESTS_PER_BATCH = 256


def _load(model_dir: str):  # -> PreTrainedModel
    from transformers import AutoModelForCausalLM

    # SDPA for both: continuous batching runs it over its paged cache (the old `paged|sdpa`
    # name is deprecated and means the same).
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="sdpa"
    )
    return model.eval()


def static_batching(model_dir: str, requests: list[PeerRequest]) -> tuple[float, dict[str, Any]]:
    """`generate` over one left-padded batch of every request, up to the longest output.
    Returns the seconds of the timed run and the settings used."""
    model = _load(model_dir)
    pad = model.config.eos_token_id
    pad = pad[0] if isinstance(pad, list) else pad
    prompts = [r.prompt_token_ids for r in requests]
    width = max(len(p) for p in prompts)
    input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    longest = max(r.max_tokens for r in requests)
    with torch.inference_mode():
        model.generate(input_ids[:1, -8:], attention_mask=mask[:1, -8:], max_new_tokens=2,
                       do_sample=False, pad_token_id=pad)  # warm-up
        start = time.perf_counter()
        model.generate(input_ids, attention_mask=mask, max_new_tokens=longest,
                       min_new_tokens=longest, do_sample=False, pad_token_id=pad)
        seconds = time.perf_counter() - start
    report_progress(len(requests))
    settings = {"torch_threads": torch.get_num_threads(), "batch_size": len(requests),
                "attn_implementation": "sdpa"}
    return seconds, settings


def _cache_pages(requests: list[PeerRequest]) -> int:
    """Pages that hold every request of the workload at its full length at once."""
    return sum(math.ceil((len(r.prompt_token_ids) + r.max_tokens) / PAGE_SIZE)
               for r in requests)


def _continuous_config(requests: list[PeerRequest]):  # -> ContinuousBatchingConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    return ContinuousBatchingConfig(
        page_size=PAGE_SIZE,
        num_blocks=_cache_pages(requests),
        max_batch_tokens=MAX_BATCH_TOKENS,
        max_requests_per_batch=MAX_REQUESTS_PER_BATCH,
    )


def _submit(manager: Any, request: PeerRequest) -> str:
    request_id = manager.add_request(request.prompt_token_ids, max_new_tokens=request.max_tokens,
                                     eos_token_id=-1)
    if request_id is None:  # the manager refuses requests once its loop has failed
        raise RuntimeError("transformers refused a request: its generation loop is not running")
    return request_id


def _finish(manager: Any, request_ids: list[str], report: bool = True) -> int:
    """Waits for every request, reporting progress; returns the tokens they generated.

    Takes finished results in whatever order they come, as transformers' own generate_batch
    does. Waiting on one request id at a time (request_id_iter) puts every other request's
    result back in the queue and takes it again at once: a loop that holds the GIL against
    the generation thread and did not finish W1 in 10 minutes."""
    pending = set(request_ids)
    produced = 0
    while pending:
        result = manager.get_result(timeout=1.0)
        if result is None:
            if not manager.is_running():
                raise RuntimeError("transformers' generation loop stopped with requests pending")
            continue
        if result.request_id in pending and result.is_finished():
            pending.discard(result.request_id)
            produced += len(result.generated_tokens)
            if report:
                report_progress(len(request_ids) - len(pending))
    return produced


def continuous_batching(
    model_dir: str, requests: list[PeerRequest]
) -> tuple[float, int, dict[str, Any]]:
    """transformers' ContinuousBatchingManager, each request with its own output length.
    Returns the seconds of the timed run, the tokens generated and the settings used."""
    from transformers import GenerationConfig

    model = _load(model_dir)
    generation = GenerationConfig(max_new_tokens=max(r.max_tokens for r in requests),
                                  do_sample=False, eos_token_id=-1, pad_token_id=0)
    config = _continuous_config(requests)
    manager = model.init_continuous_batching(generation_config=generation,
                                             continuous_batching_config=config)
    manager.start()
    try:
        # Warm-up: the first batch builds the cache and the batch processor. Shorter than a
        # page, so no block of it can be reused by the workload's prompts.
        warm = PeerRequest(requests[0].prompt_token_ids[: PAGE_SIZE // 2], 2)
        _finish(manager, [_submit(manager, warm)], report=False)
        start = time.perf_counter()
        ids = [_submit(manager, r) for r in requests]
        produced = _finish(manager, ids)
        seconds = time.perf_counter() - start
    finally:
        manager.stop(block=True, timeout=10)
    settings = {"torch_threads": torch.get_num_threads(), "attn_implementation": "sdpa (paged)",
                "page_size": config.page_size, "num_blocks": config.num_blocks,
                "max_batch_tokens": config.max_batch_tokens,
                "max_requests_per_batch": config.max_requests_per_batch}
    return seconds, produced, settings


def main() -> None:
    mode = sys.argv[1] if len(sys.argv) > 1 else ""
    if mode not in ("static", "continuous"):
        raise SystemExit("usage: hf.py {static,continuous} MODEL_DIR WORKLOAD.json RESULT.json")
    args = parse_args(sys.argv[2:])
    requests = read_workload(args.workload_path)
    if mode == "static":
        seconds, settings = static_batching(args.model_dir, requests)
        produced = sum(r.max_tokens for r in requests)
    else:
        seconds, produced, settings = continuous_batching(args.model_dir, requests)
    write_result(args.result_path, seconds, produced, settings)


if __name__ == "__main__":
    main()
