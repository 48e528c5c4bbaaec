"""Runner membership and routing in the core: leases, load figures, the three policies."""

from __future__ import annotations

from collections.abc import Callable
from itertools import pairwise

import pytest

from block_service.core import BlockServiceCore
from block_service.journal import Journal, JournalPolicy
from block_service.ops import OP_ALLOCATE, OP_APPEND, STATUS_OK, BlockServiceError, ErrorCode
from block_service.registry import (
    DECODE_WEIGHT_TOKENS,
    POLICY_LEAST_LOADED,
    POLICY_PREFIX,
    POLICY_ROUND_ROBIN,
)

from .conftest import FakeClock

BLOCK = 4
PREFIX = list(range(100, 132))  # 8 full blocks


def register(core: BlockServiceCore, pool_id: str, epoch: int = 1, blocks: int = 64,
             ttl_ms: int = 2000) -> None:
    core.register_runner(pool_id, f"{pool_id}.host:1", blocks, BLOCK, epoch, ttl_ms)


def allocate(core: BlockServiceCore, session: str, pool_id: str, seq_id: int,
             tokens: list[int], step_id: int, computed: bool = True, waiting: int = 0) -> None:
    """Allocates `tokens` as one sequence; with `computed`, reports them all computed (a
    following APPEND of one token) so that their full blocks are published."""
    result = core.step(session, pool_id, step_id, 0, [OP_ALLOCATE], [seq_id], [len(tokens)],
                       tokens, [0], [-1], num_waiting_tokens=waiting)
    assert result.op_statuses == [STATUS_OK]
    if computed:
        result = core.step(session, pool_id, step_id + 1, 0, [OP_APPEND], [seq_id], [1], [7],
                           [0], [len(tokens)], num_waiting_tokens=waiting)
        assert result.op_statuses == [STATUS_OK]


@pytest.fixture
def core(make_core: Callable[..., BlockServiceCore]) -> BlockServiceCore:
    return make_core()


def test_registered_pool_is_live_until_its_lease_runs_out(core: BlockServiceCore,
                                                          clock: FakeClock) -> None:
    info, ttl_ms = core.register_runner("a", "10.0.0.1:5", 64, BLOCK, 1, 2000)
    assert (info.address, info.num_blocks, ttl_ms) == ("10.0.0.1:5", 64, 2000)
    assert [i.pool_id for i, _ in core.list_runners()] == ["a"]
    session, _ = core.open_session("gw", 60_000)
    allocate(core, session, "a", 1, [1, 2, 3], 1)
    clock.advance(1.5)
    register(core, "a")  # renewed: another 2 s from now
    clock.advance(1.5)
    assert core.reap_expired() == 0
    clock.advance(0.6)
    assert core.list_runners() == []  # not live any more, even before the reaper runs
    assert core.reap_expired() == 1
    assert "a" not in core.pools
    with pytest.raises(BlockServiceError) as error:
        core.step(session, "a", 10, 0, [OP_APPEND], [1], [1], [5], [0], [-1])
    assert error.value.code is ErrorCode.NOT_FOUND
    register(core, "a", epoch=2)  # the runner comes back: a fresh, empty pool
    assert core.stats("a").num_sequences == 0


def test_register_new_epoch_empties_pool_and_other_shape_needs_one(
        core: BlockServiceCore) -> None:
    register(core, "a")
    session, _ = core.open_session("gw", 60_000)
    allocate(core, session, "a", 1, PREFIX, 1)
    with pytest.raises(BlockServiceError) as error:
        core.register_runner("a", "a.host:1", 32, BLOCK, 1)
    assert error.value.code is ErrorCode.FAILED_PRECONDITION
    register(core, "a", epoch=2, blocks=32)
    stats = core.stats("a")
    assert (stats.total_blocks, stats.num_sequences, stats.epoch) == (32, 0, 2)
    with pytest.raises(BlockServiceError) as error:
        core.register_runner("a", "", 32, BLOCK, 2)
    assert error.value.code is ErrorCode.INVALID_ARGUMENT


