"""Each limit over real gRPC: the status, a message that names the limit, nothing changed.
And tenant isolation through cache salts: different salts never share blocks, one salt does."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest

from block_service.core import BlockServiceCore, Limits
from block_service.servicer import SERVICE_NAME, register
from block_service.sessions import LeasePolicy
from common.server import ServerOptions, start_server
from protos import block_pb2, block_pb2_grpc

from .invariants import full_state

POOL = "pool"
LIMITS = Limits(max_ops_per_step=4, max_tokens_per_request=64, max_pool_blocks=128,
                max_pools=2, max_sessions=3, max_seqs_per_session=3)
pb = block_pb2


class Client:
    """A stub on an in-process server with LIMITS, and its core (to see what changed)."""

    def __init__(self, core: BlockServiceCore, stub: block_pb2_grpc.BlockServiceStub) -> None:
        self.core, self.stub = core, stub

    def session(self) -> str:
        return self.stub.OpenSession(pb.OpenSessionRequest(client_name="t")).session_id

    def refused(self, method: str, request: object) -> tuple[grpc.StatusCode, str]:
        """Calls `method`, which must fail without changing anything: (code, message)."""
        before = full_state(self.core)
        with pytest.raises(grpc.RpcError) as error:
            getattr(self.stub, method)(request, timeout=10)
        assert full_state(self.core) == before
        return error.value.code(), error.value.details()


@pytest.fixture
def client() -> Iterator[Client]:
    core = BlockServiceCore(LeasePolicy(10.0, 1.0, 60.0), LIMITS)
    options = ServerOptions(port=0)
    service = start_server(options, register(core, options.max_workers), [SERVICE_NAME])
    channel = grpc.insecure_channel(f"127.0.0.1:{service.port}")
    stub = block_pb2_grpc.BlockServiceStub(channel)
    stub.CreatePool(pb.CreatePoolRequest(pool_id=POOL, num_blocks=64, block_size=4, epoch=1))
    yield Client(core, stub)
    channel.close()
    service.stop(grace_s=0)


def decode(session: str, num_ops: int, step_id: int = 1) -> pb.StepRequest:
    return pb.StepRequest(session_id=session, pool_id=POOL, step_id=step_id,
                          op_kinds=[pb.OP_KIND_APPEND] * num_ops, seq_ids=list(range(num_ops)),
                          token_counts=[1] * num_ops, token_ids=[1] * num_ops,
                          parent_seq_ids=[0] * num_ops, num_computed_tokens=[-1] * num_ops)


def allocate_step(session: str, seq_ids: list[int], tokens: int,
                  salt: str = "", step_id: int = 1) -> pb.StepRequest:
    return pb.StepRequest(
        session_id=session, pool_id=POOL, step_id=step_id,
        op_kinds=[pb.OP_KIND_ALLOCATE] * len(seq_ids), seq_ids=seq_ids,
        token_counts=[tokens] * len(seq_ids), token_ids=list(range(tokens)) * len(seq_ids),
        parent_seq_ids=[0] * len(seq_ids), num_computed_tokens=[-1] * len(seq_ids),
        cache_salts=dict.fromkeys(range(len(seq_ids)), salt) if salt else {})


def test_ops_per_step(client):
    session = client.session()
    assert client.stub.Step(decode(session, 4)).step_id == 1  # at the limit: applied
    code, message = client.refused("Step", decode(session, 5, step_id=2))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "max_ops_per_step" in message


@pytest.mark.parametrize("method", ["Step", "Allocate", "Append", "MatchPrefix"])
def test_tokens_per_request(client, method):
    session = client.session()
    tokens = list(range(65))
    request = {
        "Step": pb.StepRequest(session_id=session, pool_id=POOL, step_id=1,
                               op_kinds=[pb.OP_KIND_ALLOCATE], seq_ids=[1], token_counts=[65],
                               token_ids=tokens, parent_seq_ids=[0], num_computed_tokens=[-1]),
        "Allocate": pb.AllocateRequest(session_id=session, pool_id=POOL, seq_id=1,
                                       token_ids=tokens),
        "Append": pb.AppendRequest(session_id=session, pool_id=POOL, seq_id=1,
                                   token_ids=tokens),
        "MatchPrefix": pb.MatchPrefixRequest(pool_id=POOL, token_ids=tokens),
    }[method]
    code, message = client.refused(method, request)
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert "65 tokens" in message and "max_tokens_per_request" in message
    assert client.stub.Allocate(pb.AllocateRequest(  # 64 tokens: at the limit, accepted
        session_id=session, pool_id=POOL, seq_id=2, token_ids=tokens[:64])).allocated


def test_pool_blocks(client):
    code, message = client.refused("CreatePool", pb.CreatePoolRequest(
        pool_id="big", num_blocks=129, block_size=4, epoch=1))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "max_pool_blocks" in message
    client.stub.CreatePool(pb.CreatePoolRequest(pool_id="big", num_blocks=128, block_size=4,
                                                epoch=1))


def test_pools_in_all(client):
    client.stub.CreatePool(pb.CreatePoolRequest(pool_id="second", num_blocks=8, block_size=4,
                                                epoch=1))
    code, message = client.refused("CreatePool", pb.CreatePoolRequest(
        pool_id="third", num_blocks=8, block_size=4, epoch=1))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_pools" in message
    # An existing pool's new epoch is not a new pool.
    client.stub.CreatePool(pb.CreatePoolRequest(pool_id="second", num_blocks=8, block_size=4,
                                                epoch=2))


def test_sessions_in_all(client):
    sessions = [client.session() for _ in range(3)]
    code, message = client.refused("OpenSession", pb.OpenSessionRequest(client_name="4th"))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_sessions" in message
    client.stub.CloseSession(pb.CloseSessionRequest(session_id=sessions[0]))
    assert client.session()  # a closed session makes room


def test_sequences_per_session(client):
    session = client.session()
    step = client.stub.Step(allocate_step(session, [1, 2, 3, 4], 2))
    ok, invalid = pb.OP_STATUS_OK, pb.OP_STATUS_INVALID_ARGUMENT
    assert list(step.op_statuses) == [ok, ok, ok, invalid]
    assert "max_seqs_per_session" in step.errors[3]
    code, message = client.refused("Fork", pb.ForkRequest(
        session_id=session, pool_id=POOL, parent_seq_id=1, child_seq_id=9))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "max_seqs_per_session" in message
    other = client.session()  # the limit is per session
    assert client.stub.Allocate(pb.AllocateRequest(session_id=other, pool_id=POOL, seq_id=1,
                                                   token_ids=[1])).allocated


@pytest.mark.parametrize("method, request_of", [
    ("OpenSession", lambda s: pb.OpenSessionRequest(client_name="n" * 257)),
    ("Allocate", lambda s: pb.AllocateRequest(session_id=s, pool_id=POOL, seq_id=1,
                                              token_ids=[1], cache_salt="s" * 1025)),
    ("Step", lambda s: allocate_step(s, [1], 2, salt="s" * 1025)),
    ("MatchPrefix", lambda s: pb.MatchPrefixRequest(pool_id=POOL, token_ids=[1],
                                                    cache_salt="s" * 1025)),
    ("CreatePool", lambda s: pb.CreatePoolRequest(pool_id="p" * 257, num_blocks=1,
                                                  block_size=1, epoch=1)),
])
def test_string_lengths(client, method, request_of):
    code, message = client.refused(method, request_of(client.session()))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "longer than" in message


# ---- tenants -------------------------------------------------------------------------------
def test_salts_separate_tenants_and_one_salt_shares(client):
    """A 10-token prompt in blocks of 4: its first 2 blocks (8 tokens) are shareable once
    computed; the last token is always computed again."""
    session = client.session()
    prompt = list(range(10))
    first = client.stub.Allocate(pb.AllocateRequest(session_id=session, pool_id=POOL, seq_id=1,
                                                    token_ids=prompt, cache_salt="tenant-a"))
    client.stub.Free(pb.FreeRequest(session_id=session, pool_id=POOL, seq_id=1,
                                    num_computed_tokens=10))  # computed: 2 blocks cached

    def cached(salt: str) -> int:
        return client.stub.MatchPrefix(pb.MatchPrefixRequest(
            pool_id=POOL, token_ids=prompt, cache_salt=salt)).num_cached_tokens

    assert (cached("tenant-a"), cached("tenant-b"), cached("")) == (8, 0, 0)
    other = client.stub.Step(allocate_step(session, [2], 10, salt="tenant-b"))
    same = client.stub.Step(allocate_step(session, [3], 10, salt="tenant-a", step_id=2))
    unsalted = client.stub.Allocate(pb.AllocateRequest(session_id=session, pool_id=POOL,
                                                       seq_id=4, token_ids=prompt))
    assert list(other.num_cached_tokens) == [0]
    assert not set(other.table_block_ids) & set(first.block_table[:2])  # [2] was never cached
    assert list(same.num_cached_tokens) == [8]
    assert list(same.table_block_ids)[:2] == list(first.block_table)[:2]
    assert unsalted.num_cached_tokens == 0
    assert not set(unsalted.block_table) & set(first.block_table[:2])
