"""The gateway's CPU per scheduling step, in-process: what one runner loop spends on a step.

    .venv/bin/python bench/gateway_step.py                 # 256 decoding rows, 400 steps
    .venv/bin/python bench/gateway_step.py --rows 64 --steps 1000 --stream-interval 8

One thread does what a runner loop does per decode step, with real parts and no sockets: the
gateway's Scheduler plans the step, `build_step_request` packs it, the StepRequest is
serialized and parsed (the wire), the block service's own core (block_service.core, in this
process) applies it, its StepResponse is built, serialized and parsed, `parse_step_response`
and `apply_results` take it in, `build_execute_request` packs the Execute (serialized: the
runner's side of the wire is not the gateway's CPU), a runner answer of one token per row is
parsed, and `_take_samples` appends the tokens, detokenizes (the default model's tokenizer),
checks stops and flushes each request's message into an Outbox (delivered nowhere: the
streaming is counted apart, by bench/gateway_plane.py).

Reported: CPU µs per step (time.process_time over the measured steps) in two parts,
scheduling (plan, both RPCs' encode and decode, apply: issue 31's "≤ 1 ms per step at 256
rows") and output (samples, detokenizing, stops, messages), and per row. Every request decodes
past the measured steps (ignore_eos), so each step has exactly --rows decodes after warm-up.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from block_service.core import BlockServiceCore  # noqa: E402
from block_service.step_wire import step_response  # noqa: E402
from gateway.request import Request  # noqa: E402
from gateway.runner_loop import RunnerLoop  # noqa: E402
from gateway.scheduler import Scheduler  # noqa: E402
from gateway.sequence import SamplingConfig, SeqStatus  # noqa: E402
from gateway.step_builder import (  # noqa: E402
    SamplingRow,
    build_execute_request,
    build_step_request,
    parse_step_response,
)
from gateway.tokenizer import load_tokenizer  # noqa: E402
from protos import block_pb2, runner_pb2  # noqa: E402

BLOCK_SIZE = 16
POOL = "bench-pool"


class Loop:
    """The per-step work of one RunnerLoop, over an in-process block-service core."""

    def __init__(self, rows: int, stream_interval: int, prompt_tokens: int, seed: int) -> None:
        self.core = BlockServiceCore()
        self.core.create_pool(POOL, 1 << 16, BLOCK_SIZE, 1)
        self.session, _ = self.core.open_session("bench")
        # Every prompt fits the first step's budget, so each request samples from step one.
        self.scheduler = Scheduler(max(rows * prompt_tokens, 256), rows, BLOCK_SIZE)
        self.tokenizer = load_tokenizer(None)
        rng = random.Random(seed)
        self.rng = rng
        # The loop's own take-samples step, on a stand-in with just what it reads (no step in
        # flight behind this one: no late masks to send).
        self.loop: Any = SimpleNamespace(_requests={}, scheduler=self.scheduler,
                                         _send_late_masks=lambda: None)
        self.rows: dict[str, SamplingRow] = {}
        for i in range(rows):
            params = SamplingConfig(max_tokens=1 << 20, ignore_eos=True)
            request = Request(f"r{i}", [rng.randrange(1000, 30000) for _ in range(prompt_tokens)],
                              params, max_len=1 << 20, eos_ids=frozenset({2}),
                              decode=self.tokenizer.decode,
                              decode_batch=self.tokenizer.decode_batch,
                              stream=_Sink(), stream_interval=stream_interval)
            self.loop._requests[request.request_id] = request
            self.rows[request.request_id] = SamplingRow.from_config(params)
            self.scheduler.add(request.sequences)
        self.step_id = 0

    def step(self) -> tuple[float, float]:
        """One step; returns (scheduling, output) CPU seconds."""
        started = time.process_time()
        plan = self.scheduler.schedule()
        self.step_id += 1
        wire = build_step_request(plan, self.session, POOL, self.step_id, 1, {}).SerializeToString()
        # The block service's side (parse, core, answer) is not the gateway's CPU.
        block_side = time.process_time()
        request = block_pb2.StepRequest.FromString(wire)
        result = self.core.step(
            request.session_id, request.pool_id, request.step_id, request.epoch,
            request.op_kinds[:], request.seq_ids[:], request.token_counts[:],
            request.token_ids[:], request.parent_seq_ids[:], request.num_computed_tokens[:],
            dict(request.cache_salts), request.num_lookahead_slots[:])
        answer_wire = step_response(result).SerializeToString()
        block_side = time.process_time() - block_side
        answer = block_pb2.StepResponse.FromString(answer_wire)
        outcome = self.scheduler.apply_results(plan, parse_step_response(answer, plan.num_ops))
        work = [item for item in outcome.work if item.seq.status is SeqStatus.RUNNING]
        execute = build_execute_request(work, list(answer.copies), 1, "bench", self.step_id,
                                        self.rows)
        execute.serialize()
        scheduled = time.process_time()
        sampled = [item.seq for item in work if item.do_sample]
        reply = runner_pb2.ExecuteResponse.FromString(runner_pb2.ExecuteResponse(
            token_ids=[self.rng.randrange(1000, 30000) for _ in sampled]).SerializeToString())
        self.scheduler.on_executed(work)
        RunnerLoop._take_samples(self.loop, work, reply)
        done = time.process_time()
        return scheduled - started - block_side, done - scheduled


class _Sink:
    """A reader that takes every message at once."""

    unread = 0

    def put(self, item: object) -> None:
        pass


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--warm-steps", type=int, default=20)
    parser.add_argument("--stream-interval", type=int, default=1)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    loop = Loop(args.rows, args.stream_interval, args.prompt_tokens, args.seed)
    for _ in range(args.warm_steps):  # the admissions and prefill, then decodes only
        loop.step()
    scheduling = output = 0.0
    for _ in range(args.steps):
        plan_s, output_s = loop.step()
        scheduling += plan_s
        output += output_s
    # Checked: every request sampled one token per step (its prefill's, then a decode's).
    counts = {len(request.sequences[0].output_ids) for request in loop.loop._requests.values()}
    if counts != {args.warm_steps + args.steps}:
        raise SystemExit(f"output tokens per request {sorted(counts)}, expected "
                         f"{args.warm_steps + args.steps}: not a token per row per step")
    per_step = [scheduling / args.steps * 1e6, output / args.steps * 1e6]
    print(f"{args.rows} decoding rows, stream interval {args.stream_interval}, "
          f"{args.steps} steps: CPU per step {per_step[0]:,.0f} µs scheduling "
          f"(plan, Step and Execute encode/decode, apply) + {per_step[1]:,.0f} µs output "
          f"(samples, detokenize, stops, messages) = {sum(per_step):,.0f} µs; per row "
          f"{per_step[0] / args.rows:.2f} + {per_step[1] / args.rows:.2f} µs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
