"""Batches of several clients run as one forward.

Each gateway runs its own step loop per runner, so M gateways serving one runner send it M
batches per step. Run one after another, they would split the runner's batch M ways; merged,
the runner makes one forward of all of them, as one gateway with all the streams would.

`BatchMerger` is the runner's turnstile (it replaces one-batch-at-a-time): Execute calls queue
their batch; whenever the runner is free, the first waiting call takes every batch that may
run now (one per client, in arrival order, each after its client's previous step, within the
runner's token budget), merges them (`merge_requests`), runs the forward once and hands each
call its own rows of the answer (`split_response`). A client's step N+1, sent while N runs,
waits for N's turn as before; the runner never waits for a client that has nothing queued.

The rows of a merged forward are each computed as in a forward of their own batch: attention
reads only the sequence's own blocks and sampling depends only on a row's logits, parameters,
seed and position (runner.proto), so greedy tokens equal and seeded samples are the same.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from protos import runner_pb2

MAX_REMEMBERED_CLIENTS = 1024
AFTER_STEP_WAIT_S = 30.0  # how long a batch waits for the step it is to run after

# Per-sequence columns that a batch may leave empty ("off for every sequence"), with the
# value that means off for one sequence when another batch of the merge sends the column.
_OPTIONAL_COLUMNS = {
    "num_logprobs": 0,
    "presence_penalties": 0.0,
    "frequency_penalties": 0.0,
    "repetition_penalties": 1.0,
    "prompt_lens": 0,
    "penalty_history_lens": 0,
    "logit_bias_counts": 0,
    "adapters": "",
}
# Columns concatenated as they are (per sequence, per token, or per entry of another column).
_PLAIN_COLUMNS = (
    "copy_src_block_ids", "copy_dst_block_ids", "num_new_tokens", "start_positions",
    "token_ids", "slot_mapping", "block_table_lens", "block_tables", "do_sample",
    "temperatures", "top_ps", "top_ks", "min_ps", "seeds", "penalty_token_ids",
    "logit_bias_token_ids", "logit_bias_values",
)


class PendingStepError(Exception):
    """Pending tokens refer to a step that is not the client's last executed one."""


class BatchError(ValueError):
    """A malformed batch (INVALID_ARGUMENT); the message says which column and why."""


class PartialFailure(Exception):
    """A merged forward ran, but some of its batches failed (their masks did not come): the
    others get their rows of `answer`, batch i (in the merge's order) gets failed[i]."""

    def __init__(self, answer: runner_pb2.ExecuteResponse,
                 failed: dict[int, BaseException]) -> None:
        super().__init__(f"{len(failed)} batch(es) of the forward failed")
        self.answer = answer
        self.failed = failed


class RetryCache:
    """The last answer per client, so that a retried step is not executed twice (and the
    next step can take its pending tokens from it)."""

    def __init__(self, capacity: int = MAX_REMEMBERED_CLIENTS) -> None:
        self.capacity = capacity
        self._last: OrderedDict[str, tuple[int, runner_pb2.ExecuteResponse]] = OrderedDict()

    def lookup(self, client_id: str, step_id: int) -> runner_pb2.ExecuteResponse | None:
        """The cached answer of a retry; raises BatchError for a step older than the last."""
        if not client_id or client_id not in self._last:
            return None
        last_step, answer = self._last[client_id]
        if step_id == last_step:
            return answer
        if step_id < last_step:
            raise BatchError(
                f"step_id {step_id} of client {client_id!r} is older than its last step "
                f"{last_step} (step ids must increase)"
            )
        return None

    def fill_pending(self, request: runner_pb2.ExecuteRequest) -> None:
        """Writes the request's pending tokens into its token_ids, from the answer they refer
        to, and clears the pending columns (so that a recording replays as it ran)."""
        indices, rows = request.pending_token_indices, request.pending_sample_rows
        if not indices and not rows:
            return
        if len(indices) != len(rows):
            raise BatchError(f"pending_token_indices has {len(indices)} entries but "
                             f"pending_sample_rows {len(rows)}")
        if not request.after_step_id:
            raise BatchError("pending tokens need an after_step_id (the step that samples them)")
        last_step, answer = self._last.get(request.client_id, (None, None))
        if answer is None or last_step != request.after_step_id:
            raise PendingStepError(
                f"pending tokens come from step {request.after_step_id}; the last step "
                f"answered for client {request.client_id!r} is {last_step}")
        sampled = answer.token_ids
        if max(indices) >= len(request.token_ids) or len(set(indices)) != len(indices):
            raise BatchError("pending_token_indices must be distinct indices into token_ids")
        if max(rows) >= len(sampled):
            raise BatchError(f"pending_sample_rows names row {max(rows)}; step "
                             f"{last_step} sampled {len(sampled)} tokens")
        tokens = request.token_ids
        for index, row in zip(indices, rows, strict=True):
            tokens[index] = sampled[row]
        request.ClearField("pending_token_indices")
        request.ClearField("pending_sample_rows")

    def store(self, client_id: str, step_id: int, answer: runner_pb2.ExecuteResponse) -> None:
        if not client_id:
            return
        self._last[client_id] = (step_id, answer)
        self._last.move_to_end(client_id)
        while len(self._last) > self.capacity:
            self._last.popitem(last=False)


