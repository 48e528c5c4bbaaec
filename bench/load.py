"""Load generator: many concurrent streaming clients against a pagewire gateway.

Each client is a thread that opens Generate streams one after another until the time is up,
and records each stream's latency (first request byte to last message) and its time to first
token. Every request sets ignore_eos, so a complete stream delivers exactly max_tokens tokens:
each stream is checked against what the client itself received (tokens summed over the
streamed messages), not against the server's own count in usage, which is only cross-checked
(see StreamTally). The report gives requests/s, generated tokens/s, p50/p99 latencies, errors
and incomplete streams, and names the requests of the first failures.

Usage: .venv/bin/python bench/load.py --address 127.0.0.1:50051 [--clients 200]
[--duration-s 60] [--prompt-tokens 16] [--max-tokens 16] [--token-file FILE]
[--tls-ca FILE]
"""

from __future__ import annotations

import argparse
import random
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from itertools import zip_longest
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.harness import percentile
from common.security import ClientTls, open_channel
from gateway.client import build_request
from protos import gateway_pb2, gateway_pb2_grpc


@dataclass
class LoadSettings:
    address: str
    clients: int = 200
    duration_s: float = 60.0
    prompt_tokens: int = 16
    max_tokens: int = 16
    vocab: int = 49152
    token: str | None = None
    tls: ClientTls | None = None
    timeout_s: float = 120.0


# Failures kept word for word in a report (each names its request); the rest are only counted,
# so that a broken server does not make 200 clients hold every message of a minute's load.
FAILURES_KEPT = 20
LENGTH = gateway_pb2.FINISH_REASON_LENGTH


@dataclass
class StreamTally:
    """What one Generate stream delivered, counted as the client received it.

    The server's usage is what the scheduler thinks it generated; a message lost, cut or
    duplicated between the scheduler and this client would not change it. So the verdict
    counts the token ids that actually arrived and then checks that usage agrees with them.
    """

    request_id: str
    messages: int = 0
    tokens: Counter[int] = field(default_factory=Counter)  # output index -> tokens received
    finish: dict[int, int] = field(default_factory=dict)  # output index -> finish reason
    usage: gateway_pb2.Usage | None = None
    problems: list[str] = field(default_factory=list)  # seen while the stream ran

    def observe(self, message: gateway_pb2.GenerateResponse) -> None:
        """Counts one streamed message."""
        self.messages += 1
        if self.usage is not None:
            self.problems.append(f"message {self.messages} came after the one with usage")
        if message.request_id != self.request_id:
            self.problems.append(f"message {self.messages} is for request "
                                 f"{message.request_id!r}")
        for output in message.outputs:
            if output.index in self.finish:
                self.problems.append(f"output {output.index} got message {self.messages} "
                                     "after its finish reason")
            self.tokens[output.index] += len(output.token_ids)
            if output.finish_reason:
                self.finish[output.index] = output.finish_reason
        if message.HasField("usage"):
            self.usage = message.usage

    @property
    def received(self) -> int:
        """Token ids received, all outputs together."""
        return sum(self.tokens.values())

    def verdict(self, max_tokens: int, prompt_tokens: int) -> list[str]:
        """What is wrong with the finished stream of an n=1, ignore_eos request (nothing: [])."""
        problems = list(self.problems)
        if set(self.tokens) - {0} or set(self.finish) - {0}:
            problems.append(f"outputs {sorted(set(self.tokens) | set(self.finish))} for n=1")
        if self.received != max_tokens:
            problems.append(f"received {self.received} tokens in {self.messages} messages, "
                            f"asked for {max_tokens} (ignore_eos)")
        reason = self.finish.get(0, 0)
        if reason != LENGTH:
            problems.append(f"finish reason {gateway_pb2.FinishReason.Name(reason)}, not "
                            "FINISH_REASON_LENGTH")
        if self.usage is None:
            problems.append(f"no usage in {self.messages} messages (the last one is missing)")
        else:
            if self.usage.completion_tokens != self.received:
                problems.append(f"usage counts {self.usage.completion_tokens} completion "
                                f"tokens, {self.received} arrived")
            if self.usage.prompt_tokens != prompt_tokens:
                problems.append(f"usage counts {self.usage.prompt_tokens} prompt tokens, "
                                f"{prompt_tokens} were sent")
        return problems


@dataclass
class ClientStats:
    """What one client thread saw (merged into a LoadReport at the end)."""

    latencies_s: list[float] = field(default_factory=list)
    first_token_s: list[float] = field(default_factory=list)
    tokens: int = 0
    incomplete: int = 0
    errors: Counter[str] = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)  # the first FAILURES_KEPT, by request

    def fail(self, description: str) -> None:
        if len(self.failures) < FAILURES_KEPT:
            self.failures.append(description)


