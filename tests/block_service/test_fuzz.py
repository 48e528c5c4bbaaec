"""Hostile input over real gRPC: every BlockService RPC, valid-shaped and raw bytes.

Each call must end with a status from the RPC's documented set (docs/block_service.md,
"Hostile input"); never UNKNOWN (an unhandled exception) or INTERNAL; the server keeps
answering; and afterwards the core's invariants hold. Run with more examples through
PAGEWIRE_FUZZ_EXAMPLES (`make fuzz`).

A fuzz test that passes says little unless its examples ran and got somewhere, so each test
also counts the examples its body ran (all that max_examples allows) and how many of them got
into BlockServiceCore (past gRPC's size limit and the request parser, into the core's own
validation), and asserts a minimum share of those.
"""

from __future__ import annotations

import functools
import os
import tempfile
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from block_service.core import BlockServiceCore, Limits
from block_service.events import PoolEvents
from block_service.journal import Journal, JournalPolicy, read_journal
from block_service.servicer import SERVICE, SERVICE_NAME, register
from block_service.sessions import LeasePolicy
from common.server import ServerOptions, start_server
from protos import block_pb2, block_pb2_grpc

from .invariants import check_invariants, full_state

EXAMPLES = int(os.environ.get("PAGEWIRE_FUZZ_EXAMPLES", "2000"))
POOL = "fuzz-pool"
MAX_MESSAGE_BYTES = 1 << 20
LIMITS = Limits(max_ops_per_step=512, max_tokens_per_request=4096, max_pool_blocks=4096,
                max_pools=16, max_sessions=64, max_seqs_per_session=64)

C = grpc.StatusCode
# UNKNOWN is an exception the servicer did not handle, INTERNAL a failure inside gRPC or the
# server (before this project's parser, an unparsable request): neither is an answer a client
# can act on, whatever it sent.
NEVER = {C.UNKNOWN, C.INTERNAL}
# Any call may carry more bytes than --max-message-bytes: gRPC answers RESOURCE_EXHAUSTED.
# A request that does not parse (bad wire format, invalid UTF-8) is INVALID_ARGUMENT.
COMMON = {C.OK, C.INVALID_ARGUMENT, C.RESOURCE_EXHAUSTED}
SESSION = COMMON | {C.NOT_FOUND, C.FAILED_PRECONDITION}  # unknown / expired session
ALLOWED: dict[str, set[grpc.StatusCode]] = {
    "OpenSession": COMMON,  # RESOURCE_EXHAUSTED: max_sessions
    "KeepAlive": SESSION,
    "CloseSession": SESSION,
    "CreatePool": COMMON | {C.FAILED_PRECONDITION},  # same epoch, other shape; max_pools
    "GetPool": COMMON | {C.NOT_FOUND},
    "Allocate": SESSION | {C.ALREADY_EXISTS},
    "Append": SESSION,  # FAILED_PRECONDITION also: a stale sequence
    "Free": SESSION,
    "Fork": SESSION | {C.ALREADY_EXISTS},
    "Step": SESSION,  # stale epoch, old step id: FAILED_PRECONDITION
    "StepStream": SESSION,  # as Step; RESOURCE_EXHAUSTED also: no thread for another stream
    "MatchPrefix": COMMON | {C.NOT_FOUND},
    "GetStats": COMMON | {C.NOT_FOUND},
    "RegisterRunner": COMMON | {C.FAILED_PRECONDITION},  # same epoch, other shape; max_pools
    "UnregisterRunner": COMMON | {C.NOT_FOUND, C.FAILED_PRECONDITION},  # unknown; other epoch
    "ListRunners": COMMON,
    "Route": COMMON | {C.NOT_FOUND},  # no live runner (among those named)
    # OUT_OF_RANGE: a batch number past the newest; RESOURCE_EXHAUSTED also: no thread left
    "SubscribeKvEvents": COMMON | {C.NOT_FOUND, C.OUT_OF_RANGE},
}


