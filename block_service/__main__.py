"""`python -m block_service --port N`: the block service as a process."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from collections.abc import Sequence

from block_service.core import BlockServiceCore, Limits
from block_service.journal import (
    DEFAULT_SNAPSHOT_EVERY_RECORDS,
    DEFAULT_SNAPSHOT_EVERY_S,
    Journal,
    JournalPolicy,
)
from block_service.metrics import register_pool_metrics
from block_service.reaper import LeaseReaper
from block_service.servicer import serve
from block_service.sessions import LeasePolicy
from common.log import setup_logging
from common.server import (
    add_server_arguments,
    run_until_signal,
    server_options_from_args,
)

DEFAULT_PORT = 50052
JOURNAL_DIR_ENV = "PAGEWIRE_BLOCK_SERVICE_JOURNAL_DIR"

log = logging.getLogger("block_service")


def add_limit_arguments(parser: argparse.ArgumentParser) -> None:
    """--max-* options: what one client may ask for (see core.Limits)."""
    defaults = Limits()
    for name, help_text in [
        ("max_ops_per_step", "operations in one Step"),
        ("max_tokens_per_request", "tokens in one request (Step, Allocate, Append, MatchPrefix)"),
        ("max_pool_blocks", "blocks of one pool"),
        ("max_pools", "pools in all"),
        ("max_sessions", "open sessions in all (more: RESOURCE_EXHAUSTED)"),
        ("max_seqs_per_session", "live sequences of one session in all pools"),
    ]:
        parser.add_argument("--" + name.replace("_", "-"), type=int,
                            default=getattr(defaults, name), help=help_text)


def add_journal_arguments(parser: argparse.ArgumentParser) -> None:
    """--journal-* options: crash recovery (docs/block_service.md, "Crash recovery")."""
    parser.add_argument("--journal-dir", default=os.environ.get(JOURNAL_DIR_ENV) or None,
                        help=f"journal state changes here and replay them at start "
                             f"(env {JOURNAL_DIR_ENV}; unset: no journal)")
    parser.add_argument("--journal-fsync", action="store_true",
                        help="fdatasync every record before answering (survives a machine "
                             "crash, not only a process kill)")
    parser.add_argument("--snapshot-every-records", type=int,
                        default=DEFAULT_SNAPSHOT_EVERY_RECORDS)
    parser.add_argument("--snapshot-every-s", type=float, default=DEFAULT_SNAPSHOT_EVERY_S)


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
    add_limit_arguments(parser)
    add_journal_arguments(parser)
    parser.add_argument("--server", choices=["aio", "threads"], default="aio",
                        help="aio: Steps on an event loop, no thread per StepStream (default); "
                             "threads: the threaded server of earlier versions (a thread per "
                             "StepStream; kept for comparison: bench/control_plane.py)")
    parser.add_argument("--step-path", choices=["compiled", "python"], default="compiled",
                        help="compiled: Steps through block_service._stepwire where it is "
                             "built (default); python: the Python path (same answers, several "
                             "times the CPU; for comparison)")
    parser.add_argument("--log-level", default=None)
    args = parser.parse_args(argv)
    if not 0 < args.min_lease_ttl_s <= args.default_lease_ttl_s <= args.max_lease_ttl_s:
        parser.error("need 0 < min <= default <= max lease TTL")
    if args.max_lease_ttl_s * 1000 >= 2**32:
        parser.error("--max-lease-ttl-s must fit in uint32 milliseconds")
    if min(getattr(args, name) for name in vars(Limits())) < 1:
        parser.error("every --max-* limit must be at least 1")
    return args


def recover(core: BlockServiceCore, args: argparse.Namespace) -> Journal:
    """Replays the journal directory into `core` and attaches the journal for what follows."""
    started = time.monotonic()
    journal, recovered = Journal.open(args.journal_dir, JournalPolicy(
        args.journal_fsync, args.snapshot_every_records, args.snapshot_every_s))
    core.replay(recovered.state, recovered.records)
    core.attach_journal(journal)
    if recovered.records:
        core.snapshot_now()  # the next start replays from here
    log.info("journal %s: replayed a %s and %d records in %.3f s (%d torn bytes dropped)",
             args.journal_dir, "snapshot" if recovered.state else "empty state",
             len(recovered.records), time.monotonic() - started, recovered.dropped_bytes)
    return journal


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    options = server_options_from_args(args)  # first: --nice before any thread starts
    setup_logging("block_service", args.log_level)
    core = BlockServiceCore(
        LeasePolicy(args.default_lease_ttl_s, args.min_lease_ttl_s, args.max_lease_ttl_s),
        limits=Limits(**{name: getattr(args, name) for name in vars(Limits())}),
        compiled_steps=args.step_path == "compiled")
    journal = recover(core, args) if args.journal_dir else None
    register_pool_metrics(core)
    service, stop_loop = serve(core, options, threaded=args.server == "threads")
    reaper = LeaseReaper(core, args.reap_interval_s).start()

    def stop() -> None:
        reaper.stop()
        stop_loop()
        if journal is not None:
            journal.close()

    return run_until_signal(service, on_stop=stop)


if __name__ == "__main__":
    sys.exit(main())
