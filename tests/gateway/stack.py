"""A fake runner and an in-process gateway on a pool of a real block service."""

from __future__ import annotations

import time

import grpc
import httpx

from gateway.client import PagewireClient
from gateway.server import Gateway
from gateway.tokenizer import Tokenizer
from protos import block_pb2, block_pb2_grpc
from tests.gateway.conftest import start_fake_runner, start_gateway
from tests.gateway.fake_runner import FakeRunner
from tests.helpers.services import ServiceProcess

BLOCK_SIZE = 4


class Stack:
    """A fake runner and a gateway on one pool of the shared block service."""

    def __init__(self, tokenizer: Tokenizer, block_service: ServiceProcess, num_blocks: int,
                 epoch: int = 7, max_loras: int = 0, **settings: object) -> None:
        self.runner = FakeRunner(num_blocks, BLOCK_SIZE, epoch=epoch, max_loras=max_loras)
        self.runner_server = start_fake_runner(self.runner)
        self.runner_address = f"127.0.0.1:{self.runner_server.port}"
        self.block_channel = grpc.insecure_channel(block_service.address)
        self.blocks = block_pb2_grpc.BlockServiceStub(self.block_channel)
        self.gateway: Gateway = start_gateway(tokenizer, block_service.address,
                                              self.runner_address, **settings)
        assert self.gateway.service is not None
        self.client = PagewireClient(f"127.0.0.1:{self.gateway.service.port}")

    def http_client(self) -> httpx.Client:
        """A client of the gateway's HTTP API (the stack was made with an http_port)."""
        assert self.gateway.http is not None
        return httpx.Client(base_url=f"http://127.0.0.1:{self.gateway.http.port}", timeout=30)

    def stats(self) -> block_pb2.Stats:
        reply = self.blocks.GetStats(block_pb2.GetStatsRequest(pool_id=self.runner_address))
        return reply.stats

    def wait_idle(self, timeout_s: float = 10.0) -> block_pb2.Stats:
        deadline = time.monotonic() + timeout_s
        while True:
            stats = self.stats()
            if stats.used_blocks == 0 or time.monotonic() > deadline:
                return stats
            time.sleep(0.02)

    def close(self) -> None:
        self.client.close()
        self.gateway.stop()
        self.runner_server.stop(0)
        self.block_channel.close()
