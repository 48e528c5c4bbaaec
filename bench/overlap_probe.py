"""What a block-service Step running during the forward costs the forward, on this machine.

    .venv/bin/python bench/overlap_probe.py [--rounds 4]

The question behind it: the gateway sends the Step for step N+1 only after Execute N has
returned, so the Step round trip (~3 ms of a ~59 ms W1 step on 2 cores) is on the critical
path. Overlapping it with the forward (vLLM's async scheduling) would hide that round trip, but
on a CPU runner the forward uses every core, and the Step's work (the gateway's client side,
the block service, gRPC on both ends) then runs on the same cores.

The probe measures that cost without changing the protocol: W1 through the three services
(serve_bench's settings) in one launch, alternately alone and with a load thread that sends a
Step like the gateway's (32 decode APPENDs over a StepStream, on a pool and session of its
own) once per mean step time on average, at random moments (about 90 % of a W1 step is the
forward, so most land in one). Modes alternate alone-loaded, loaded-alone, ... so that the
machine's drift does not favour one. Per mode it prints W1's tokens per second, the runner's
forward per step and the gateway's Step round trip, from the gateway's metrics. If the forward
grows by more than the Step round trip, an overlap loses on this machine. See
docs/gateway.md ("Why the Step is not overlapped with the forward") for what it showed.
"""

from __future__ import annotations

import argparse
import random
import sys
import threading
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import grpc  # noqa: E402

from bench import step_profile, workloads  # noqa: E402
from bench.serve_bench import _run, launch_config  # noqa: E402
from gateway.launcher import Launcher  # noqa: E402
from gateway.step_stream import StepStreamClient  # noqa: E402
from protos import block_pb2, block_pb2_grpc  # noqa: E402

POOL_ID = "overlap-probe"
NUM_SEQS = 32  # W1's batch
PROMPT_TOKENS = 16
APPENDS_PER_SEQUENCE = 128  # then the sequences are freed and allocated again
ALONE, LOADED = "alone", "with Step load"


class StepLoad:
    """Sends gateway-like Steps of NUM_SEQS decode APPENDs on its own session and pool, at
    random moments, one per `period_s` on average, until stopped."""

    def __init__(self, block_address: str, period_s: float) -> None:
        self._channel = grpc.insecure_channel(block_address)
        stub = block_pb2_grpc.BlockServiceStub(self._channel)
        self._session_id = stub.OpenSession(
            block_pb2.OpenSessionRequest(client_name="overlap-probe")).session_id
        blocks_per_seq = (PROMPT_TOKENS + APPENDS_PER_SEQUENCE) // 16 + 2
        stub.CreatePool(block_pb2.CreatePoolRequest(
            pool_id=POOL_ID, num_blocks=2 * NUM_SEQS * blocks_per_seq, block_size=16, epoch=1))
        self._stream = StepStreamClient(stub, timeout_s=30.0)
        self._period_s = period_s
        self._step_id = 0
        self._generation = 0  # sequences of generation g have ids g * NUM_SEQS + i
        self._appended = 0
        self.steps_sent = 0
        self.failed_ops = 0  # operations not answered OK: the load would be lighter than real
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="step-load", daemon=True)
        self.error: Exception | None = None  # what ended the load thread early
        self._send()  # the first generation's ALLOCATEs
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self._stream.close()
        self._channel.close()

    def _loop(self) -> None:
        rng = random.Random(7)
        try:
            while not self._stop.wait(rng.uniform(0.0, 2 * self._period_s)):
                self._send()
                self.steps_sent += 1
        except Exception as error:  # reported by the caller after stop()
            self.error = error

    def _send(self) -> None:
        reply = self._stream.step(self._next_request())
        self.failed_ops += sum(1 for status in reply.op_statuses
                               if status != block_pb2.OP_STATUS_OK)

    def _next_request(self) -> block_pb2.StepRequest:
        self._step_id += 1
        request = block_pb2.StepRequest(session_id=self._session_id, pool_id=POOL_ID,
                                        step_id=self._step_id)
        if self._step_id == 1 or self._appended == APPENDS_PER_SEQUENCE:
            self._new_generation(request)
        else:
            for seq_id in self._seq_ids():
                self._add(request, block_pb2.OP_KIND_APPEND, seq_id, [7],
                          PROMPT_TOKENS + self._appended)
            self._appended += 1
        return request

    def _new_generation(self, request: block_pb2.StepRequest) -> None:
        if self._step_id > 1:
            for seq_id in self._seq_ids():
                self._add(request, block_pb2.OP_KIND_FREE, seq_id, [], -1)
            self._generation += 1
        for i, seq_id in enumerate(self._seq_ids()):
            prompt = [(self._generation * NUM_SEQS + i) * PROMPT_TOKENS + t
                      for t in range(PROMPT_TOKENS)]
            self._add(request, block_pb2.OP_KIND_ALLOCATE, seq_id, prompt, -1)
        self._appended = 0

    def _seq_ids(self) -> range:
        return range(self._generation * NUM_SEQS, (self._generation + 1) * NUM_SEQS)

    @staticmethod
    def _add(request: block_pb2.StepRequest, kind: int, seq_id: int, token_ids: list[int],
             num_computed_tokens: int) -> None:
        request.op_kinds.append(kind)  # type: ignore[arg-type]
        request.seq_ids.append(seq_id)
        request.token_counts.append(len(token_ids))
        request.token_ids.extend(token_ids)
        request.parent_seq_ids.append(0)
        request.num_computed_tokens.append(num_computed_tokens)