def test_prefix_policy_goes_where_the_prefix_is_cached(core: BlockServiceCore) -> None:
    register(core, "a")
    register(core, "b")
    session, _ = core.open_session("gw", 60_000)
    allocate(core, session, "b", 1, [*PREFIX, 1, 2, 3], 1)
    chosen, candidates = core.route("gw", [*PREFIX, 9, 9, 9, 9, 9])
    assert chosen.pool_id == "b"
    by_pool = {c.pool_id: c for c in candidates}
    assert by_pool["b"].num_cached_tokens == len(PREFIX)
    assert by_pool["a"].num_cached_tokens == 0
    # A tenant's salt sees none of it.
    _, candidates = core.route("gw", [*PREFIX, 9], cache_salt="tenant")
    assert {c.num_cached_tokens for c in candidates} == {0}


def test_prefix_policy_leaves_an_overloaded_holder(core: BlockServiceCore) -> None:
    """The margin: a runner holding the prefix keeps getting it until its load exceeds the
    other's by more than the prompt tokens the cache would save."""
    register(core, "a")
    register(core, "b", blocks=256)
    session, _ = core.open_session("gw", 60_000)
    allocate(core, session, "b", 1, PREFIX, 1)
    prompt = [*PREFIX, 5]
    _, candidates = core.route("gw", prompt)  # b; gw's next Step on b replaces its route
    core.registry.pending.clear()  # this test is about the computed prefix only
    by_pool = {c.pool_id: c for c in candidates}
    margin = by_pool["b"].num_cached_tokens + by_pool["a"].load_tokens - \
        by_pool["b"].load_tokens
    assert margin > 0
    # b's loop reports a queue just under the margin: still b; just over it: a.
    core.step(session, "b", 3, 0, [], [], [], [], [], [], num_waiting_tokens=margin - 1)
    assert core.route("gw", prompt)[0].pool_id == "b"
    core.registry.pending.clear()
    core.step(session, "b", 4, 0, [], [], [], [], [], [], num_waiting_tokens=margin + 1)
    assert core.route("gw", prompt)[0].pool_id == "a"


def test_routes_count_at_once_so_routers_do_not_herd(core: BlockServiceCore) -> None:
    """Two routers placing unrelated requests back to back see each other's choice."""
    register(core, "a")
    register(core, "b")
    first, _ = core.route("gw-1", [1] * 40, policy=POLICY_LEAST_LOADED)
    second, candidates = core.route("gw-2", [2] * 40, policy=POLICY_LEAST_LOADED)
    assert first.pool_id != second.pool_id
    load = {c.pool_id: c.load_tokens for c in candidates}[first.pool_id]
    assert load == 40 + DECODE_WEIGHT_TOKENS
    # gw-1's loop for that pool steps: its report replaces what its route added.
    session, _ = core.open_session("gw-1", 60_000)
    core.step(session, first.pool_id, 1, 0, [], [], [], [], [], [], num_waiting_tokens=3)
    load = {c.pool_id: c.load_tokens for c in core.route("x", [3], pool_ids=["a"])[1]}
    assert load == {"a": 3 if first.pool_id == "a" else 40 + DECODE_WEIGHT_TOKENS}


def test_round_robin_and_least_loaded(core: BlockServiceCore) -> None:
    for pool_id in ("a", "b", "c"):
        register(core, pool_id)
    session, _ = core.open_session("gw", 60_000)
    allocate(core, session, "a", 1, PREFIX, 1)
    picks = [core.route("gw", PREFIX, policy=POLICY_ROUND_ROBIN)[0].pool_id for _ in range(6)]
    assert sorted(picks) == ["a", "a", "b", "b", "c", "c"]
    assert sorted(picks[:3]) == ["a", "b", "c"]  # each pool in turn
    # least-loaded ignores the cache: b and c carry the uncached routes above.
    chosen, candidates = core.route("x", PREFIX, policy=POLICY_LEAST_LOADED)
    assert chosen.load_tokens == min(c.load_tokens for c in candidates)
    assert chosen.pool_id == "a"


