"""Hugging Face transformers as benchmark peers: static batching and continuous batching.

Run by serve_bench in a child process that lives for the whole benchmark (see
bench/peers/protocol.py):
    .venv/bin/python bench/peers/hf.py {static,continuous} [--dtype D] MODEL_DIR  (then stdin)
Both run greedy, in the dtype asked for (float32 by default, or bfloat16: `torch_dtype` of the
weights, activations and cache), on the CPU with torch's default thread count (every core, as
pagewire's runner), EOS ignored, over the same token-id prompts and output lengths as
pagewire. Each request's tokens are counted from what transformers returned for it; static
batching decodes every row to the longest output, so a row is credited at most the tokens its
request asked for. The warm-up is serve_bench's, the same for every engine.

Continuous batching is sized explicitly. Left to itself on a CPU, transformers sizes its paged
cache from system RAM (about 8 GB of KV cache here, 14 GB resident before the first token, a
20 s allocation) with an 8192-token batch budget; its SDPA path attends every query of a batch
over the KV of every request in that batch (masked), so an 8192-token prefill batch costs
quadratic time and memory. Here the cache holds twice the first workload it is given (pages of
pagewire's block size; the runs of one benchmark have the same shape) and the batch budget is
pagewire's.
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
    RunResult,
    peer_args,
    report_progress,
    serve,
)

# The same as pagewire's block size and token budget per step in serve_bench.
PAGE_SIZE = 16
MAX_BATCH_TOKENS = 2048
MAX_REQUESTS_PER_BATCH = 256


def _load(model_dir: str, dtype: str):  # -> PreTrainedModel
    from transformers import AutoModelForCausalLM

    # SDPA for both: continuous batching runs it over its paged cache (the old `paged|sdpa`
    # name is deprecated and means the same).
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=getattr(torch, dtype), attn_implementation="sdpa"
    )
    return model.eval()


def generated_counts(output_ids: list[list[int]], prompt_width: int, eos_id: int,
                     requests: list[PeerRequest]) -> list[int]:
    """Tokens each row of a left-padded batch generated, up to its first EOS included and at
    most what its request asked for."""
    counts = []
    for row, request in zip(output_ids, requests, strict=True):
        generated = row[prompt_width:]
        produced = generated.index(eos_id) + 1 if eos_id in generated else len(generated)
        counts.append(min(produced, request.max_tokens))
    return counts


def static_batching(model: Any, requests: list[PeerRequest]) -> RunResult:
    """`generate` over one left-padded batch of every request, up to the longest output."""
    pad = model.config.eos_token_id
    pad = pad[0] if isinstance(pad, list) else pad
    prompts = [r.prompt_token_ids for r in requests]
    width = max(len(p) for p in prompts)
    input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    longest = max(r.max_tokens for r in requests)
    with torch.inference_mode():
        start = time.perf_counter()
        output_ids = model.generate(input_ids, attention_mask=mask, max_new_tokens=longest,
                                    min_new_tokens=longest, do_sample=False, pad_token_id=pad)
        seconds = time.perf_counter() - start
    # Every row decodes to the longest output (EOS is suppressed until then): a row's count is
    # the columns generate returned, at most what its own request asked for.
    if output_ids.shape[1] - width != longest:
        raise RuntimeError(f"generate returned {output_ids.shape[1] - width} new tokens per row, "
                           f"asked for {longest}")
    report_progress(len(requests))
    settings = {"torch_threads": torch.get_num_threads(), "batch_size": len(requests),
                "attn_implementation": "sdpa", "dtype": str(model.dtype).removeprefix("torch.")}
    return RunResult(seconds, generated_counts(output_ids.tolist(), width, pad, requests),
                     settings)


def _cache_pages(requests: list[PeerRequest]) -> int:
    """Pages that hold every request of a workload twice over at its full length."""
    return 2 * sum(math.ceil((len(r.prompt_token_ids) + r.max_tokens) / PAGE_SIZE)
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


def _finish(manager: Any, request_ids: list[str]) -> dict[str, int]:
    """Waits for every request, reporting progress; returns the tokens each generated.

    Takes finished results in whatever order they come, as transformers' own generate_batch
    does. Waiting on one request id at a time (request_id_iter) puts every other request's
    result back in the queue and takes it again at once: a loop that holds the GIL against
    the generation thread and did not finish W1 in 10 minutes."""
    produced: dict[str, int] = {}
    while len(produced) < len(request_ids):
        result = manager.get_result(timeout=1.0)
        if result is None:
            if not manager.is_running():
                raise RuntimeError("transformers' generation loop stopped with requests pending")
            continue
        if result.request_id in request_ids and result.is_finished():
            produced[result.request_id] = len(result.generated_tokens)
            report_progress(len(produced))
    return produced


class ContinuousBatching:
    """transformers' ContinuousBatchingManager, started on the first run (sized from its
    workload) and kept for the peer's life; each request with its own output length."""

    def __init__(self, model: Any) -> None:
        self._model = model
        self._manager: Any = None
        self._settings: dict[str, Any] = {}

    def _start(self, requests: list[PeerRequest]) -> None:
        from transformers import GenerationConfig

        generation = GenerationConfig(max_new_tokens=2 * max(r.max_tokens for r in requests),
                                      do_sample=False, eos_token_id=-1, pad_token_id=0)
        config = _continuous_config(requests)
        self._manager = self._model.init_continuous_batching(
            generation_config=generation, continuous_batching_config=config)
        self._manager.start()
        self._settings = {
            "torch_threads": torch.get_num_threads(), "attn_implementation": "sdpa (paged)",
            "dtype": str(self._model.dtype).removeprefix("torch."),
            "page_size": config.page_size, "num_blocks": config.num_blocks,
            "max_batch_tokens": config.max_batch_tokens,
            "max_requests_per_batch": config.max_requests_per_batch}

    def __call__(self, requests: list[PeerRequest]) -> RunResult:
        if self._manager is None:
            self._start(requests)
        start = time.perf_counter()
        ids = [_submit(self._manager, r) for r in requests]
        produced = _finish(self._manager, ids)
        seconds = time.perf_counter() - start
        return RunResult(seconds, [produced[i] for i in ids], self._settings)

    def stop(self) -> None:
        if self._manager is not None:
            self._manager.stop(block=True, timeout=10)


def main() -> None:
    mode = sys.argv[1] if len(sys.argv) > 1 else ""
    if mode not in ("static", "continuous"):
        raise SystemExit("usage: hf.py {static,continuous} [--dtype D] MODEL_DIR "
                         "(run commands on stdin)")
    args = peer_args(sys.argv[2:])
    model = _load(args.model_dir, args.dtype)
    if mode == "static":
        serve(lambda requests: static_batching(model, requests))
        return
    engine = ContinuousBatching(model)
    try:
        serve(engine)
    finally:
        engine.stop()


if __name__ == "__main__":
    main()