@dataclass
class LoadReport:
    clients: int
    duration_s: float
    requests: int
    tokens: int
    incomplete: int
    errors: dict[str, int]
    p50_latency_s: float
    p99_latency_s: float
    p50_first_token_s: float
    p99_first_token_s: float
    # The first FAILURES_KEPT errors and incomplete streams, each naming its request.
    failures: list[str] = field(default_factory=list)

    @property
    def requests_per_s(self) -> float:
        return self.requests / self.duration_s

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.duration_s

    def summary(self) -> str:
        return (f"{self.clients} clients, {self.duration_s:.1f} s: {self.requests} streams "
                f"({self.requests_per_s:.1f}/s), {self.tokens} tokens ({self.tokens_per_s:.1f}/s)"
                f"; latency p50 {self.p50_latency_s * 1e3:.0f} ms, p99 "
                f"{self.p99_latency_s * 1e3:.0f} ms; first token p50 "
                f"{self.p50_first_token_s * 1e3:.0f} ms, p99 {self.p99_first_token_s * 1e3:.0f}"
                f" ms; errors {sum(self.errors.values())} {self.errors or ''}; incomplete "
                f"{self.incomplete}")


def one_stream(stub: gateway_pb2_grpc.GenerationServiceStub, request: gateway_pb2.GenerateRequest,
               settings: LoadSettings, stats: ClientStats) -> None:
    """Runs one Generate stream to its end and records what it saw."""
    started = time.perf_counter()
    first: float | None = None
    tally = StreamTally(request.request_id)
    try:
        for message in stub.Generate(request, timeout=settings.timeout_s):
            if first is None and any(output.token_ids for output in message.outputs):
                first = time.perf_counter() - started
            tally.observe(message)
    except grpc.RpcError as error:
        stats.errors[error.code().name] += 1
        stats.tokens += tally.received
        stats.fail(f"request {request.request_id}: {error.code().name} after "
                   f"{tally.received} tokens: {error.details()}")
        return
    stats.tokens += tally.received
    problems = tally.verdict(request.sampling_params.max_tokens,
                             len(request.prompt_token_ids.token_ids))
    if problems:
        stats.incomplete += 1
        stats.fail(f"request {request.request_id}: {'; '.join(problems)}")
        return
    stats.latencies_s.append(time.perf_counter() - started)
    stats.first_token_s.append(first if first is not None else stats.latencies_s[-1])


def client_loop(settings: LoadSettings, deadline: float, client: int,
                stats: ClientStats) -> None:
    rng = random.Random(client)
    with open_channel(settings.address, settings.tls, settings.token) as channel:
        stub = gateway_pb2_grpc.GenerationServiceStub(channel)
        number = 0
        while time.monotonic() < deadline:
            prompt = [rng.randrange(16, settings.vocab) for _ in range(settings.prompt_tokens)]
            # ignore_eos: a complete stream has exactly max_tokens tokens. The request id
            # (client, stream) names the request in a failure and is checked on each message.
            request = build_request(token_ids=prompt, max_tokens=settings.max_tokens,
                                    temperature=0.8, seed=rng.getrandbits(32), ignore_eos=True,
                                    request_id=f"load-c{client}-s{number}")
            one_stream(stub, request, settings, stats)
            number += 1


def run_load(settings: LoadSettings) -> LoadReport:
    """Runs `settings.clients` client threads for `settings.duration_s`; the report."""
    started = time.monotonic()
    deadline = started + settings.duration_s
    stats = [ClientStats() for _ in range(settings.clients)]
    threads = [threading.Thread(target=client_loop, args=(settings, deadline, i, stats[i]),
                                daemon=True) for i in range(settings.clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    elapsed = time.monotonic() - started
    latencies = [x for s in stats for x in s.latencies_s]
    first = [x for s in stats for x in s.first_token_s]
    errors: Counter[str] = Counter()
    for s in stats:
        errors.update(s.errors)
    return LoadReport(
        clients=settings.clients, duration_s=elapsed, requests=len(latencies),
        tokens=sum(s.tokens for s in stats), incomplete=sum(s.incomplete for s in stats),
        errors=dict(errors), p50_latency_s=percentile(latencies, 0.5),
        p99_latency_s=percentile(latencies, 0.99), p50_first_token_s=percentile(first, 0.5),
        p99_first_token_s=percentile(first, 0.99),
        # Round robin over the clients: one client's failures alone would hide how many
        # clients had them.
        failures=[f for row in zip_longest(*(s.failures for s in stats)) for f in row
                  if f is not None][:FAILURES_KEPT],
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--address", default="127.0.0.1:50051")
    parser.add_argument("--clients", type=int, default=200)
    parser.add_argument("--duration-s", type=float, default=60.0)
    parser.add_argument("--prompt-tokens", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--token-file", default="", help="bearer token for the gateway")
    parser.add_argument("--tls-ca", default="", help="CA of the gateway's TLS certificate")
    args = parser.parse_args()
    token = Path(args.token_file).read_text().splitlines()[0] if args.token_file else None
    report = run_load(LoadSettings(
        address=args.address, clients=args.clients, duration_s=args.duration_s,
        prompt_tokens=args.prompt_tokens, max_tokens=args.max_tokens, token=token,
        tls=ClientTls(args.tls_ca) if args.tls_ca else None))
    print(report.summary())
    for failure in report.failures:
        print(failure)
    return 0 if not report.errors and not report.incomplete else 1


if __name__ == "__main__":
    sys.exit(main())