def test_route_errors(core: BlockServiceCore) -> None:
    with pytest.raises(BlockServiceError) as error:
        core.route("gw", [1, 2])
    assert error.value.code is ErrorCode.NOT_FOUND
    register(core, "a")
    for bad in ({"token_ids": []}, {"token_ids": [-1]}, {"policy": 9}):
        kwargs = {"token_ids": [1, 2], **bad}
        with pytest.raises(BlockServiceError) as error:
            core.route("gw", kwargs.pop("token_ids"), **kwargs)  # type: ignore[arg-type]
        assert error.value.code is ErrorCode.INVALID_ARGUMENT
    with pytest.raises(BlockServiceError) as error:
        core.route("gw", [1], pool_ids=["b"])
    assert error.value.code is ErrorCode.NOT_FOUND
    assert core.route("gw", [1], policy=POLICY_PREFIX, pool_ids=["a"])[0].pool_id == "a"


def test_registration_survives_a_restart_from_the_journal(
        make_core: Callable[..., BlockServiceCore], tmp_path) -> None:  # type: ignore[no-untyped-def]
    policy = JournalPolicy(snapshot_every_records=3)
    journal, _ = Journal.open(tmp_path, policy)
    core = make_core()
    core.attach_journal(journal)
    register(core, "a")
    register(core, "b", ttl_ms=5000)
    session, _ = core.open_session("gw", 60_000)
    allocate(core, session, "a", 1, PREFIX, 1)
    register(core, "c")
    journal.close()
    journal, recovered = Journal.open(tmp_path, policy)
    again = make_core()
    again.replay(recovered.state, recovered.records)
    assert [(i.pool_id, i.address) for i, _ in again.list_runners()] == [
        ("a", "a.host:1"), ("b", "b.host:1"), ("c", "c.host:1")]
    assert again.registry.lease_ttl_s == {"a": 2.0, "b": 5.0, "c": 2.0}
    assert again.route("gw", [*PREFIX, 1])[0].pool_id == "a"
    journal.close()


def test_a_burst_with_a_new_prefix_follows_the_first_placement(core: BlockServiceCore,
                                                                clock: FakeClock) -> None:
    """Nothing is cached yet: the second request of a burst goes where the first one is
    computing the prefix (its pending prefix), not to the idle runner; an unrelated one
    goes to the idle runner."""
    register(core, "a", ttl_ms=60_000)
    register(core, "b", ttl_ms=60_000)
    first, _ = core.route("gw", [*PREFIX, 1])
    assert core.route("gw", [*PREFIX, 2])[0].pool_id == first.pool_id
    assert core.route("gw", [9] * 40)[0].pool_id != first.pool_id
    clock.advance(11)  # pending prefixes are forgotten; nothing was computed
    _, candidates = core.route("gw", [*PREFIX, 3], policy=POLICY_PREFIX)
    assert {c.num_cached_tokens for c in candidates} == {0}


def test_each_request_on_a_pending_prefix_adds_its_own_work(core: BlockServiceCore) -> None:
    """A request joining a pending prefix adds its uncached tokens and its output's weight to
    the pool's load: the pool never looks lighter for taking one more request."""
    register(core, "a", ttl_ms=60_000)
    register(core, "b", ttl_ms=60_000)
    long_prefix = list(range(1000, 1256))  # 64 blocks: every request below stays with it
    first, _ = core.route("gw", [*long_prefix, 1])
    loads = []
    for suffix in range(2, 6):
        chosen, candidates = core.route("gw", [*long_prefix, suffix])
        assert chosen.pool_id == first.pool_id
        loads.append({c.pool_id: c.load_tokens for c in candidates}[first.pool_id])
    assert [after - before for before, after in pairwise(loads)] == [
        1 + DECODE_WEIGHT_TOKENS] * 3


def test_unregister_drops_the_pool_now_and_only_at_its_epoch(core: BlockServiceCore) -> None:
    register(core, "a", epoch=3, ttl_ms=60_000)
    with pytest.raises(BlockServiceError) as error:
        core.unregister_runner("a", 2)  # an older process of the runner: the newer stays
    assert error.value.code is ErrorCode.FAILED_PRECONDITION
    core.unregister_runner("a", 3)
    assert core.list_runners() == [] and "a" not in core.pools
    with pytest.raises(BlockServiceError) as error:
        core.unregister_runner("a", 3)
    assert error.value.code is ErrorCode.NOT_FOUND
