"""Client-side timings of streamed requests and their summaries."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import grpc
import numpy as np

from bench.workloads import BenchRequest
from gateway.client import build_request
from protos import gateway_pb2_grpc


@dataclass
class RequestTiming:
    """When one request was sent, got its first token, and ended (perf_counter seconds). A
    final_only request's first token comes with its last: its ttft and tpot say nothing."""

    sent: float
    first_token: float = 0.0
    done: float = 0.0
    messages: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    error: str = ""

    @property
    def ttft(self) -> float:
        return self.first_token - self.sent

    @property
    def latency(self) -> float:
        return self.done - self.sent

    @property
    def tpot(self) -> float:
        """Time per output token after the first."""
        return (self.done - self.first_token) / max(self.output_tokens - 1, 1)


@dataclass
class RunSummary:
    """What one workload run measured."""

    seconds: float
    timings: list[RequestTiming] = field(default_factory=list)

    @property
    def output_tokens(self) -> int:
        return sum(t.output_tokens for t in self.timings)

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds

    @property
    def errors(self) -> int:
        return sum(1 for t in self.timings if t.error)

    def percentile(self, attribute: str, q: float) -> float:
        values = [getattr(t, attribute) for t in self.timings if not t.error]
        return float(np.percentile(values, q)) if values else float("nan")


async def _stream_one(stub: gateway_pb2_grpc.GenerationServiceStub, request: BenchRequest,
                      timing: RequestTiming, timeout_s: float | None) -> None:
    try:
        call = stub.Generate(build_request(
            token_ids=request.prompt_token_ids,
            max_tokens=request.max_tokens,
            temperature=0.0,
            ignore_eos=True,
            cache_salt=request.cache_salt,
            final_only=request.final_only,
            model=request.model,
        ), timeout=timeout_s)
        async for message in call:
            timing.messages += 1
            count = sum(len(output.token_ids) for output in message.outputs)
            if count and not timing.first_token:
                timing.first_token = time.perf_counter()
            timing.output_tokens += count
            if message.HasField("usage"):
                timing.cached_tokens = message.usage.cached_tokens
    except Exception as error:  # a benchmark reports failures instead of stopping
        timing.error = repr(error)
    timing.done = time.perf_counter()


def run_workload(
    address: str, requests: Sequence[BenchRequest], progress: object | None = None,
    timeout_s: float | None = None,
) -> RunSummary:
    """Sends every request at its arrival time (0 = at once) on its own stream and waits. A
    stream still running `timeout_s` after it was sent ends as an error (DEADLINE_EXCEEDED):
    a hung server fails the run instead of hanging it.

    One asyncio loop drives every stream: the load generator shares the CPU with the system
    under test, and a thread per stream cost the 2-core machine about 2.3 ms of CPU per W1
    step (a wake-up per message).
    """
    return asyncio.run(_run_workload(address, requests, progress, timeout_s))


async def _run_workload(address: str, requests: Sequence[BenchRequest],
                        progress: object | None, timeout_s: float | None) -> RunSummary:
    timings: list[RequestTiming] = []
    streams: list[asyncio.Task[None]] = []
    async with grpc.aio.insecure_channel(address) as channel:
        stub = gateway_pb2_grpc.GenerationServiceStub(channel)
        start = time.perf_counter()
        for request in requests:
            delay = start + request.arrival_s - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            timing = RequestTiming(sent=time.perf_counter())
            timings.append(timing)
            stream = asyncio.create_task(_stream_one(stub, request, timing, timeout_s))
            if progress is not None:
                stream.add_done_callback(
                    lambda _: progress.update(1))  # type: ignore[attr-defined]
            streams.append(stream)
        await asyncio.gather(*streams)
        seconds = time.perf_counter() - start
    return RunSummary(seconds, timings)