# The BlockServiceCore methods the servicer calls (one per RPC; Step and StepStream call
# step_wire).
CORE_ENTRIES = ("open_session", "keep_alive", "close_session", "create_pool", "get_pool",
                "allocate", "append", "free", "fork", "step_wire", "match_prefix", "stats",
                "register_runner", "unregister_runner", "list_runners", "route",
                "subscribe_events")


@dataclass
class CoreCalls:
    """Counts calls into the core's entry points, made from the server's threads."""

    count: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def wrap(self, core: BlockServiceCore) -> None:
        """Replaces each entry point on this core object by a counting wrapper."""
        for name in CORE_ENTRIES:
            method = getattr(core, name)

            @functools.wraps(method)
            def counted(*args: Any, __method: Callable[..., Any] = method,
                        **kwargs: Any) -> Any:
                with self._lock:
                    self.count += 1
                return __method(*args, **kwargs)
            setattr(core, name, counted)


@dataclass
class Server:
    core: BlockServiceCore
    channel: grpc.Channel
    stub: block_pb2_grpc.BlockServiceStub
    journal_dir: Path
    core_calls: CoreCalls


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    """An in-process server journaling (with frequent snapshots) into a temporary directory,
    so that what hostile input did to the state is also checked to replay."""
    core = BlockServiceCore(LeasePolicy(10.0, 1.0, 60.0), LIMITS)
    journal_dir = tempfile.TemporaryDirectory()
    journal, _ = Journal.open(journal_dir.name, JournalPolicy(snapshot_every_records=300))
    core.attach_journal(journal)
    core_calls = CoreCalls()
    core_calls.wrap(core)
    options = ServerOptions(port=0, max_message_bytes=MAX_MESSAGE_BYTES)
    service = start_server(options, register(core, options.max_workers), [SERVICE_NAME])
    channel = grpc.insecure_channel(f"127.0.0.1:{service.port}", options=[
        ("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)])
    stub = block_pb2_grpc.BlockServiceStub(channel)
    stub.CreatePool(block_pb2.CreatePoolRequest(pool_id=POOL, num_blocks=64, block_size=4,
                                                epoch=1))
    yield Server(core, channel, stub, Path(journal_dir.name), core_calls)
    channel.close()
    service.stop(grace_s=0)
    journal.close()
    journal_dir.cleanup()


# ---- hostile values ----------------------------------------------------------------------
def sized_ints(values: st.SearchStrategy[int],
               enormous_one_in: int = 0) -> st.SearchStrategy[list[int]]:
    """Lists of `values`: mostly short, sometimes empty or past a limit, and (one in
    `enormous_one_in`, if set) past the message size. Long lists repeat one value (cheap)."""
    shapes = {
        "short": st.lists(values, max_size=8),
        "empty": st.just([]),
        "over a limit": st.tuples(values, st.sampled_from([513, 4097, 20_000]))
        .map(lambda drawn: [drawn[0]] * drawn[1]),
        "enormous": st.tuples(values, st.integers(0, 9))
        .map(lambda drawn: [drawn[0]] * (1_100_000 + drawn[1])),
    }
    weights = ["short"] * 16 + ["empty"] * 2 + ["over a limit"] * 2
    if enormous_one_in:
        weights = weights * max(1, enormous_one_in // len(weights)) + ["enormous"]
    return st.sampled_from(weights).flatmap(shapes.__getitem__)


def edge_ints(low: int, high: int, small: int = 8) -> st.SearchStrategy[int]:
    """Small values (they name real things) and the edges of the field's range."""
    edges = [v for v in (low, low + 1, -1, 0, 1, 2**31 - 1, 2**31, 2**32 - 1, 2**32,
                         2**63 - 1, high - 1, high) if low <= v <= high]
    return st.one_of(st.integers(max(low, 0), small), st.sampled_from(edges),
                     st.integers(low, high))


uint32_st = edge_ints(0, 2**32 - 1)
uint64_st = edge_ints(0, 2**64 - 1)
int32_st = edge_ints(-2**31, 2**31 - 1, small=40)
int64_st = edge_ints(-2**63, 2**63 - 1, small=40)
enum_st = st.one_of(st.integers(0, 6), edge_ints(-2**31, 2**31 - 1))
text_st = st.one_of(
    st.just(""), st.text(max_size=12),
    st.sampled_from(["x" * 257, "é" * 200, "y" * 1100, "z" * 100_000, "\x00", "\U0010ffff"]))


def known_or(hostile: st.SearchStrategy[str], known: Callable[[], list[str]]
             ) -> st.SearchStrategy[str]:
    """A name the server knows now (drawn at generation time), or a hostile one."""
    return st.one_of(
        st.integers(0, 1000).map(lambda i: (known() or [""])[i % max(1, len(known()))]),
        st.integers(0, 1000).map(lambda i: (known() or [""])[i % max(1, len(known()))]),
        hostile)


Target = tuple[str, str, int]  # (session_id, pool_id, seq_id)


def requests(server: Server) -> st.SearchStrategy[tuple[str, Any]]:
    """(method name, request message) for every BlockService method."""
    core = server.core
    session_st = known_or(text_st, lambda: list(core.sessions.open))
    pool_st = known_or(text_st, lambda: [POOL, *core.pools])
    pb = block_pb2
    # Hostile token lists, or plausible ones: a few distinct ids, so that prompts share
    # prefixes (cache hits, forks, copy-on-write). Hostile lists alone held a negative id or
    # were empty so often that Allocate answered OK 2 to 7 times in 2000 examples.
    plausible_tokens_st = st.lists(st.integers(0, 3), min_size=1, max_size=12)
    tokens_st = sized_ints(int32_st, enormous_one_in=100) | plausible_tokens_st

    def held() -> list[Target]:
        """Every sequence the server holds now."""
        return [(session, pool_id, seq_id) for pool_id, pm in core.pools.items()
                for session, seqs in pm.seqs.items() for seq_id in seqs]

    # A sequence the server holds (drawn at generation time) half the time: with session, pool
    # and seq_id drawn apart, Append, Free and Fork never once named an existing sequence in
    # 2000 examples, so their core code past the lookup went unfuzzed.
    # (Drawn in the same shape whatever the server holds: Hypothesis replays draws, and a
    # strategy whose draws depend on outside state is "flaky" to it.)
    def held_or(i: int, drawn: Target) -> Target:
        known = held()
        return known[i % len(known)] if known else drawn

    drawn_target_st = st.tuples(session_st, pool_st, uint64_st)
    target_st: st.SearchStrategy[Target] = st.one_of(
        st.builds(held_or, st.integers(0, 1000), drawn_target_st), drawn_target_st)
    def held_seq_id(i: int) -> int:
        seq_ids = [0, *(seq_id for _, _, seq_id in held())]
        return seq_ids[i % len(seq_ids)]

    # Seq ids in Steps: held ones (of any session) or hostile ones.
    op_seq_st = st.one_of(st.integers(0, 1000).map(held_seq_id), uint64_st)

    def step(session: str, pool: str, step_id: int, epoch: int, kinds: list[int],
             seq_ids: list[int], counts: list[int], tokens: list[int], parents: list[int],
             computed: list[int], salts: dict[int, str],
             lookaheads: list[int]) -> pb.StepRequest:
        return pb.StepRequest(session_id=session, pool_id=pool, step_id=step_id, epoch=epoch,
                              op_kinds=kinds, seq_ids=seq_ids, token_counts=counts,
                              token_ids=tokens, parent_seq_ids=parents,
                              num_computed_tokens=computed, cache_salts=salts,
                              num_lookahead_slots=lookaheads)

    def append(target: Target, tokens: list[int], computed: int | None) -> pb.AppendRequest:
        session, pool, seq_id = target
        request = pb.AppendRequest(session_id=session, pool_id=pool, seq_id=seq_id,
                                   token_ids=tokens)
        if computed is not None:
            request.num_computed_tokens = computed
        return request

    def free(target: Target, computed: int | None) -> pb.FreeRequest:
        session, pool, seq_id = target
        request = pb.FreeRequest(session_id=session, pool_id=pool, seq_id=seq_id)
        if computed is not None:
            request.num_computed_tokens = computed
        return request

    def fork(target: Target, child: int) -> pb.ForkRequest:
        session, pool, parent = target
        return pb.ForkRequest(session_id=session, pool_id=pool, parent_seq_id=parent,
                              child_seq_id=child)

    # Steps: matching column lengths most of the time, so that the operations get applied;
    # num_lookahead_slots mostly 0 or 1 (reserving), sometimes anything, or left empty.
    lookahead_st = st.sampled_from([0, 0, 1, 1, 2]) | uint32_st
    ops_st = st.integers(0, 6).flatmap(lambda n: st.tuples(
        st.lists(enum_st, min_size=n, max_size=n), st.lists(op_seq_st, min_size=n, max_size=n),
        st.lists(st.integers(0, 3), min_size=n, max_size=n),
        st.lists(op_seq_st, min_size=n, max_size=n),
        st.lists(int64_st, min_size=n, max_size=n),
        st.just([]) | st.lists(lookahead_st, min_size=n, max_size=n)))

    def matching_step(session: str, pool: str, step_id: int, epoch: int,
                      ops: tuple[list[int], ...], token: int,
                      salts: dict[int, str]) -> pb.StepRequest:
        kinds, seq_ids, counts, parents, computed, lookaheads = ops
        # Salts only for operations that exist: the free-form Step above sends the others
        # (and there they stopped almost every matching Step at validation).
        salts = {index: salt for index, salt in salts.items() if index < len(kinds)}
        return step(session, pool, step_id, epoch, kinds, seq_ids, counts,
                    [token] * sum(counts), parents, computed, salts, lookaheads)

    salts_st = st.dictionaries(uint32_st | st.integers(0, 6), text_st, max_size=3)
    computed_opt = st.none() | uint32_st
    messages = {
        "OpenSession": st.builds(pb.OpenSessionRequest, client_name=text_st,
                                 lease_ttl_ms=uint32_st),
        "KeepAlive": st.builds(pb.KeepAliveRequest, session_id=session_st),
        "CloseSession": st.builds(pb.CloseSessionRequest, session_id=session_st),
        "CreatePool": st.builds(pb.CreatePoolRequest, pool_id=pool_st,
                                num_blocks=uint32_st, block_size=uint32_st, epoch=uint64_st),
        "GetPool": st.builds(pb.GetPoolRequest, pool_id=pool_st),
        "Allocate": st.builds(pb.AllocateRequest, session_id=session_st, pool_id=pool_st,
                              seq_id=uint64_st, token_ids=tokens_st, cache_salt=text_st),
        "Append": st.builds(append, target_st, tokens_st, computed_opt),
        "Free": st.builds(free, target_st, computed_opt),
        "Fork": st.builds(fork, target_st, uint64_st),
        "Step": st.one_of(
            st.builds(step, session_st, pool_st, uint64_st, uint64_st, sized_ints(enum_st),
                      sized_ints(uint64_st), sized_ints(uint32_st), tokens_st,
                      sized_ints(uint64_st), sized_ints(int64_st), salts_st,
                      st.just([]) | sized_ints(uint32_st)),
            st.builds(matching_step, session_st, pool_st, uint64_st,
                      st.sampled_from([0, 0, 1, 2]) | uint64_st, ops_st, int32_st, salts_st)),
        "MatchPrefix": st.builds(pb.MatchPrefixRequest, pool_id=pool_st, token_ids=tokens_st,
                                 cache_salt=text_st),
        "GetStats": st.builds(pb.GetStatsRequest, pool_id=pool_st),
        "RegisterRunner": st.builds(pb.RegisterRunnerRequest, pool_id=pool_st, address=text_st,
                                    num_blocks=uint32_st, block_size=uint32_st,
                                    epoch=uint64_st, lease_ttl_ms=uint32_st),
        "UnregisterRunner": st.builds(pb.UnregisterRunnerRequest, pool_id=pool_st,
                                      epoch=st.sampled_from([0, 1]) | uint64_st),
        "ListRunners": st.just(pb.ListRunnersRequest()),
        "Route": st.builds(pb.RouteRequest, client_name=text_st, token_ids=tokens_st,
                           cache_salt=text_st, policy=enum_st, num_seqs=uint32_st,
                           pool_ids=st.lists(pool_st, max_size=3)),
    }
    messages["StepStream"] = messages["Step"]  # sent as a stream of one
    messages["SubscribeKvEvents"] = subscriptions(core, pool_st)
    assert set(messages) == {method.name for method in SERVICE.methods}
    return st.sampled_from(sorted(messages)).flatmap(
        lambda name: st.tuples(st.just(name), messages[name]))


def call_code(call: Callable[[], Any]) -> grpc.StatusCode:
    try:
        call()
    except grpc.RpcError as error:
        return error.code()
    return C.OK


@dataclass
class Tally:
    """What a fuzz test's examples did: how many ran, which got into the core, the codes."""

    runs: int = 0
    reached_core: int = 0
    codes: Counter[tuple[str, str]] = field(default_factory=Counter)
    reached_by_method: Counter[str] = field(default_factory=Counter)

    def record(self, server: Server, name: str, call: Callable[[], Any]) -> grpc.StatusCode:
        """Makes the call; counts it and whether it entered the core. The server handles a
        call (and counts its core entry) before the answer reaches the client, so the
        counter has moved by the time `call` returns."""
        self.runs += 1
        before = server.core_calls.count
        code = call_code(call)
        reached = server.core_calls.count > before
        self.reached_core += reached
        self.reached_by_method[name] += reached
        self.codes[name, code.name] += 1
        assert code not in NEVER, (name, code)
        return code

    @property
    def answered_ok(self) -> int:
        """Examples that passed every check and were carried out (or answered)."""
        return sum(n for (_, code), n in self.codes.items() if code == C.OK.name)

    def share(self, count: int) -> float:
        return count / max(1, self.runs)

    def method_shares(self, name: str) -> tuple[int, float, float]:
        """One method's examples, and the shares of them that reached the core and that
        were answered OK."""
        runs = sum(n for (method, _), n in self.codes.items() if method == name)
        return (runs, self.reached_by_method[name] / max(1, runs),
                self.codes[name, C.OK.name] / max(1, runs))

    def report(self, what: str) -> str:
        by_method: dict[str, list[str]] = {}
        for (name, code), n in sorted(self.codes.items()):
            by_method.setdefault(name, []).append(f"{code} {n}")
        return (f"{what}: {self.runs} examples, {self.reached_core} "
                f"({self.share(self.reached_core):.0%}) reached the core, {self.answered_ok} "
                f"({self.share(self.answered_ok):.0%}) answered OK; "
                + "; ".join(f"{name}: {', '.join(codes)}" for name, codes in by_method.items()))


def assert_still_serving(server: Server) -> None:
    """The server answers, its invariants hold and its journal replays to the same state."""
    check_invariants(server.core)
    # Every live pool answers. POOL itself may be gone: a fuzzed RegisterRunner may take it
    # under a lease that then runs out, or a fuzzed UnregisterRunner drop it (both as
    # documented), as one run in make test saw.
    for pool_id in list(server.core.pools):
        try:
            stats = server.stub.GetStats(block_pb2.GetStatsRequest(pool_id=pool_id),
                                         timeout=10).stats
        except grpc.RpcError as error:  # its lease ran out just now
            assert error.code() == C.NOT_FOUND and pool_id not in server.core.pools
            continue
        assert stats.free_blocks + stats.used_blocks == stats.total_blocks
    recovered = read_journal(server.journal_dir)
    rebuilt = BlockServiceCore(LeasePolicy(10.0, 1.0, 60.0), LIMITS)
    rebuilt.replay(recovered.state, recovered.records)
    assert full_state(rebuilt) == full_state(server.core)


# ---- the tests -----------------------------------------------------------------------------
def test_allowed_statuses_exclude_internal_and_unknown() -> None:
    assert set(ALLOWED) == {method.name for method in SERVICE.methods}
    for name, codes in ALLOWED.items():
        assert not codes & NEVER, (name, codes & NEVER)


def test_hostile_messages_get_documented_statuses(server: Server) -> None:
    tally = Tally()

    @settings(max_examples=EXAMPLES, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(request=requests(server))
    def fuzz(request: tuple[str, Any]) -> None:
        name, message = request
        if name == "StepStream":
            code = tally.record(server, name, lambda: list(
                server.stub.StepStream(iter([message]), timeout=10)))
        elif name == "SubscribeKvEvents":
            code = tally.record(server, name, lambda: first_batch(
                server.stub.SubscribeKvEvents(message, timeout=FIRST_BATCH_S)))
        else:
            code = tally.record(server, name, lambda: getattr(server.stub, name)(
                message, timeout=10))
        assert code in ALLOWED[name], (name, code, message)

    fuzz()
    report = tally.report("messages")
    print(report)
    # Every example the settings allow ran: nothing filters or assumes examples away, and
    # the space of messages is far too large for Hypothesis to exhaust it and stop early.
    assert tally.runs == EXAMPLES, report
    # Only a message over --max-message-bytes (gRPC refuses it) stays out of the core:
    # 99.3-100% got in over runs of 50 to 20,000.
    assert tally.share(tally.reached_core) >= 0.9, report
    # Past every check: 13-16% over runs of 1000 to 20,000 (a third of the names are
    # hostile, and the server holds few sequences). Hypothesis starts with its simplest
    # examples (the first method, empty names), so a short run sits lower (0-2% of 50):
    # checked from 1000 on.
    if tally.runs >= 1000:
        assert tally.share(tally.answered_ok) >= 0.05, report
    # About 40 of the examples subscribe and about a third of those are valid: a floor of 0.3
    # failed one run in a few (27 %, 11 of 41); 0.1 still proves they get past the checks.
    assert_subscriptions_fuzzed(tally, min_reached=0.9, min_ok=0.1)
    assert_still_serving(server)


# Field 1 of every request is a string (session_id, pool_id or client_name).
INVALID_UTF8 = [b"\x0a\x02\xff\xfe", b"\x0a\x01\x80", b"\x0a\x03\xed\xa0\x80"]


def seed_requests(session_id: str, closable_id: str) -> dict[str, bytes]:
    """Per method, the bytes of one request the server would carry out (for `session_id`
    and POOL), for the raw-bytes fuzzer to mutate. CloseSession names another session,
    `closable_id`: closing `session_id` would make every later seed NOT_FOUND."""
    pb = block_pb2
    step = pb.StepRequest(session_id=session_id, pool_id=POOL, step_id=1, epoch=1,
                          op_kinds=[pb.OP_KIND_ALLOCATE, pb.OP_KIND_APPEND],
                          seq_ids=[1002, 1000], token_counts=[3, 1], token_ids=[1, 2, 3, 4],
                          parent_seq_ids=[0, 0], num_computed_tokens=[0, 5])
    seeds: dict[str, Any] = {
        "OpenSession": pb.OpenSessionRequest(client_name="raw", lease_ttl_ms=60_000),
        "KeepAlive": pb.KeepAliveRequest(session_id=session_id),
        "CloseSession": pb.CloseSessionRequest(session_id=closable_id),
        "CreatePool": pb.CreatePoolRequest(pool_id=POOL, num_blocks=64, block_size=4,
                                           epoch=1),
        "GetPool": pb.GetPoolRequest(pool_id=POOL),
        "Allocate": pb.AllocateRequest(session_id=session_id, pool_id=POOL, seq_id=1000,
                                       token_ids=[1, 2, 3, 4, 5]),
        "Append": pb.AppendRequest(session_id=session_id, pool_id=POOL, seq_id=1000,
                                   token_ids=[6]),
        "Free": pb.FreeRequest(session_id=session_id, pool_id=POOL, seq_id=1000),
        "Fork": pb.ForkRequest(session_id=session_id, pool_id=POOL, parent_seq_id=1000,
                               child_seq_id=1001),
        "Step": step, "StepStream": step,
        "MatchPrefix": pb.MatchPrefixRequest(pool_id=POOL, token_ids=[1, 2, 3, 4]),
        "GetStats": pb.GetStatsRequest(pool_id=POOL),
        "RegisterRunner": pb.RegisterRunnerRequest(pool_id="fuzz-runner", address="127.0.0.1:1",
                                                   num_blocks=64, block_size=4, epoch=1,
                                                   lease_ttl_ms=60_000),
        "UnregisterRunner": pb.UnregisterRunnerRequest(pool_id="fuzz-runner", epoch=1),
        "ListRunners": pb.ListRunnersRequest(),
        "Route": pb.RouteRequest(client_name="raw", token_ids=[1, 2, 3, 4]),
        "SubscribeKvEvents": pb.SubscribeKvEventsRequest(pool_id=POOL),
    }
    return {name: message.SerializeToString() for name, message in seeds.items()}


def mutated(seed: bytes) -> st.SearchStrategy[bytes]:
    """`seed` as is, with one byte changed, inserted or cut off at some point, or with bytes
    appended (unknown fields, a field repeated, a truncated field)."""
    def mutate(kind: str, at: int, byte: int, tail: bytes) -> bytes:
        at %= len(seed) + 1
        if kind == "change" and at < len(seed):
            return seed[:at] + bytes([byte]) + seed[at + 1:]
        if kind == "insert":
            return seed[:at] + bytes([byte]) + seed[at:]
        if kind == "cut":
            return seed[:at]
        if kind == "append":
            return seed + tail
        return seed
    return st.builds(mutate, st.sampled_from(["as is", "change", "insert", "cut", "append"]),
                     st.integers(0, 255), st.integers(0, 255), st.binary(max_size=16))


def test_raw_bytes_get_documented_statuses(server: Server) -> None:
    def raw_call(method: Any) -> Callable[[bytes], Any]:
        path = f"/{SERVICE_NAME}/{method.name}"
        if method.server_streaming and not method.client_streaming:
            subscribe = server.channel.unary_stream(path)
            return lambda data: first_batch(subscribe(data, timeout=FIRST_BATCH_S))
        if method.client_streaming:
            stream = server.channel.stream_stream(path)
            return lambda data: list(stream(iter([data]), timeout=10))
        unary = server.channel.unary_unary(path)
        return lambda data: unary(data, timeout=10)

    methods = {method.name: raw_call(method) for method in SERVICE.methods}
    tally = Tally()
    examples = max(500, EXAMPLES // 2)
    # Random bytes rarely parse (5% reached the core in 1000 examples): mutations of requests
    # that do parse (half the examples) test the parser's edge (a length cut short, a wrong
    # wire type, a field twice) and reach the core with near-valid values.
    session_id, closable_id = (server.stub.OpenSession(block_pb2.OpenSessionRequest(
        client_name="raw", lease_ttl_ms=60_000), timeout=10).session_id for _ in range(2))
    seeds = seed_requests(session_id, closable_id)
    assert set(seeds) == set(methods)

    # One branch per method (a flatmap from the name generated a third slower).
    request_st = st.one_of([
        st.tuples(st.just(name), st.one_of(st.binary(max_size=64), st.sampled_from(INVALID_UTF8),
                                           mutated(seeds[name]), mutated(seeds[name])))
        for name in sorted(methods)])

    @settings(max_examples=examples, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(request=request_st)
    def fuzz(request: tuple[str, bytes]) -> None:
        name, data = request
        code = tally.record(server, name, lambda: methods[name](data))
        assert code in ALLOWED[name], (name, code, data)

    fuzz()
    report = tally.report("raw bytes")
    print(report)
    assert tally.runs == examples, report  # as in the test above
    # Random bytes seldom parse, mutated requests often do: 27-33% of 1000 (30% of 500 and
    # of 10,000) got into the core, 11-18% were answered OK. The minimums leave room for
    # chance at 500.
    assert tally.share(tally.reached_core) >= 0.15, report
    assert tally.share(tally.answered_ok) >= 0.05, report
    # SubscribeKvEvents draws ~50-66 of the 1000 and its shares spread wide: 12-34 % reached
    # the core and 6-18 % were OK in four runs of 2026-12-07 (one make test failed at 12 % of
    # 49 against a floor of 15 %). These floors still need 3 reached and 2 OK of ~50.
    assert_subscriptions_fuzzed(tally, min_reached=0.05, min_ok=0.03)
    assert_still_serving(server)


# ---- SubscribeKvEvents (server streaming) ----------------------------------------------------
# A subscription's first batch comes at once (a snapshot, or the batches after a resume
# point), unless it resumes at the newest batch: then it waits for the next state change, and
# the fuzzer stops waiting after FIRST_BATCH_S.
FIRST_BATCH_S = 0.25


def first_batch(call: Any) -> None:
    """Reads a subscription's first batch, or its error, then cancels it. A stream still
    waiting at its deadline has accepted the subscription: that counts as OK."""
    try:
        next(call, None)
    except grpc.RpcError as error:
        if error.code() != C.DEADLINE_EXCEEDED:
            raise
    finally:
        call.cancel()


def subscriptions(core: BlockServiceCore, pool_st: st.SearchStrategy[str]
                  ) -> st.SearchStrategy[block_pb2.SubscribeKvEventsRequest]:
    """Subscriptions with hostile numbers and instance ids, or (half the time) the server's
    own instance id and a number near the pool's newest batch (-3 .. +1): with drawn ones
    alone, a resume and OUT_OF_RANGE would never happen."""
    def near_newest(pool_id: str, offset: int) -> block_pb2.SubscribeKvEventsRequest:
        pm = core.pools.get(pool_id)
        log = pm.pool.events if pm is not None else None
        newest = log.newest if isinstance(log, PoolEvents) else 0
        return block_pb2.SubscribeKvEventsRequest(
            pool_id=pool_id, after_sequence=max(0, newest + offset),
            instance_id=core.kv_events.instance_id)

    return st.one_of(
        st.builds(block_pb2.SubscribeKvEventsRequest, pool_id=pool_st,
                  after_sequence=uint64_st, instance_id=text_st),
        st.builds(near_newest, pool_st, st.integers(-3, 1)))


def assert_subscriptions_fuzzed(tally: Tally, min_reached: float, min_ok: float) -> None:
    """Enough SubscribeKvEvents examples got into the core's subscribe_events, and past it."""
    runs, reached, ok = tally.method_shares("SubscribeKvEvents")
    report = f"SubscribeKvEvents: {runs} examples, {reached:.0%} reached the core, {ok:.0%} OK"
    print(report)
    if runs >= 20:  # a short run (PAGEWIRE_FUZZ_EXAMPLES=50) draws a handful
        assert reached >= min_reached and ok >= min_ok, report


# ---- what the fuzzer found -----------------------------------------------------------------
@pytest.mark.parametrize("data", [b"\x00", INVALID_UTF8[0]])
def test_unparsable_request_is_invalid_argument_not_internal(server, data):
    """Found by the raw-bytes fuzzer: gRPC answers INTERNAL ("Exception deserializing
    request!") when a request does not parse; the servicer's lenient parser makes it
    INVALID_ARGUMENT and names the message."""
    allocate = server.channel.unary_unary(f"/{SERVICE_NAME}/Allocate")
    with pytest.raises(grpc.RpcError) as error:
        allocate(data, timeout=10)
    assert error.value.code() == C.INVALID_ARGUMENT
    assert "malformed AllocateRequest" in error.value.details()
