"""The scheduling policy, driven directly with hand-made block-service results."""

from __future__ import annotations

from gateway.scheduler import OpOutcome, OpResult, Scheduler, StepPlan
from gateway.sequence import SeqStatus, Sequence
from gateway.step_builder import build_step_request

BLOCK = 4


def make_seq(request_id: str, prompt_len: int, index: int = 0) -> Sequence:
    prompt = list(range(100, 100 + prompt_len))
    return Sequence(request_id, index, prompt, prompt_len, seed=1)


def ok_results(plan: StepPlan, cached: int = 0) -> list[OpResult]:
    """What a block service with unlimited space answers (tables of made-up block ids)."""
    results = [OpResult(OpOutcome.OK) for _ in plan.frees]
    results += [OpResult(OpOutcome.OK) for _ in plan.commits]
    for parent, _child in plan.forks:
        results.append(OpResult(OpOutcome.OK, 0, list(parent.block_table)))
    for grant in plan.appends:
        seq = grant.seq
        new = seq.token_ids[seq.num_registered:]
        first = seq.num_registered
        slots = [1000 + p for p in range(first, first + len(new))]
        results.append(OpResult(OpOutcome.OK, len(seq.block_table), [], slots))
    for grant in plan.allocates:
        seq = grant.seq
        blocks = list(range((seq.alloc_len + BLOCK - 1) // BLOCK))
        slots = list(range(cached, seq.alloc_len))
        results.append(OpResult(OpOutcome.OK, 0, blocks, slots, num_cached_tokens=cached))
    return results


def run_step(scheduler: Scheduler, plan: StepPlan, results: list[OpResult] | None = None):
    outcome = scheduler.apply_results(plan, results if results is not None else ok_results(plan))
    scheduler.on_executed(outcome.work)
    for item in outcome.work:
        if item.do_sample:
            item.seq.token_ids.append(7)
    return outcome


def test_fcfs_admission_under_token_budget_chunks_the_prompt_that_does_not_fit() -> None:
    scheduler = Scheduler(max_num_batched_tokens=10, max_num_seqs=8)
    a, b, c = make_seq("a", 6), make_seq("b", 7), make_seq("c", 3)
    scheduler.add([a, b, c])
    plan = scheduler.schedule()
    # a takes 6, b gets the remaining 4 as its first chunk, c waits (budget spent).
    assert [(g.seq, g.num_tokens) for g in plan.allocates] == [(a, 6), (b, 4)]
    assert list(scheduler.waiting) == [c]
    outcome = run_step(scheduler, plan)
    assert [(w.seq, w.start, w.num_tokens, w.do_sample) for w in outcome.work] == [
        (a, 0, 6, True), (b, 0, 4, False)]
    # Next: a decodes (1), b commits its first chunk and prefills its last 3, c is admitted.
    plan = scheduler.schedule()
    assert [(g.seq, g.num_tokens) for g in plan.appends] == [(a, 1)]
    assert plan.commits == [b]
    assert [(g.seq, g.num_tokens) for g in plan.prefills] == [(b, 3)]
    assert [(g.seq, g.num_tokens) for g in plan.allocates] == [(c, 3)]
    assert plan.num_scheduled_tokens == 7
    outcome = run_step(scheduler, plan)
    assert [(w.seq, w.start, w.num_tokens, w.do_sample) for w in outcome.work] == [
        (a, 6, 1, True), (b, 4, 3, True), (c, 0, 3, True)]


def test_decodes_come_before_prefill_and_admission() -> None:
    scheduler = Scheduler(max_num_batched_tokens=3, max_num_seqs=8)
    a, b = make_seq("a", 2), make_seq("b", 2)
    scheduler.add([a, b])
    run_step(scheduler, scheduler.schedule())  # both admitted: 2 + 1 tokens
    assert b.is_prefilling and a.is_decode_ready
    plan = scheduler.schedule()
    assert [g.seq for g in plan.appends] == [a]
    assert [(g.seq, g.num_tokens) for g in plan.prefills] == [(b, 1)]


def test_max_num_seqs_limits_admission_and_keeps_fcfs_order() -> None:
    scheduler = Scheduler(max_num_batched_tokens=100, max_num_seqs=2)
    seqs = [make_seq(str(i), 3) for i in range(4)]
    scheduler.add(seqs)
    plan = scheduler.schedule()
    assert [g.seq for g in plan.allocates] == seqs[:2]
    run_step(scheduler, plan)
    scheduler.finish(seqs[0])
    plan = scheduler.schedule()
    assert [g.seq for g in plan.allocates] == [seqs[2]]
    assert [f.block_seq_id for f in plan.frees] == [seqs[0].block_seq_id]


def test_cached_prefix_is_skipped() -> None:
    scheduler = Scheduler(max_num_batched_tokens=100, max_num_seqs=4)
    a = make_seq("a", 10)
    scheduler.add([a])
    plan = scheduler.schedule()
    outcome = run_step(scheduler, plan, ok_results(plan, cached=8))
    assert [(w.start, w.num_tokens, w.slots) for w in outcome.work] == [(8, 2, [8, 9])]
    assert outcome.newly_cached == [(a, 8)]


def test_no_space_for_a_decode_preempts_the_most_recently_admitted() -> None:
    scheduler = Scheduler(max_num_batched_tokens=100, max_num_seqs=4)
    a, b, c = make_seq("a", 3), make_seq("b", 3), make_seq("c", 3)
    scheduler.add([a, b, c])
    run_step(scheduler, scheduler.schedule())
    plan = scheduler.schedule()
    assert [g.seq for g in plan.appends] == [a, b, c]
    results = ok_results(plan)
    results[0] = OpResult(OpOutcome.NO_SPACE)  # a finds no block
    outcome = run_step(scheduler, plan, results)
    assert outcome.preempted == [c]
    assert [w.seq for w in outcome.work] == [b]  # a retries next step, c is recomputed later
    assert list(scheduler.waiting) == [c] and c.status is SeqStatus.WAITING
    assert c.num_computed == 0 and c.block_table == [] and c.num_tokens == 4
    plan = scheduler.schedule()
    # c's blocks are freed first; no admission right after a preemption.
    assert len(plan.frees) == 1 and plan.frees[0].num_computed == 3
    assert [g.seq for g in plan.appends] == [a, b] and plan.allocates == []
    run_step(scheduler, plan)
    plan = scheduler.schedule()
    # Recompute: c allocates its prompt AND its generated token, and samples after them.
    assert [(g.seq, g.num_tokens) for g in plan.allocates] == [(c, 4)]
    outcome = run_step(scheduler, plan)
    work = next(w for w in outcome.work if w.seq is c)
    assert (work.start, work.num_tokens, work.do_sample) == (0, 4, True)


def test_a_lone_sequence_without_space_preempts_itself() -> None:
    scheduler = Scheduler(max_num_batched_tokens=100, max_num_seqs=4)
    a = make_seq("a", 3)
    scheduler.add([a])
    run_step(scheduler, scheduler.schedule())
    plan = scheduler.schedule()
    outcome = run_step(scheduler, plan, [OpResult(OpOutcome.NO_SPACE)])
    assert outcome.preempted == [a] and outcome.work == []


def test_allocation_without_space_goes_back_to_the_front_in_order() -> None:
    scheduler = Scheduler(max_num_batched_tokens=100, max_num_seqs=4)
    a, b, c = make_seq("a", 3), make_seq("b", 3), make_seq("c", 3)
    scheduler.add([a, b, c])
    plan = scheduler.schedule()
    results = [OpResult(OpOutcome.NO_SPACE)] * 3
    outcome = run_step(scheduler, plan, results)
    assert outcome.work == [] and list(scheduler.waiting) == [a, b, c]
    assert all(s.block_seq_id == 0 for s in (a, b, c))


def test_fork_parent_prefills_all_but_the_last_token_then_forks_and_appends_it() -> None:
    scheduler = Scheduler(max_num_batched_tokens=100, max_num_seqs=8)
    parent, c1, c2 = make_seq("r", 6, 0), make_seq("r", 6, 1), make_seq("r", 6, 2)
    parent.pending_children = [c1, c2]
    scheduler.add([parent])
    plan = scheduler.schedule()
    assert [(g.seq, g.num_tokens) for g in plan.allocates] == [(parent, 5)]
    outcome = run_step(scheduler, plan)
    assert [(w.start, w.num_tokens, w.do_sample) for w in outcome.work] == [(0, 5, False)]
    plan = scheduler.schedule()
    assert plan.forks == [(parent, c1), (parent, c2)]
    assert [g.seq for g in plan.appends] == [parent, c1, c2]
    outcome = run_step(scheduler, plan)
    assert [(w.seq, w.start, w.num_tokens, w.do_sample) for w in outcome.work] == [
        (parent, 5, 1, True), (c1, 5, 1, True), (c2, 5, 1, True)]
    assert scheduler.running == [parent, c1, c2] and parent.pending_children == []


def test_a_forked_child_readmitted_reports_no_cache_hit_of_its_own() -> None:
    # The cache hit a request reports is its prompt's at admission; a fork child is admitted
    # with its parent, so when it is admitted again (recompute) its own tokens found cached
    # are no prompt cache hit.
    scheduler = Scheduler(max_num_batched_tokens=100, max_num_seqs=8)
    parent, child = make_seq("r", 6, 0), make_seq("r", 6, 1)
    parent.pending_children = [child]
    scheduler.add([parent])
    assert run_step(scheduler, scheduler.schedule()).newly_cached == [(parent, 0)]
    run_step(scheduler, scheduler.schedule())  # the fork
    run_step(scheduler, scheduler.schedule())  # a decode: both have generated tokens
    scheduler.reset_all()
    plan = scheduler.schedule()
    assert [g.seq for g in plan.allocates] == [parent, child]
    assert run_step(scheduler, plan, ok_results(plan, cached=8)).newly_cached == []


def test_seats_count_children_still_to_fork() -> None:
    scheduler = Scheduler(max_num_batched_tokens=100, max_num_seqs=3)
    parent = make_seq("r", 4)
    parent.pending_children = [make_seq("r", 4, 1), make_seq("r", 4, 2)]
    other = make_seq("o", 4)
    scheduler.add([parent, other])
    plan = scheduler.schedule()
    assert [g.seq for g in plan.allocates] == [parent]


def test_abort_frees_running_and_drops_waiting() -> None:
    scheduler = Scheduler(max_num_batched_tokens=100, max_num_seqs=1)
    a, b = make_seq("a", 3), make_seq("b", 3)
    scheduler.add([a, b])
    run_step(scheduler, scheduler.schedule())
    scheduler.finish(a)
    scheduler.finish(b)
    plan = scheduler.schedule()
    assert [(f.block_seq_id, f.num_computed) for f in plan.frees] == [(a.block_seq_id, 3)]
    assert plan.allocates == [] and not scheduler.waiting and not scheduler.running
    assert scheduler.schedule().is_empty


def test_stale_pool_requeues_everything_for_recompute() -> None:
    scheduler = Scheduler(max_num_batched_tokens=100, max_num_seqs=4)
    a, b = make_seq("a", 3), make_seq("b", 3)
    scheduler.add([a, b])
    run_step(scheduler, scheduler.schedule())
    plan = scheduler.schedule()
    outcome = scheduler.apply_results(plan, [OpResult(OpOutcome.STALE)] * plan.num_ops)
    assert outcome.stale
    scheduler.reset_all()
    assert list(scheduler.waiting) == [a, b]
    plan = scheduler.schedule()
    assert plan.frees == [] and [(g.seq, g.num_tokens) for g in plan.allocates] == [(a, 4), (b, 4)]


def test_an_abandoned_step_puts_admissions_back_in_order() -> None:
    scheduler = Scheduler(max_num_batched_tokens=100, max_num_seqs=8)
    a, b, c = make_seq("a", 3), make_seq("b", 3), make_seq("c", 3)
    scheduler.add([a, b, c])
    plan = scheduler.schedule()
    scheduler.abandon(plan)
    assert list(scheduler.waiting) == [a, b, c] and all(s.block_seq_id == 0 for s in (a, b, c))
    scheduler.finish(b)
    assert list(scheduler.waiting) == [a, c]


def decode_results(plan: StepPlan) -> list[OpResult]:
    """OK for a plan of decodes only: one slot per append (its one new position)."""
    return [OpResult(OpOutcome.OK, len(g.seq.block_table), [], [5000 + g.seq.num_scheduled])
            for g in plan.appends]


def test_a_decode_planned_while_its_token_is_sampled_reserves_the_position() -> None:
    scheduler = Scheduler(max_num_batched_tokens=100, max_num_seqs=4)
    a = make_seq("a", 5)
    scheduler.add([a])
    plan = scheduler.schedule()
    prefill = scheduler.apply_results(plan, ok_results(plan)).work  # in flight: samples 5
    # Step 2 is planned before the prefill's sample is in: it only reserves position 5.
    plan = scheduler.schedule()
    assert [(g.seq, g.register_end, g.lookahead) for g in plan.appends] == [(a, 5, 1)]
    request = build_step_request(plan, "s", "p", 2, 1, {})
    assert list(request.token_ids) == [] and list(request.num_lookahead_slots) == [1]
    assert list(request.num_computed_tokens) == [0]  # the prefill is not confirmed yet
    decode = scheduler.apply_results(plan, decode_results(plan)).work
    assert [(w.seq, w.start, w.num_tokens, w.slots) for w in decode] == [(a, 5, 1, [5005])]
    assert (a.num_registered, a.reserved, a.num_scheduled) == (5, True, 6)
    # The prefill returns with token 7 at position 5; step 3 fills it in and reserves 6.
    scheduler.on_executed(prefill)
    a.token_ids.append(7)
    plan = scheduler.schedule()
    request = build_step_request(plan, "s", "p", 3, 1, {})
    assert list(request.token_ids) == [7] and list(request.num_lookahead_slots) == [1]
    assert list(request.num_computed_tokens) == [5]


def test_a_decode_whose_token_is_known_appends_it_without_a_reservation() -> None:
    scheduler = Scheduler(max_num_batched_tokens=100, max_num_seqs=4)
    a = make_seq("a", 5)
    scheduler.add([a])
    run_step(scheduler, scheduler.schedule())  # one step at a time: the sample is in
    plan = scheduler.schedule()
    request = build_step_request(plan, "s", "p", 2, 1, {})
    assert list(request.token_ids) == [7] and list(request.num_lookahead_slots) == []
    assert list(request.num_computed_tokens) == [5]


def test_a_sequence_that_finishes_while_the_next_step_is_planned_frees_what_it_holds() -> None:
    scheduler = Scheduler(max_num_batched_tokens=100, max_num_seqs=4)
    a = make_seq("a", 5)
    scheduler.add([a])
    plan = scheduler.schedule()
    prefill = scheduler.apply_results(plan, ok_results(plan)).work
    plan = scheduler.schedule()
    scheduler.apply_results(plan, decode_results(plan))  # position 5 reserved
    scheduler.on_executed(prefill)
    a.token_ids.append(2)  # the prefill sampled EOS: the decode planned for it never runs
    scheduler.finish(a)
    plan = scheduler.schedule()
    # Its computed prompt is reported; the reserved position is not (its value is unknown).
    assert [(f.block_seq_id, f.num_computed) for f in plan.frees] == [(a.block_seq_id, 5)]
    assert plan.appends == [] and not scheduler.running


def test_results_of_work_whose_sequence_was_preempted_meanwhile_are_ignored() -> None:
    scheduler = Scheduler(max_num_batched_tokens=100, max_num_seqs=4)
    a, b = make_seq("a", 3), make_seq("b", 3)
    scheduler.add([a, b])
    plan = scheduler.schedule()
    in_flight = scheduler.apply_results(plan, ok_results(plan)).work
    plan = scheduler.schedule()
    results = decode_results(plan)
    results[0] = OpResult(OpOutcome.NO_SPACE)  # a finds no block: b (newest) is preempted
    outcome = scheduler.apply_results(plan, results)
    assert outcome.preempted == [b] and b.status is SeqStatus.WAITING
    scheduler.on_executed(in_flight)
    # b's allocation is gone: the prefill that ran for it counts for nothing.
    assert (b.num_computed, b.num_scheduled, b.num_pending) == (0, 0, 0)
    assert (a.num_computed, a.num_pending) == (3, 0)


def test_preemption_stops_once_the_victims_blocks_cover_the_decodes_without_space() -> None:
    scheduler = Scheduler(max_num_batched_tokens=100, max_num_seqs=4)
    seqs = [make_seq(str(i), 8) for i in range(4)]  # 2 blocks of 4 each
    scheduler.add(seqs)
    run_step(scheduler, scheduler.schedule())
    plan = scheduler.schedule()
    # Every decode crosses into a new block and none is free: the newest goes (2 blocks, and
    # its own need with it), then the next newest (2 more); the oldest two retry.
    outcome = run_step(scheduler, plan, [OpResult(OpOutcome.NO_SPACE)] * 4)
    assert set(outcome.preempted) == {seqs[2], seqs[3]}
    assert scheduler.running == seqs[:2] and outcome.work == []
    plan = scheduler.schedule()
    assert [g.seq for g in plan.appends] == seqs[:2] and len(plan.frees) == 2


def test_a_prompt_waits_while_a_prompt_it_starts_like_computes_its_first_block() -> None:
    scheduler = Scheduler(max_num_batched_tokens=100, max_num_seqs=8, block_size=BLOCK)
    a, b = make_seq("a", 10), make_seq("b", 12)  # the same first 10 tokens
    scheduler.add([a, b])
    plan = scheduler.schedule()
    # b would compute a's first block again: it waits (FCFS: so does everyone behind it).
    assert [g.seq for g in plan.allocates] == [a]
    in_flight = scheduler.apply_results(plan, ok_results(plan)).work
    plan = scheduler.schedule()  # a's prefill is running, its blocks not published yet
    assert plan.allocates == []
    scheduler.apply_results(plan, decode_results(plan))
    scheduler.on_executed(in_flight)
    a.token_ids.append(7)
    plan = scheduler.schedule()  # a's prefill is confirmed: b reuses its blocks
    assert [g.seq for g in plan.allocates] == [b]


def test_prompts_without_a_full_first_block_in_common_are_admitted_together() -> None:
    scheduler = Scheduler(max_num_batched_tokens=100, max_num_seqs=8, block_size=BLOCK)
    a, b = make_seq("a", 10), make_seq("b", 10)
    b.token_ids[3] = 999  # differs inside the first block
    salted = make_seq("t", 10)
    salted.cache_salt = "tenant-2"  # a's tokens under another salt: nothing to share
    short = make_seq("s", BLOCK)  # its only block holds its last token: never shared
    scheduler.add([a, b, salted, short])
    assert [g.seq for g in scheduler.schedule().allocates] == [a, b, salted, short]


def test_prompts_that_only_start_alike_are_admitted_in_one_step() -> None:
    """A chat template's first block before different questions: waiting would save a block
    per prompt and cost each two steps, so as many are admitted as the budget holds (a wave
    of chat requests once got its first tokens one step apart, one request after another)."""
    scheduler = Scheduler(max_num_batched_tokens=1000, max_num_seqs=16, block_size=BLOCK)
    seqs = [make_seq(f"c{i}", 40) for i in range(8)]
    for i, seq in enumerate(seqs):
        seq.token_ids[BLOCK:] = [1000 * (i + 1) + t for t in range(40 - BLOCK)]
    scheduler.add(seqs)
    assert [g.seq for g in scheduler.schedule().allocates] == seqs


def test_prompts_waiting_for_a_prefix_are_admitted_together_once_it_is_computed() -> None:
    """Prompts that are mostly one shared prefix wait for its first computation, then all
    take it from the cache in the same step: not one admission per step."""
    scheduler = Scheduler(max_num_batched_tokens=1000, max_num_seqs=16, block_size=BLOCK)
    shared = 8 * BLOCK
    seqs = [make_seq(f"w{i}", shared + 3) for i in range(6)]
    for i, seq in enumerate(seqs):
        seq.token_ids[shared:] = [1000 * (i + 1), 1000 * (i + 1) + 1, 1000 * (i + 1) + 2]
    scheduler.add(seqs)
    plan = scheduler.schedule()
    assert [g.seq for g in plan.allocates] == seqs[:1]
    in_flight = scheduler.apply_results(plan, ok_results(plan)).work
    plan = scheduler.schedule()  # the prefix is being computed: everyone else waits
    assert plan.allocates == []
    scheduler.apply_results(plan, decode_results(plan))
    scheduler.on_executed(in_flight)
    seqs[0].token_ids.append(7)
    plan = scheduler.schedule()
    assert [g.seq for g in plan.allocates] == seqs[1:]


def test_a_prompt_whose_first_block_was_a_cache_hit_holds_nobody_back() -> None:
    """A first block another replica computed (a cache hit at admission) is known computed:
    prompts starting with it are admitted without waiting for anything."""
    scheduler = Scheduler(max_num_batched_tokens=1000, max_num_seqs=16, block_size=BLOCK)
    first = make_seq("a", 3 * BLOCK)
    scheduler.add([first])
    plan = scheduler.schedule()
    scheduler.apply_results(plan, ok_results(plan, cached=2 * BLOCK))
    alike = [make_seq(f"b{i}", 3 * BLOCK + 1) for i in range(3)]
    scheduler.add(alike)
    assert [g.seq for g in scheduler.schedule().allocates] == alike


def test_execute_block_tables_follow_every_table_change() -> None:
    """Execute's block tables travel pre-encoded per sequence (step_builder.table_wire): after
    appends that add a block, keep the table or replace a block in the middle (copy on write),
    the runner's message holds exactly every row's current table."""
    import random

    from gateway.step_builder import SamplingRow, build_execute_request

    rng = random.Random(5)
    scheduler = Scheduler(max_num_batched_tokens=64, max_num_seqs=8)
    seqs = [make_seq(f"r{i}", 3 + i) for i in range(4)]
    scheduler.add(seqs)
    rows = {seq.request_id: SamplingRow(0.0, 1.0, 0, 0.0, None) for seq in seqs}
    changes = 0
    for step in range(40):
        plan = scheduler.schedule()
        results = ok_results(plan)
        for grant, result in zip(plan.appends, plan.split_results(results)["appends"],
                                 strict=True):
            table = grant.seq.block_table
            kind = rng.choice(("keep", "keep", "grow", "replace"))
            if kind == "grow":
                result.table_start, result.table_ids = len(table), [500 + step]
            elif kind == "replace" and table:
                at = rng.randrange(len(table))
                result.table_start, result.table_ids = at, [900 + step, *table[at + 1:]]
            changes += kind != "keep"
        outcome = scheduler.apply_results(plan, results)
        call = build_execute_request(outcome.work, [], 1, "c", step, rows,
                                     {seq: 0 for seq in seqs})
        message = call.message()
        expected = [block for item in outcome.work for block in item.seq.block_table]
        assert list(message.block_tables) == expected, step
        assert list(message.block_table_lens) == [len(w.seq.block_table) for w in outcome.work]
        scheduler.on_executed(outcome.work)
        for item in outcome.work:
            if item.do_sample:
                item.seq.token_ids.append(7)
    assert changes > 40, changes


# ----- LoRA: at most max_loras distinct adapters run at once (vLLM's rule) ------------------

def lora_seq(request_id: str, adapter: str, prompt_len: int = 3) -> Sequence:
    seq = make_seq(request_id, prompt_len)
    seq.adapter = adapter
    return seq


def test_an_adapter_over_max_loras_waits_and_holds_adapters_behind_it() -> None:
    scheduler = Scheduler(max_num_batched_tokens=100, max_num_seqs=8, max_loras=2)
    a, b, c = lora_seq("a", "x"), lora_seq("b", "y"), lora_seq("c", "z")
    d, e = make_seq("d", 3), lora_seq("e", "x")
    scheduler.add([a, b, c, d, e])
    plan = scheduler.schedule()
    # c's adapter would be the third: it keeps its place; d (base) goes on, but not e (on the
    # running x): x must drain for c to get its slot.
    assert [g.seq for g in plan.allocates] == [a, b, d]
    assert list(scheduler.waiting) == [c, e]
    run_step(scheduler, plan)
    assert scheduler.schedule().allocates == []  # x and y still run: c still waits
    scheduler.finish(a)
    plan = scheduler.schedule()
    assert [g.seq for g in plan.allocates] == [c]  # x is done: z takes its place
    assert list(scheduler.waiting) == [e]  # x would now be the third
    run_step(scheduler, plan)
    scheduler.finish(b)
    assert [g.seq for g in scheduler.schedule().allocates] == [e]
    assert not scheduler.waiting


def test_steady_traffic_on_running_adapters_cannot_starve_a_new_one() -> None:
    """Before the rule above, sequences on x and y arriving behind z were admitted step after
    step, and z waited for as long as they came."""
    scheduler = Scheduler(max_num_batched_tokens=100, max_num_seqs=64, max_loras=2)
    x, y, z = lora_seq("x0", "x"), lora_seq("y0", "y"), lora_seq("z0", "z")
    scheduler.add([x, y, z])
    run_step(scheduler, scheduler.schedule())
    for step in range(1, 4):
        scheduler.add([lora_seq(f"x{step}", "x"), lora_seq(f"y{step}", "y")])
        run_step(scheduler, scheduler.schedule())
    scheduler.finish(x)
    assert [g.seq for g in scheduler.schedule().allocates] == [z]


def test_adapters_admitted_in_one_step_count_against_max_loras() -> None:
    scheduler = Scheduler(max_num_batched_tokens=100, max_num_seqs=8, max_loras=1)
    a, b, c = lora_seq("a", "x"), lora_seq("b", "y"), lora_seq("c", "x")
    scheduler.add([a, b, c])
    plan = scheduler.schedule()
    # a takes the one slot; b waits for it, and c (on x) waits behind b.
    assert [g.seq for g in plan.allocates] == [a]
    assert list(scheduler.waiting) == [b, c]


def test_recomputed_sequences_follow_the_max_loras_rule_too() -> None:
    scheduler = Scheduler(max_num_batched_tokens=100, max_num_seqs=8, max_loras=1)
    a, b = lora_seq("a", "x"), make_seq("b", 3)
    scheduler.add([a, b])
    run_step(scheduler, scheduler.schedule())
    c = lora_seq("c", "y")
    scheduler.add([c])
    run_step(scheduler, scheduler.schedule())
    assert list(scheduler.waiting) == [c]
    # A runner restart puts a and b back at the front: after them, c still waits for x.
    scheduler.reset_all()
    plan = scheduler.schedule()
    assert [g.seq for g in plan.allocates] == [a, b]
    assert list(scheduler.waiting) == [c]


def test_a_base_only_queue_is_not_held_by_max_loras() -> None:
    scheduler = Scheduler(max_num_batched_tokens=100, max_num_seqs=8, max_loras=0)
    seqs = [make_seq(str(i), 3) for i in range(3)]
    scheduler.add(seqs)
    assert [g.seq for g in scheduler.schedule().allocates] == seqs
