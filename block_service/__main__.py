"""`python -m block_service --port N`: the block service as a process."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from block_service.core import DEFAULT_MAX_OPS_PER_STEP, DEFAULT_MAX_POOL_BLOCKS, BlockServiceCore
from block_service.metrics import register_pool_metrics
from block_service.reaper import LeaseReaper
from block_service.servicer import SERVICE_NAME, register
from block_service.sessions import LeasePolicy
from common.log import setup_logging
from common.server import (
    add_server_arguments,
    run_until_signal,
    server_options_from_args,
    start_server,
)

DEFAULT_PORT = 50052


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m block_service",
                                     description="pagewire block service (KV-cache blocks)")
    add_server_arguments(parser, "block_service", DEFAULT_PORT)
    parser.add_argument("--default-lease-ttl-s", type=float, default=10.0,
                        help="lease granted when a session asks for 0")
    parser.add_argument("--min-lease-ttl-s", type=float, default=1.0)
    parser.add_argument("--max-lease-ttl-s", type=float, default=300.0)
    parser.add_argument("--reap-interval-s", type=float, default=0.25,
                        help="how often expired leases are looked for")
    parser.add_argument("--max-ops-per-step", type=int, default=DEFAULT_MAX_OPS_PER_STEP)
    parser.add_argument("--max-pool-blocks", type=int, default=DEFAULT_MAX_POOL_BLOCKS)
    parser.add_argument("--log-level", default=None)
    args = parser.parse_args(argv)
    if not 0 < args.min_lease_ttl_s <= args.default_lease_ttl_s <= args.max_lease_ttl_s:
        parser.error("need 0 < min <= default <= max lease TTL")
    if args.max_lease_ttl_s * 1000 >= 2**32:
        parser.error("--max-lease-ttl-s must fit in uint32 milliseconds")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    setup_logging("block_service", args.log_level)
    core = BlockServiceCore(
        LeasePolicy(args.default_lease_ttl_s, args.min_lease_ttl_s, args.max_lease_ttl_s),
        max_ops_per_step=args.max_ops_per_step, max_pool_blocks=args.max_pool_blocks)
    register_pool_metrics(core)
    service = start_server(server_options_from_args(args), register(core), [SERVICE_NAME])
    reaper = LeaseReaper(core, args.reap_interval_s).start()
    return run_until_signal(service, on_stop=reaper.stop)


if __name__ == "__main__":
    sys.exit(main())
