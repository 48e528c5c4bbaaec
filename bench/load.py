"""Load generator: many concurrent streaming clients against a pagewire gateway.

Each client is a thread that opens Generate streams one after another until the time is up,
checks every stream ends with a finish reason and usage, and records its latency (first
request byte to last message) and its time to first token. The report gives requests/s,
generated tokens/s, p50/p99 latencies, errors and incomplete streams.

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
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

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


@dataclass
class ClientStats:
    """What one client thread saw (merged into a LoadReport at the end)."""

    latencies_s: list[float] = field(default_factory=list)
    first_token_s: list[float] = field(default_factory=list)
    tokens: int = 0
    incomplete: int = 0
    errors: Counter[str] = field(default_factory=Counter)


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


def percentile(values: list[float], fraction: float) -> float:
    """Nearest-rank percentile (0 for no values)."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


def one_stream(stub: gateway_pb2_grpc.GenerationServiceStub, request: gateway_pb2.GenerateRequest,
               settings: LoadSettings, stats: ClientStats) -> None:
    """Runs one Generate stream to its end and records what it saw."""
    started = time.perf_counter()
    first: float | None = None
    finished = False
    usage = None
    try:
        for message in stub.Generate(request, timeout=settings.timeout_s):
            for output in message.outputs:
                if output.token_ids and first is None:
                    first = time.perf_counter() - started
                stats.tokens += len(output.token_ids)
                finished = finished or output.finish_reason != 0
            if message.HasField("usage"):
                usage = message.usage
    except grpc.RpcError as error:
        stats.errors[error.code().name] += 1
        return
    # ignore_eos is set, so a complete stream has exactly max_tokens tokens.
    if not finished or usage is None or usage.completion_tokens != settings.max_tokens:
        stats.incomplete += 1
        return
    stats.latencies_s.append(time.perf_counter() - started)
    stats.first_token_s.append(first if first is not None else stats.latencies_s[-1])


def client_loop(settings: LoadSettings, deadline: float, seed: int, stats: ClientStats) -> None:
    rng = random.Random(seed)
    with open_channel(settings.address, settings.tls, settings.token) as channel:
        stub = gateway_pb2_grpc.GenerationServiceStub(channel)
        while time.monotonic() < deadline:
            prompt = [rng.randrange(16, settings.vocab) for _ in range(settings.prompt_tokens)]
            request = build_request(token_ids=prompt, max_tokens=settings.max_tokens,
                                    temperature=0.8, seed=rng.getrandbits(32), ignore_eos=True)
            one_stream(stub, request, settings, stats)


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
    return 0 if not report.errors and not report.incomplete else 1


if __name__ == "__main__":
    sys.exit(main())
