"""The floor under the gateway's CPU per streamed message: grpc.aio alone, and with the
gateway's own hand-over, with no scheduling, detokenizing or runner behind it.

    .venv/bin/python bench/stream_floor.py                  # 256 streams x 400 messages
    .venv/bin/python bench/stream_floor.py --streams 64 --messages 1000

A server process serves GenerationService.Generate on a grpc.aio server, each stream N
messages of one token (a GenerateResponse as the gateway sends at stream interval 1), to S
streams at once from client processes (bench/stream_clients.py, as bench/gateway_plane.py
drives a gateway); every stream's token count is checked on the client. Two ways, each on a
fresh server process:
- "grpc.aio": the handler yields a ready message N times: what grpc.aio itself costs per message;
- "outbox": a producer thread makes each step's messages (one new GenerateResponse per stream)
  and hands them over as a runner loop does (gateway/delivery.py: Outbox, AsyncSink, one
  wake-up per step), and the handler reads its queue as GenerationServicer.Generate does; the
  next step is made once no stream has more than one message unread (the gateway coalesces
  there instead).
Reported: the server process's CPU (/proc/<pid>/stat, all threads) per message, messages per
second. Compare with bench/gateway_plane.py's gateway CPU per streamed token at interval 1:
the difference is what scheduling, output processing and the runner RPCs add.

Results: bench/results/stream_floor.{json,md}.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import grpc  # noqa: E402

from bench.harness import (  # noqa: E402
    RESULTS,
    accepts_channels,
    exit_on_sigterm,
    free_port,
    git_state,
    run_header,
    save_results,
    service_counters,
    start_python,
    stop,
    wait_for,
)
from bench.stream_clients import ClientProcess, spread  # noqa: E402
from bench.workloads import BenchRequest  # noqa: E402
from gateway.delivery import AsyncSink, Item, Outbox  # noqa: E402
from protos import gateway_pb2, gateway_pb2_grpc  # noqa: E402

WAYS = ("grpc.aio", "outbox")
TOKEN_ID = 1000


def one_token_message(request_id: str) -> gateway_pb2.GenerateResponse:
    return gateway_pb2.GenerateResponse(request_id=request_id, outputs=[
        gateway_pb2.CompletionOutput(index=0, text=" word", token_ids=[TOKEN_ID])])


class FloorServicer(gateway_pb2_grpc.GenerationServiceServicer):
    """Generate streams `messages` one-token messages, made the given way."""

    def __init__(self, way: str, streams: int, messages: int) -> None:
        self.way = way
        self.streams = streams
        self.messages = messages
        self.sinks: list[AsyncSink[None]] = []
        self.all_open = threading.Event()

    async def Generate(self, request: gateway_pb2.GenerateRequest,
                       context: grpc.aio.ServicerContext
                       ) -> AsyncIterator[gateway_pb2.GenerateResponse]:
        if self.way == WAYS[0]:
            message = one_token_message("floor")
            for _ in range(self.messages):
                yield message
            return
        queue: asyncio.Queue[tuple[None, Item]] = asyncio.Queue()
        sink = AsyncSink(asyncio.get_running_loop(), queue, None)
        self.sinks.append(sink)
        if len(self.sinks) == self.streams:
            self.all_open.set()
        while True:
            _, item = await queue.get()
            sink.taken()
            if item is None:
                return
            assert isinstance(item, gateway_pb2.GenerateResponse)
            yield item

    def produce(self) -> None:
        """The runner loop's part: a step's messages, one Outbox hand-over per step."""
        self.all_open.wait()
        outbox = Outbox()
        for step in range(self.messages + 1):
            for index, sink in enumerate(self.sinks):
                outbox.put(sink, one_token_message(f"r{index}") if step < self.messages
                           else None)
            outbox.send()
            while max(sink.unread for sink in self.sinks) > 1:
                time.sleep(0.0005)


async def serve(way: str, port: int, streams: int, messages: int) -> None:
    server = grpc.aio.server()
    servicer = FloorServicer(way, streams, messages)
    gateway_pb2_grpc.add_GenerationServiceServicer_to_server(servicer, server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    if way == WAYS[1]:
        threading.Thread(target=servicer.produce, name="producer", daemon=True).start()
    await server.wait_for_termination()


def run_way(way: str, streams: int, messages: int, clients: int) -> dict[str, Any]:
    port = free_port()
    server = start_python(["-m", "bench.stream_floor", "--serve", way, "--port", str(port),
                           "--streams", str(streams), "--messages", str(messages)])
    procs: list[ClientProcess] = []
    try:
        wait_for("the floor server", lambda: accepts_channels(f"127.0.0.1:{port}"), [server],
                 60)
        cpu_before = service_counters(server.pid)[0]
        started = time.perf_counter()
        requests = [BenchRequest([1, 2, 3], messages) for _ in range(streams)]
        for part in spread(streams, clients):
            procs.append(ClientProcess([f"127.0.0.1:{port}"], [requests[i] for i in part],
                                       [0] * len(part), timeout_s=600))
        finals = [proc.wait_final(600) for proc in procs]
        seconds = time.perf_counter() - started
        cpu = service_counters(server.pid)[0] - cpu_before
    finally:
        for proc in procs:
            proc.close()
        stop(server)
    counts = [count for final in finals for count in final["counts"]]
    errors = sum(final["error_count"] for final in finals)
    if errors or counts != [messages] * streams:
        raise SystemExit(f"{way}: {errors} errors, counts {sorted(set(counts))}, expected "
                         f"{messages} per stream: {finals[0]['errors']}")
    total = streams * messages
    return {"way": way, "streams": streams, "messages_per_stream": messages,
            "clients": clients, "seconds": seconds, "server_cpu_s": cpu,
            "cpu_us_per_message": cpu / total * 1e6, "messages_per_s": total / seconds}


def markdown(data: dict[str, Any]) -> str:
    lines = ["# The floor under the gateway's CPU per streamed message", "",
             f"`{data['command']}` — {data['measured_at']}, git {data['git']}, "
             f"{data['cpus']} CPUs, load average {data['load_before']:.2f} before the run.", "",
             "Each way on a fresh server process: S streams of N one-token messages from client "
             "processes, every count checked; server CPU from /proc over the whole run "
             "(bench/stream_floor.py's docstring says what each way does).", "",
             "| way | streams | messages each | clients | seconds | messages/s "
             "| server CPU µs per message |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for run in data["runs"]:
        lines.append(f"| {run['way']} | {run['streams']} | {run['messages_per_stream']} | "
                     f"{run['clients']} | {run['seconds']:.2f} | {run['messages_per_s']:,.0f} "
                     f"| {run['cpu_us_per_message']:.1f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=256)
    parser.add_argument("--messages", type=int, default=400, help="per stream")
    parser.add_argument("--clients", type=int, default=4, help="client processes")
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument("--serve", choices=WAYS, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve:
        asyncio.run(serve(args.serve, args.port, args.streams, args.messages))
        return 0
    # Stopped with SIGTERM, run_way's clean-up still stops its server and clients.
    exit_on_sigterm()
    data: dict[str, Any] = {
        **run_header("bench/stream_floor.py", argv),
        "git": git_state(), "cpus": os.cpu_count(), "load_before": os.getloadavg()[0],
        "runs": []}
    for way in WAYS:
        run = run_way(way, args.streams, args.messages, args.clients)
        data["runs"].append(run)
        print(f"{way}: {run['cpu_us_per_message']:.1f} µs of server CPU per message, "
              f"{run['messages_per_s']:,.0f} messages/s", flush=True)
    save_results(args.results, "stream_floor", data, markdown(data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
