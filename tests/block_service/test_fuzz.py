"""Hostile input over real gRPC: every BlockService RPC, valid-shaped and raw bytes.

Each call must end with a status from the RPC's documented set (docs/block_service.md,
"Hostile input"); never UNKNOWN (an unhandled exception) or INTERNAL; the server keeps
answering; and afterwards the core's invariants hold. Run with more examples through
PAGEWIRE_FUZZ_EXAMPLES (`make fuzz`).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from block_service.core import BlockServiceCore, Limits
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
}


@dataclass
class Server:
    core: BlockServiceCore
    channel: grpc.Channel
    stub: block_pb2_grpc.BlockServiceStub
    journal_dir: Path


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    """An in-process server journaling (with frequent snapshots) into a temporary directory,
    so that what hostile input did to the state is also checked to replay."""
    core = BlockServiceCore(LeasePolicy(10.0, 1.0, 60.0), LIMITS)
    journal_dir = tempfile.TemporaryDirectory()
    journal, _ = Journal.open(journal_dir.name, JournalPolicy(snapshot_every_records=300))
    core.attach_journal(journal)
    options = ServerOptions(port=0, max_message_bytes=MAX_MESSAGE_BYTES)
    service = start_server(options, register(core, options.max_workers), [SERVICE_NAME])
    channel = grpc.insecure_channel(f"127.0.0.1:{service.port}", options=[
        ("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)])
    stub = block_pb2_grpc.BlockServiceStub(channel)
    stub.CreatePool(block_pb2.CreatePoolRequest(pool_id=POOL, num_blocks=64, block_size=4,
                                                epoch=1))
    yield Server(core, channel, stub, Path(journal_dir.name))
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


def requests(server: Server) -> st.SearchStrategy[tuple[str, Any]]:
    """(method name, request message) for every BlockService method."""
    core = server.core
    session_st = known_or(text_st, lambda: list(core.sessions.open))
    pool_st = known_or(text_st, lambda: [POOL, *core.pools])
    pb = block_pb2
    tokens_st = sized_ints(int32_st, enormous_one_in=100)

    def step(session: str, pool: str, step_id: int, epoch: int, kinds: list[int],
             seq_ids: list[int], counts: list[int], tokens: list[int], parents: list[int],
             computed: list[int], salts: dict[int, str],
             lookaheads: list[int]) -> pb.StepRequest:
        return pb.StepRequest(session_id=session, pool_id=pool, step_id=step_id, epoch=epoch,
                              op_kinds=kinds, seq_ids=seq_ids, token_counts=counts,
                              token_ids=tokens, parent_seq_ids=parents,
                              num_computed_tokens=computed, cache_salts=salts,
                              num_lookahead_slots=lookaheads)

    def append(session: str, pool: str, seq_id: int, tokens: list[int],
               computed: int | None) -> pb.AppendRequest:
        request = pb.AppendRequest(session_id=session, pool_id=pool, seq_id=seq_id,
                                   token_ids=tokens)
        if computed is not None:
            request.num_computed_tokens = computed
        return request

    def free(session: str, pool: str, seq_id: int, computed: int | None) -> pb.FreeRequest:
        request = pb.FreeRequest(session_id=session, pool_id=pool, seq_id=seq_id)
        if computed is not None:
            request.num_computed_tokens = computed
        return request

    # Steps: matching column lengths most of the time, so that the operations get applied;
    # num_lookahead_slots mostly 0 or 1 (reserving), sometimes anything, or left empty.
    lookahead_st = st.sampled_from([0, 0, 1, 1, 2]) | uint32_st
    ops_st = st.integers(0, 6).flatmap(lambda n: st.tuples(
        st.lists(enum_st, min_size=n, max_size=n), st.lists(uint64_st, min_size=n, max_size=n),
        st.lists(st.integers(0, 3), min_size=n, max_size=n),
        st.lists(uint64_st, min_size=n, max_size=n),
        st.lists(int64_st, min_size=n, max_size=n),
        st.just([]) | st.lists(lookahead_st, min_size=n, max_size=n)))

    def matching_step(session: str, pool: str, step_id: int, epoch: int,
                      ops: tuple[list[int], ...], token: int,
                      salts: dict[int, str]) -> pb.StepRequest:
        kinds, seq_ids, counts, parents, computed, lookaheads = ops
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
        "Append": st.builds(append, session_st, pool_st, uint64_st, tokens_st, computed_opt),
        "Free": st.builds(free, session_st, pool_st, uint64_st, computed_opt),
        "Fork": st.builds(pb.ForkRequest, session_id=session_st, pool_id=pool_st,
                          parent_seq_id=uint64_st, child_seq_id=uint64_st),
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
    }
    messages["StepStream"] = messages["Step"]  # sent as a stream of one
    assert set(messages) == {method.name for method in SERVICE.methods}
    return st.sampled_from(sorted(messages)).flatmap(
        lambda name: st.tuples(st.just(name), messages[name]))


def call_code(call: Callable[[], Any]) -> grpc.StatusCode:
    try:
        call()
    except grpc.RpcError as error:
        return error.code()
    return C.OK


def assert_still_serving(server: Server) -> None:
    """The server answers, its invariants hold and its journal replays to the same state."""
    check_invariants(server.core)
    stats = server.stub.GetStats(block_pb2.GetStatsRequest(pool_id=POOL), timeout=10).stats
    assert stats.free_blocks + stats.used_blocks == stats.total_blocks
    recovered = read_journal(server.journal_dir)
    rebuilt = BlockServiceCore(LeasePolicy(10.0, 1.0, 60.0), LIMITS)
    rebuilt.replay(recovered.state, recovered.records)
    assert full_state(rebuilt) == full_state(server.core)


# ---- the tests -----------------------------------------------------------------------------
def test_hostile_messages_get_documented_statuses(server):
    @settings(max_examples=EXAMPLES, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(request=requests(server))
    def fuzz(request: tuple[str, Any]) -> None:
        name, message = request
        if name == "StepStream":
            code = call_code(lambda: list(server.stub.StepStream(iter([message]), timeout=10)))
        else:
            code = call_code(lambda: getattr(server.stub, name)(message, timeout=10))
        assert code in ALLOWED[name], (name, code, message)

    fuzz()
    assert_still_serving(server)


# Field 1 of every request is a string (session_id, pool_id or client_name).
INVALID_UTF8 = [b"\x0a\x02\xff\xfe", b"\x0a\x01\x80", b"\x0a\x03\xed\xa0\x80"]


def test_raw_bytes_get_documented_statuses(server):
    def raw_call(method: Any) -> Callable[[bytes], Any]:
        path = f"/{SERVICE_NAME}/{method.name}"
        if method.client_streaming:
            stream = server.channel.stream_stream(path)
            return lambda data: list(stream(iter([data]), timeout=10))
        unary = server.channel.unary_unary(path)
        return lambda data: unary(data, timeout=10)

    methods = {method.name: raw_call(method) for method in SERVICE.methods}

    @settings(max_examples=max(500, EXAMPLES // 2), deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(name=st.sampled_from(sorted(methods)),
           data=st.one_of(st.binary(max_size=64), st.sampled_from(INVALID_UTF8)))
    def fuzz(name: str, data: bytes) -> None:
        code = call_code(lambda: methods[name](data))
        assert code in ALLOWED[name], (name, code, data)

    fuzz()
    assert_still_serving(server)


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
