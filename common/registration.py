"""A runner's membership: it keeps its pool registered with the block service under a lease.

A runner started with `--block-service` calls RegisterRunner at once and then every third of
the lease it was granted, for as long as it serves. A runner that stops cleanly unregisters;
one that is killed stops renewing, and the block service drops its pool when the lease runs
out. Either way every gateway then stops sending it work and moves what it was running
(docs/scaling.md, "Membership").
"""

from __future__ import annotations

import argparse
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from common.security import ClientTls, open_channel, read_tokens
from protos import block_pb2, block_pb2_grpc

log = logging.getLogger(__name__)

DEFAULT_LEASE_MS = 3000
_RETRY_S = 0.5  # after a failed registration


@dataclass(frozen=True)
class PoolShape:
    """What a runner registers: its KV pool's shape and its epoch."""

    num_blocks: int
    block_size: int
    epoch: int


def add_registration_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of a runner that registers itself."""
    parser.add_argument("--block-service", default="",
                        help="register with this block service (host:port), so that gateways "
                             "find this runner; unset: gateways must name it with --runner")
    parser.add_argument("--advertise-address", default="",
                        help="the address gateways reach this runner at (default: "
                             "127.0.0.1:<port>; set it when gateways run on other hosts)")
    parser.add_argument("--registration-lease-ms", type=int, default=DEFAULT_LEASE_MS,
                        help="lease asked for: a runner gone this long stops getting work")
    parser.add_argument("--block-service-tls-ca", default="",
                        help="PEM CA of the block service's certificate: connect over TLS")
    parser.add_argument("--block-service-tls-cert", default="",
                        help="PEM client certificate for mutual TLS with the block service")
    parser.add_argument("--block-service-tls-key", default="", help="its PEM private key")
    parser.add_argument("--block-service-auth-token-file", default="",
                        help="token file whose first token is sent to the block service")


class Registration:
    """Keeps one pool registered until stopped."""

    def __init__(self, channel: grpc.Channel, pool_id: str, address: str,
                 shape: Callable[[], PoolShape], lease_ms: int = DEFAULT_LEASE_MS) -> None:
        self._blocks = block_pb2_grpc.BlockServiceStub(channel)
        self._channel = channel
        self.pool_id = pool_id
        self.address = address
        self._shape = shape
        self._lease_ms = lease_ms
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="registration", daemon=True)

    @classmethod
    def from_args(cls, args: argparse.Namespace, port: int,
                  shape: Callable[[], PoolShape]) -> Registration | None:
        """The registration the flags ask for (None without --block-service)."""
        if not args.block_service:
            return None
        address = args.advertise_address or f"127.0.0.1:{port}"
        tls = None
        if args.block_service_tls_ca:
            tls = ClientTls(args.block_service_tls_ca, args.block_service_tls_cert or None,
                            args.block_service_tls_key or None)
        token = (read_tokens(args.block_service_auth_token_file)[0]
                 if args.block_service_auth_token_file else None)
        return cls(open_channel(args.block_service, tls, token), address, address, shape,
                   args.registration_lease_ms)

    def start(self) -> Registration:
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stops renewing and leaves the registry at once (gateways move the runner's
        requests now, not at the end of the lease); a failure to leave only means that.
        Stopping again does nothing."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join(timeout=5)
        try:
            self._blocks.UnregisterRunner(block_pb2.UnregisterRunnerRequest(
                pool_id=self.pool_id, epoch=self._shape().epoch), timeout=1.0)
        except grpc.RpcError as error:
            log.info("leaving the registry: %s", error.code())  # type: ignore[attr-defined]
        self._channel.close()

    def _run(self) -> None:
        registered = False
        while not self._stop.is_set():
            shape = self._shape()
            try:
                reply = self._blocks.RegisterRunner(block_pb2.RegisterRunnerRequest(
                    pool_id=self.pool_id, address=self.address, num_blocks=shape.num_blocks,
                    block_size=shape.block_size, epoch=shape.epoch,
                    lease_ttl_ms=self._lease_ms), timeout=max(1.0, self._lease_ms / 3000))
            except grpc.RpcError as error:
                if registered:
                    log.warning("registration with the block service failed: %s",
                                error.code())  # type: ignore[attr-defined]
                registered = False
                self._stop.wait(_RETRY_S)
                continue
            if not registered:
                log.info("registered as %s with the block service (lease %d ms)",
                         self.address, reply.lease_ttl_ms)
            registered = True
            self._stop.wait(reply.lease_ttl_ms / 3000)