def merge_requests(requests: list[runner_pb2.ExecuteRequest]) -> runner_pb2.ExecuteRequest:
    """One batch with every request's sequences, in order (their pending tokens must have
    been filled in). A sequence keeps its columns; an optional column that some request
    leaves empty gets the neutral value for each of its sequences."""
    if len(requests) == 1:
        return requests[0]
    merged = runner_pb2.ExecuteRequest(epoch=requests[0].epoch)
    for name in _PLAIN_COLUMNS:
        column = getattr(merged, name)
        for request in requests:
            column.extend(getattr(request, name))
    for name, neutral in _OPTIONAL_COLUMNS.items():
        if not any(len(getattr(request, name)) for request in requests):
            continue
        column = getattr(merged, name)
        for request in requests:
            own = getattr(request, name)
            column.extend(own if len(own) else [neutral] * len(request.num_new_tokens))
    _merge_masks(merged, requests)
    return merged


def _merge_masks(merged: runner_pb2.ExecuteRequest,
                 requests: list[runner_pb2.ExecuteRequest]) -> None:
    """Masked sequences renumbered into the merged batch; the masks inline when every batch
    sent them inline, else all gathered after the forward (the servicer's job)."""
    offset = 0
    for request in requests:
        merged.mask_seq_indices.extend(i + offset for i in request.mask_seq_indices)
        offset += len(request.num_new_tokens)
    if any(request.masks_follow for request in requests):
        merged.masks_follow = True
    else:
        merged.masks = b"".join(request.masks for request in requests)


def split_response(answer: runner_pb2.ExecuteResponse,
                   requests: list[runner_pb2.ExecuteRequest]) -> list[runner_pb2.ExecuteResponse]:
    """Each request's answer from the merged forward's: its sampled rows, and logprobs only
    where it asked for them (as a forward of its own would answer)."""
    if len(requests) == 1:
        return [answer]
    answers = []
    row = 0
    top = 0
    with_logprobs = len(answer.logprobs) > 0
    for request in requests:
        rows = sum(request.do_sample)
        own = runner_pb2.ExecuteResponse(
            token_ids=answer.token_ids[row:row + rows], epoch=answer.epoch,
            forward_ms=answer.forward_ms, sample_ms=answer.sample_ms, total_ms=answer.total_ms)
        if with_logprobs:
            counts = answer.top_counts[row:row + rows]
            width = sum(counts)
            if len(request.num_logprobs):
                own.logprobs.extend(answer.logprobs[row:row + rows])
                own.top_counts.extend(counts)
                own.top_token_ids.extend(answer.top_token_ids[top:top + width])
                own.top_logprobs.extend(answer.top_logprobs[top:top + width])
            top += width
        answers.append(own)
        row += rows
    return answers


# Called in a batch's turn before it runs, on the request with its pending tokens filled in:
# raises for a batch that must not run (malformed: BatchError; its caller gone).
Check = Callable[[runner_pb2.ExecuteRequest], None]
# Runs the merged batch; also given the batches it merges, in order. Raises PartialFailure
# when some of them failed and the others have their answer.
Forward = Callable[[runner_pb2.ExecuteRequest, list[runner_pb2.ExecuteRequest]],
                   runner_pb2.ExecuteResponse]


@dataclass
class _Job:
    request: runner_pb2.ExecuteRequest
    check: Check
    arrived: float
    answer: runner_pb2.ExecuteResponse | None = None
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)