def measure_w1_round(address: str, metrics_port: int, salt: str) -> dict[str, float]:
    """One W1 round: tokens/s and the gateway's per-step milliseconds."""
    requests = [replace(r, cache_salt=salt) for r in workloads.offline_throughput()]
    before = step_profile.take_snapshot(metrics_port)
    summary = _run(address, f"W1 ({salt})", requests)
    window = (before, step_profile.take_snapshot(metrics_port))
    per_step = step_profile.profile([window], summary.seconds, 0.0)["per_step_ms"]
    return {"tokens_per_s": summary.tokens_per_s, "step_ms": per_step["whole step"],
            "forward_ms": per_step["runner: forward"], "step_rt_ms": per_step["Step round trip"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=4, help="W1 rounds per mode")
    args = parser.parse_args()
    config = launch_config([])
    launcher = Launcher(config)
    rows: dict[str, list[dict[str, float]]] = {ALONE: [], LOADED: []}
    try:
        launcher.start()
        address = launcher.gateway_address
        block_address = next(c.address for c in launcher.children if c.name == "block_service")
        _run(address, "warm-up", workloads.offline_throughput(4, seed=99))
        period_s = 0.0  # the last alone round's mean step: the load's mean interval
        for round_index in range(args.rounds):
            # Alone first in even rounds, last in odd ones: a drift of the machine's speed
            # then does not favour one mode.
            for mode in (ALONE, LOADED) if round_index % 2 == 0 else (LOADED, ALONE):
                salt = f"probe-{round_index}-{mode}"
                if mode == ALONE:
                    rows[mode].append(measure_w1_round(address, config.metrics_port, salt))
                    period_s = rows[mode][-1]["step_ms"] / 1e3
                    continue
                load = StepLoad(block_address, period_s)
                try:
                    rows[mode].append(measure_w1_round(address, config.metrics_port, salt))
                finally:
                    load.stop()
                if load.error is not None or load.failed_ops:
                    raise RuntimeError(f"the Step load failed ({load.error}; "
                                       f"{load.failed_ops} operations not OK)")
                rows[mode][-1]["load_steps"] = load.steps_sent
    finally:
        launcher.request_stop()
        launcher.stop()
    print_table(rows)


def print_table(rows: dict[str, list[dict[str, float]]]) -> None:
    print("W1 through the services, alone and with a Step of 32 decode appends at random "
          "moments, once per mean step (mean of the rounds):")
    print(f"{'mode':<16} | {'rounds':>6} | {'W1 tok/s':>8} | {'step ms':>7} | "
          f"{'forward ms':>10} | {'Step RT ms':>10}")
    means = {}
    for mode, runs in rows.items():
        mean = {key: sum(r[key] for r in runs) / len(runs) for key in runs[0]}
        means[mode] = mean
        print(f"{mode:<16} | {len(runs):>6} | {mean['tokens_per_s']:>8.1f} | "
              f"{mean['step_ms']:>7.1f} | {mean['forward_ms']:>10.1f} | "
              f"{mean['step_rt_ms']:>10.2f}")
        print(f"{'':<16}   forward ms per round: "
              + ", ".join(f"{r['forward_ms']:.1f}" for r in runs))
    print(f"load Steps sent per W1 round: {means[LOADED]['load_steps']:.0f}")
    added = means[LOADED]["forward_ms"] - means[ALONE]["forward_ms"]
    print(f"forward per step with the load: {added:+.1f} ms; Step round trip alone (the most "
          f"an overlap removes): {means[ALONE]['step_rt_ms']:.1f} ms")


if __name__ == "__main__":
    main()
