"""Property tests: random interleavings of every operation over small pools.

The machine plays the runner too: it writes, for every slot the service hands out, the KV
"content" that position would get — (cache salt, the sequence's tokens up to and including that
position) — and applies the copy-on-write copies first. That is an oracle independent of the
service's bookkeeping: after every operation each live sequence must read back exactly its own
prefix through its block table, and every published hash must name a block whose content is the
prefix that hash was computed from. APPENDs may reserve the next position (num_lookahead_slots):
the runner writes a reserved slot only once the sequence's next APPEND has filled in its token.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from block_service.core import BlockServiceCore
from block_service.hashing import block_hash, root_hash
from block_service.ops import (
    OP_ALLOCATE,
    OP_APPEND,
    OP_COMMIT,
    OP_FORK,
    OP_FREE,
    STATUS_INVALID_ARGUMENT,
    STATUS_NO_SPACE,
    STATUS_OK,
    STATUS_STALE,
    StepResult,
)
from block_service.sequence import RESERVED
from block_service.sessions import LeasePolicy

from .conftest import FakeClock
from .invariants import check_invariants

POOL = "pool"
TTL_S = 10.0
# Few symbols: many shared prefixes.
tokens_st = st.lists(st.integers(0, 2), min_size=1, max_size=10)
salts_st = st.sampled_from(["", "", "", "tenant"])
# Mostly all that is written (prefix hits need it), sometimes a part.
computed_st = st.one_of(st.just(1.0), st.floats(0, 1))
# Rules that wipe state fire on a fifth of their draws, so that state builds up in between.
rarely = st.integers(0, 4).map(lambda draw: draw == 0)
# num_lookahead_slots of an APPEND: mostly 0 or 1, sometimes a refused value.
lookahead_st = st.sampled_from([0, 0, 1, 1, 1, 2])


@dataclass
class ModelSeq:
    """What the machine knows of a sequence."""

    tokens: list[int]
    salt: str
    computed: int = 0  # what the service was told
    written: int = 0  # positions whose KV the (modelled) runner has written
    reserved_slot: int = -1  # the slot handed out for a reserved last position

    def reserved(self) -> bool:
        return self.tokens[-1] == RESERVED

    def num_known(self) -> int:
        return len(self.tokens) - self.reserved()


@dataclass
class ModelSession:
    session_id: str
    step_id: int = 0
    seqs: dict[int, ModelSeq] = field(default_factory=dict)
    stale: set[int] = field(default_factory=set)


class BlockServiceMachine(RuleBasedStateMachine):
    """Drives BlockServiceCore.step with random operations and checks it after each."""

    def __init__(self) -> None:
        super().__init__()
        self.clock = FakeClock()
        self.core = BlockServiceCore(LeasePolicy(TTL_S, 1.0, TTL_S), clock=self.clock)
        self.sessions: list[ModelSession] = []
        self.kv: dict[int, tuple[str, tuple[int, ...]]] = {}  # slot -> (salt, prefix)
        self.next_seq_id = 1
        self.earlier: list[tuple[list[int], str]] = []  # recent prompts (and sequences)
        self.epoch = 1
        self.num_blocks = 0
        self.block_size = 0

    # ---- set-up and helpers ----------------------------------------------------------------
    @initialize(num_blocks=st.integers(2, 24), block_size=st.sampled_from([1, 2, 4]))
    def create(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks, self.block_size = num_blocks, block_size
        self.core.create_pool(POOL, num_blocks, block_size, self.epoch)
        self.sessions = [self.open_session(), self.open_session()]

    def open_session(self) -> ModelSession:
        return ModelSession(self.core.open_session("machine", 0)[0])

    def step(self, session: ModelSession, ops: list[tuple[int, int, list[int], int, int]],
             salts: dict[int, str] | None = None,
             lookaheads: list[int] | None = None) -> StepResult:
        session.step_id += 1
        return self.core.step(
            session.session_id, POOL, session.step_id, self.epoch, [op[0] for op in ops],
            [op[1] for op in ops], [len(op[2]) for op in ops], [t for op in ops for t in op[2]],
            [op[3] for op in ops], [op[4] for op in ops], salts, lookaheads or [])

    def table(self, session: ModelSession, seq_id: int) -> list[int]:
        return self.core.pools[POOL].seqs[session.session_id][seq_id].block_table

    def write(self, seq: ModelSeq, start: int, slots: list[int], count: int) -> None:
        """The runner computes the first `count` of positions start.. of `seq` into `slots`
        (a prefill chunk; the rest stays pending), if everything before them is written. A
        reserved position is not: its token is not known yet."""
        assert len(slots) == len(seq.tokens) - start
        if seq.written != start:
            return
        count = min(count, seq.num_known() - start)
        for offset, slot in enumerate(slots[:count]):
            self.kv[slot] = (seq.salt, tuple(seq.tokens[:start + offset + 1]))
        seq.written = start + max(0, count)

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        size = self.block_size
        for src, dst in copies:
            for offset in range(size):
                if src * size + offset in self.kv:
                    self.kv[dst * size + offset] = self.kv[src * size + offset]

    def live(self) -> list[tuple[ModelSession, int]]:
        return [(s, seq_id) for s in self.sessions for seq_id in sorted(s.seqs)]

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- rules -------------------------------------------------------------------------------
    @rule(which=st.integers(0, 1), tokens=tokens_st, salt=salts_st,
          reuse=st.sampled_from([None, 0, 1, 2, 3]), twin=st.sampled_from([None, [], [1], [2, 0]]),
          chunk=st.sampled_from([1.0, 1.0, 0.5, 0.0]))
    def allocate(self, which: int, tokens: list[int], salt: str, reuse: int | None,
                 twin: list[int] | None, chunk: float) -> None:
        """Allocates a prompt (maybe extending an earlier one), maybe with a twin in one step.

        The runner computes a step's tokens only after the step, so a prefix hit must point at
        KV that was written before this step: checked before the step's writes are done.
        """
        session = self.sessions[which]
        if reuse is not None and self.earlier:  # an earlier prompt plus the drawn tokens
            donor_tokens, salt = self.earlier[-1 - reuse % len(self.earlier)]
            tokens = [t for t in donor_tokens if t != RESERVED] + tokens[:reuse]
        prompts = [tokens] if twin is None else [tokens, tokens + twin]
        seq_ids = list(range(self.next_seq_id, self.next_seq_id + len(prompts)))
        self.next_seq_id += len(prompts)
        ops = [(OP_ALLOCATE, seq_id, prompt, 0, -1)
               for seq_id, prompt in zip(seq_ids, prompts, strict=True)]
        result = self.step(session, ops, dict.fromkeys(range(len(ops)), salt) if salt else None)
        writes = []
        slot_start = block_start = 0
        for index, (seq_id, prompt) in enumerate(zip(seq_ids, prompts, strict=True)):
            slots = result.slot_mapping[slot_start:slot_start + result.slot_counts[index]]
            table = result.table_block_ids[block_start:block_start + result.table_counts[index]]
            slot_start += result.slot_counts[index]
            block_start += result.table_counts[index]
            status = result.op_statuses[index]
            if self.blocks_needed(len(prompt)) > self.num_blocks:
                assert status == STATUS_INVALID_ARGUMENT
                continue
            if status == STATUS_NO_SPACE:
                continue
            assert status == STATUS_OK, result.errors
            cached = result.num_cached_tokens[index]
            assert cached % self.block_size == 0 and cached < len(prompt)
            assert result.table_starts[index] == 0
            assert table == self.table(session, seq_id)
            seq = ModelSeq(list(prompt), salt, cached, cached)
            # The list is the live model sequence's: later prompts reuse what it appends too.
            self.earlier = [*self.earlier[-7:], (seq.tokens, salt)]
            self.check_reads(seq, table, cached)
            session.seqs[seq_id] = seq
            writes.append((seq, cached, slots))
        for seq, cached, slots in writes:
            self.write(seq, cached, slots, round(chunk * len(slots)))

    def check_reads(self, seq: ModelSeq, table: list[int], end: int) -> None:
        """Positions 0 .. end-1 of `seq` read back its own prefix through `table`."""
        size = self.block_size
        for position in range(end):
            slot = table[position // size] * size + position % size
            assert self.kv.get(slot) == (seq.salt, tuple(seq.tokens[:position + 1])), position

    @precondition(lambda self: self.live())
    @rule(pick=st.integers(0, 10**6), tokens=st.lists(st.integers(0, 2), min_size=1, max_size=5),
          computed=computed_st, lookahead=lookahead_st, reserve_only=rarely)
    def append(self, pick: int, tokens: list[int], computed: float, lookahead: int,
               reserve_only: bool) -> None:
        session, seq_id = self.live()[pick % len(self.live())]
        seq = session.seqs[seq_id]
        num_computed = int(computed * seq.written)
        if reserve_only:
            tokens = []
        result = self.step(session, [(OP_APPEND, seq_id, tokens, 0, num_computed)],
                           lookaheads=[lookahead])
        self.copy_blocks(result.copies)
        self.after_append(session, seq_id, tokens, num_computed, result, 0, lookahead)

    def after_append(self, session: ModelSession, seq_id: int, tokens: list[int],
                     num_computed: int, result: StepResult, index: int,
                     lookahead: int = 0) -> None:
        seq = session.seqs[seq_id]
        status = result.op_statuses[index]
        filling = seq.reserved() and bool(tokens)
        new_len = len(seq.tokens) - filling + len(tokens) + lookahead
        if (lookahead not in (0, 1) or (not tokens and (not lookahead or seq.reserved()))
                or self.blocks_needed(new_len) > self.num_blocks):
            assert status == STATUS_INVALID_ARGUMENT
            return
        if status == STATUS_NO_SPACE:
            return
        assert status == STATUS_OK, result.errors
        start = len(seq.tokens)
        slot_start = sum(result.slot_counts[:index])
        slots = result.slot_mapping[slot_start:slot_start + result.slot_counts[index]]
        assert len(slots) == new_len - start
        if filling:  # its slot came with the reservation
            seq.tokens[-1] = tokens[0]
            start, slots = start - 1, [seq.reserved_slot, *slots]
        seq.tokens.extend(tokens[filling:])
        seq.tokens.extend([RESERVED] * lookahead)
        if lookahead:
            seq.reserved_slot = slots[-1]
        seq.computed = max(seq.computed, num_computed)
        self.write(seq, start, slots, len(slots))

    @rule(which=st.integers(0, 1), tokens=st.lists(st.integers(0, 2), min_size=8, max_size=8),
          lookaheads=st.lists(st.sampled_from([0, 1, 1]), min_size=8, max_size=8))
    def decode_all(self, which: int, tokens: list[int], lookaheads: list[int]) -> None:
        """One token for every sequence of a session in one step (Step's inline path: plain,
        or filling a reserved position and reserving the next)."""
        session = self.sessions[which]
        seq_ids = sorted(session.seqs)
        if not seq_ids:
            return
        ops = [(OP_APPEND, seq_id, [tokens[index % 8]], 0, session.seqs[seq_id].written)
               for index, seq_id in enumerate(seq_ids)]
        column = [lookaheads[index % 8] for index in range(len(ops))]
        result = self.step(session, ops, lookaheads=column)
        self.copy_blocks(result.copies)
        for index, (_, seq_id, new, _, computed) in enumerate(ops):
            self.after_append(session, seq_id, new, computed, result, index, column[index])

    @precondition(lambda self: self.live())
    @rule(pick=st.integers(0, 10**6), computed=computed_st)
    def commit(self, pick: int, computed: float) -> None:
        session, seq_id = self.live()[pick % len(self.live())]
        seq = session.seqs[seq_id]
        num_computed = int(computed * seq.written)
        result = self.step(session, [(OP_COMMIT, seq_id, [], 0, num_computed)])
        assert result.op_statuses == [STATUS_OK], result.errors
        seq.computed = max(seq.computed, num_computed)

    def fully_written(self) -> list[tuple[ModelSession, int]]:
        return [(s, seq_id) for s, seq_id in self.live()
                if s.seqs[seq_id].written == len(s.seqs[seq_id].tokens)]

    def pending(self) -> list[tuple[ModelSession, int]]:
        return [(s, seq_id) for s, seq_id in self.live()
                if s.seqs[seq_id].written < s.seqs[seq_id].num_known()]

    def reserved(self) -> list[tuple[ModelSession, int]]:
        return [(s, seq_id) for s, seq_id in self.live() if s.seqs[seq_id].reserved()]

    @precondition(lambda self: self.pending())
    @rule(pick=st.integers(0, 10**6), count=st.integers(1, 8))
    def compute(self, pick: int, count: int) -> None:
        """The runner computes the next prefill chunk of a sequence (no service call)."""
        session, seq_id = self.pending()[pick % len(self.pending())]
        seq = session.seqs[seq_id]
        table, size = self.table(session, seq_id), self.block_size
        end = min(len(seq.tokens), seq.written + count)
        slots = [table[p // size] * size + p % size for p in range(seq.written, len(seq.tokens))]
        self.write(seq, seq.written, slots, end - seq.written)

    @precondition(lambda self: self.fully_written())
    @rule(pick=st.integers(0, 10**6))
    def fork(self, pick: int) -> None:
        """Forks a sequence whose prefill is done (as the gateway does for n > 1)."""
        session, parent_id = self.fully_written()[pick % len(self.fully_written())]
        child_id = self.next_seq_id
        self.next_seq_id += 1
        result = self.step(session, [(OP_FORK, child_id, [], parent_id, -1)])
        assert result.op_statuses == [STATUS_OK], result.errors
        parent = session.seqs[parent_id]
        session.seqs[child_id] = ModelSeq(list(parent.tokens), parent.salt, parent.computed,
                                          parent.written)
        assert result.table_block_ids == self.table(session, parent_id)

    @precondition(lambda self: self.reserved())
    @rule(pick=st.integers(0, 10**6), kind=st.sampled_from([OP_COMMIT, OP_FREE, OP_FORK]))
    def count_a_reserved_position(self, pick: int, kind: int) -> None:
        """COMMIT or FREE counting a reserved position as computed, or a FORK of a reserved
        sequence: refused, nothing changes (the invariants compare with the model)."""
        session, seq_id = self.reserved()[pick % len(self.reserved())]
        seq = session.seqs[seq_id]
        op: tuple[int, int, list[int], int, int] = (
            (kind, self.next_seq_id, [], seq_id, -1) if kind == OP_FORK
            else (kind, seq_id, [], 0, len(seq.tokens)))
        result = self.step(session, [op])
        assert result.op_statuses == [STATUS_INVALID_ARGUMENT], result.errors

    @precondition(lambda self: self.live())
    @rule(pick=st.integers(0, 10**6), computed=computed_st)
    def free(self, pick: int, computed: float) -> None:
        session, seq_id = self.live()[pick % len(self.live())]
        num_computed = int(computed * session.seqs[seq_id].written)
        result = self.step(session, [(OP_FREE, seq_id, [], 0, num_computed)])
        assert result.op_statuses == [STATUS_OK], result.errors
        del session.seqs[seq_id]

    @rule(which=st.integers(0, 1), rare=rarely)
    def lease_expires(self, which: int, rare: bool) -> None:
        """Session `which` stops renewing; the other keeps its lease alive."""
        if not rare:
            return
        other = self.sessions[1 - which]
        self.core.keep_alive(other.session_id)
        self.clock.advance(TTL_S * 0.6)
        self.core.keep_alive(other.session_id)
        self.clock.advance(TTL_S * 0.6)
        assert self.core.reap_expired() == 1
        self.sessions[which] = self.open_session()

    @rule(reshape=st.booleans(), rare=rarely)
    def epoch_change(self, reshape: bool, rare: bool) -> None:
        if not rare:
            return
        self.epoch += 1
        if reshape:
            self.num_blocks = max(1, self.num_blocks // 2)
        self.core.create_pool(POOL, self.num_blocks, self.block_size, self.epoch)
        self.kv.clear()
        for session in self.sessions:
            session.stale |= set(session.seqs)
            session.seqs.clear()

    @precondition(lambda self: any(s.stale for s in self.sessions))
    @rule(data=st.data())
    def touch_stale(self, data: st.DataObject) -> None:
        session = data.draw(st.sampled_from([s for s in self.sessions if s.stale]))
        seq_id = data.draw(st.sampled_from(sorted(session.stale)))
        kind = data.draw(st.sampled_from([OP_APPEND, OP_FREE, OP_COMMIT]))
        result = self.step(session, [(kind, seq_id, [1] if kind == OP_APPEND else [], 0, -1)])
        assert result.op_statuses == [STATUS_STALE]
        session.stale.discard(seq_id)

    # ---- invariants --------------------------------------------------------------------------
    @invariant()
    def blocks_are_free_xor_referenced(self) -> None:
        """The model-free invariants (shared with the fuzz and journal tests); the hashes are
        checked against the modelled KV by every_hash_names_its_prefix."""
        if not self.num_blocks:
            return
        check_invariants(self.core, check_hashes=False)
        assert self.core.stats(POOL).total_blocks == self.num_blocks

    @invariant()
    def sequences_match_the_model(self) -> None:
        if not self.num_blocks:
            return
        pm = self.core.pools[POOL]
        live = {(s.session_id, seq_id): seq
                for s in self.sessions for seq_id, seq in s.seqs.items()}
        core_live = {(sid, seq_id): seq for sid, seqs in pm.seqs.items()
                     for seq_id, seq in seqs.items()}
        assert set(live) == set(core_live)
        for key, model in live.items():
            seq = core_live[key]
            assert seq.tokens == model.tokens
            assert seq.num_computed == model.computed
            assert len(seq.block_table) == self.blocks_needed(len(model.tokens))

    @invariant()
    def every_sequence_reads_its_own_prefix(self) -> None:
        """Through its block table, each live sequence finds its own KV at every position."""
        for session in self.sessions:
            for seq_id, seq in session.seqs.items():
                self.check_reads(seq, self.table(session, seq_id), seq.written)

    @invariant()
    def every_hash_names_its_prefix(self) -> None:
        if not self.num_blocks:
            return
        pool = self.core.pools[POOL].pool
        size = self.block_size
        for digest, block in pool.hash_to_block.items():
            cached = pool.cached_block(block)
            assert cached is not None and cached.block_hash == digest
            salt, prefix = self.kv[block * size + size - 1]
            assert len(prefix) % size == 0
            assert cached.token_ids == prefix[-size:]
            parent = root_hash(salt)
            for start in range(0, len(prefix), size):
                parent = block_hash(parent, prefix[start:start + size])
            assert parent == digest
        for block in pool.free_block_ids():
            assert pool.is_evictable(block) == (pool.cached_block(block) is not None)

    def teardown(self) -> None:
        """After everything is freed, nothing is referenced."""
        if not self.num_blocks:
            return
        for session in self.sessions:
            for seq_id in sorted(session.seqs):
                self.core.free(session.session_id, POOL, seq_id)
        stats = self.core.stats(POOL)
        assert stats.used_blocks == 0 and stats.total_refs == 0
        assert stats.free_blocks == stats.total_blocks
        assert stats.num_sequences == 0


BlockServiceMachine.TestCase.settings = settings(
    max_examples=1000, stateful_step_count=30, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
TestBlockService = BlockServiceMachine.TestCase