class BatchMerger:
    """The runner's turnstile: one forward at a time (the KV cache has one writer), each of
    every batch that may run then (module docstring). It keeps each client's last answer
    (`retries`): a retried step gets it again, and the next step takes its pending tokens
    from it."""

    def __init__(self, max_num_tokens: int = 1 << 16, wait_s: float = AFTER_STEP_WAIT_S,
                 capacity: int = MAX_REMEMBERED_CLIENTS) -> None:
        self.max_num_tokens = max_num_tokens  # new tokens of one merged forward, at most
        self.max_adapters = 0  # LoRA adapters one merged forward may name (the runner's)
        self.wait_s = wait_s
        self.capacity = capacity
        self.retries = RetryCache(capacity)
        self._changed = threading.Condition()
        self._busy = False
        self._queue: list[_Job] = []
        self._last_turn: OrderedDict[str, int] = OrderedDict()  # client -> its last step run
        # For metrics: forwards run and the batches they held.
        self.forwards = 0
        self.batches = 0

    def run(self, request: runner_pb2.ExecuteRequest, check: Check,
            forward: Forward) -> runner_pb2.ExecuteResponse:
        """`request`'s answer, from a forward it shares with the other batches that may run
        when the runner is next free (`forward` runs the merged batch). In its turn a retried
        step gets its first answer; otherwise its pending tokens are filled in and
        `check(request)` may refuse it (its exception is raised here, the others run).
        PendingStepError when `after_step_id` has not had its turn within wait_s."""
        job = _Job(request, check, time.monotonic())
        with self._changed:
            self._queue.append(job)
        while not job.done.is_set():
            batch = self._wait_for_turn(job)
            if batch:  # this caller leads: it runs the forward for everyone in it
                try:
                    self._run_merged(batch, forward)
                finally:
                    with self._changed:
                        self._busy = False
                        self._changed.notify_all()
        if job.error is not None:
            raise job.error
        assert job.answer is not None
        return job.answer

    def _wait_for_turn(self, job: _Job) -> list[_Job]:
        """Waits until the job is done or the runner is free with batches to run (which
        need not include this job: its step may still wait for its previous one); returns
        the batches this caller is to run, marking the runner busy."""
        with self._changed:
            while not job.done.is_set():
                if not self._busy:
                    batch = self._take_runnable()
                    if batch:
                        self._busy = True
                        return batch
                self._expire(job)
                if not job.done.is_set():
                    self._changed.wait(self._time_left(job))
        return []

    def _take_runnable(self) -> list[_Job]:
        """The queued jobs that may run now, oldest first: one per client, after its
        previous step, within the token budget and the adapter slots (the first one whatever
        its size)."""
        taken: list[_Job] = []
        clients: set[str] = set()
        adapters: set[str] = set()
        tokens = 0
        for job in self._queue:
            request = job.request
            client = request.client_id
            if client and (client in clients or
                           self._last_turn.get(client, 0) < request.after_step_id):
                continue
            size = len(request.token_ids)
            if taken and tokens + size > self.max_num_tokens:
                continue
            own_adapters = set(request.adapters) - {""}
            if taken and len(adapters | own_adapters) > self.max_adapters:
                continue  # the slot table holds max_adapters per forward
            taken.append(job)
            tokens += size
            adapters |= own_adapters
            if client:
                clients.add(client)
        for job in taken:
            self._queue.remove(job)
        return taken

    def _expire(self, job: _Job) -> None:
        """Fails the job if the step it is to run after has not come within wait_s."""
        request = job.request
        if (time.monotonic() - job.arrived < self.wait_s
                or self._last_turn.get(request.client_id, 0) >= request.after_step_id):
            return
        self._queue.remove(job)
        job.error = PendingStepError(
            f"step {request.after_step_id} of client {request.client_id!r} has not run "
            f"within {self.wait_s:.0f} s; this batch was to run after it")
        job.done.set()

    def _time_left(self, job: _Job) -> float:
        return max(0.001, job.arrived + self.wait_s - time.monotonic())

    def _run_merged(self, jobs: list[_Job], forward: Forward) -> None:
        """Readies each job, runs one forward for those that need one, answers each, and
        only then lets each client's next step have its turn."""
        running = [job for job in jobs if self._ready(job)]
        if running:
            requests = [job.request for job in running]
            failed: dict[int, BaseException] = {}
            try:
                try:
                    merged_answer = forward(merge_requests(requests), requests)
                except PartialFailure as partial:
                    merged_answer, failed = partial.answer, partial.failed
                answers = split_response(merged_answer, requests)
            except BaseException as error:  # the forward failed: every batch in it did
                for job in running:
                    job.error = error
            else:
                for i, (job, answer) in enumerate(zip(running, answers, strict=True)):
                    if i in failed:
                        job.error = failed[i]
                        continue
                    job.answer = answer
                    self.retries.store(job.request.client_id, job.request.step_id, answer)
            self.forwards += 1
            self.batches += len(running)
        with self._changed:
            for job in jobs:
                self._mark_turn(job.request)
                job.done.set()

    def _ready(self, job: _Job) -> bool:
        """Whether the job needs the forward: False for a retry (answered from memory) and
        for a batch refused (its error kept for its caller)."""
        request = job.request
        try:
            cached = self.retries.lookup(request.client_id, request.step_id)
            if cached is not None:
                job.answer = cached
                return False
            self.retries.fill_pending(request)
            job.check(request)
        except BaseException as error:  # this batch's fault: the others go on
            job.error = error
            return False
        return True

    def _mark_turn(self, request: runner_pb2.ExecuteRequest) -> None:
        client = request.client_id
        if not client:
            return
        self._last_turn[client] = max(request.step_id, self._last_turn.get(client, 0))
        self._last_turn.move_to_end(client)
        while len(self._last_turn) > self.capacity:
            self._last_turn.popitem(last=False)
