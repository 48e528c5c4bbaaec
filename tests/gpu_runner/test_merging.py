"""Several clients' batches run as one forward (gpu_runner/merging.py): every client gets
exactly what a forward of its own batch gives, its pipelined steps keep their order, and a
bad batch fails alone. The last test runs the real model through the servicer: two clients at
once, greedy tokens equal to transformers', seeded samples equal to those of each alone."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import numpy as np
import pytest

from common.server import ServerOptions, start_server
from gpu_runner.batch import ExecuteBatch
from gpu_runner.merging import (
    BatchError,
    BatchMerger,
    PendingStepError,
    merge_requests,
    split_response,
)
from gpu_runner.runner import ModelRunner
from gpu_runner.servicer import SERVICE_NAME, RunnerServicer, register_handlers
from protos import runner_pb2, runner_pb2_grpc
from tests.gpu_runner.conftest import make_runner
from tests.gpu_runner.test_parity import expected_tokens, random_prompts
from tests.helpers.paged_driver import BlockPool, PagedDriver, batch_to_proto

VOCAB = 1000


def row_token(tokens: list[int], start: int, seed: int, temperature: float) -> int:
    """A fake model: the next token from a row's own inputs only."""
    value = sum((t + 1) * (i + start + 3) for i, t in enumerate(tokens))
    return (value + (seed if temperature > 0 else 0)) % VOCAB


def fake_forward(request: runner_pb2.ExecuteRequest,
                 parts: object = None) -> runner_pb2.ExecuteResponse:
    """Answers a batch row by row, logprobs and top entries where asked (`parts`, the
    batches merged, is not needed)."""
    answer = runner_pb2.ExecuteResponse(epoch=request.epoch, forward_ms=1.0)
    cursor = 0
    with_logprobs = len(request.num_logprobs) > 0
    for i, count in enumerate(request.num_new_tokens):
        tokens = list(request.token_ids[cursor:cursor + count])
        cursor += count
        if not request.do_sample[i]:
            continue
        token = row_token(tokens, request.start_positions[i], request.seeds[i],
                          request.temperatures[i])
        answer.token_ids.append(token)
        if with_logprobs:
            k = request.num_logprobs[i]
            answer.logprobs.append(-token / VOCAB)
            answer.top_counts.append(k)
            answer.top_token_ids.extend((token + j) % VOCAB for j in range(k))
            answer.top_logprobs.extend(-0.1 * j for j in range(k))
    return answer


def random_request(rng: random.Random, client: str = "", step: int = 0
                   ) -> runner_pb2.ExecuteRequest:
    rows = rng.randint(1, 6)
    counts = [rng.choice((1, 1, 1, 4)) for _ in range(rows)]
    request = runner_pb2.ExecuteRequest(
        epoch=3, client_id=client, step_id=step, num_new_tokens=counts,
        start_positions=[rng.randrange(50) for _ in range(rows)],
        token_ids=[rng.randrange(VOCAB) for _ in range(sum(counts))],
        slot_mapping=list(range(sum(counts))), block_table_lens=[1] * rows,
        block_tables=list(range(rows)), do_sample=[rng.random() < 0.8 for _ in range(rows)],
        temperatures=[rng.choice((0.0, 0.7)) for _ in range(rows)], top_ps=[1.0] * rows,
        top_ks=[0] * rows, min_ps=[0.0] * rows,
        seeds=[rng.randrange(1 << 32) for _ in range(rows)])
    if rng.random() < 0.5:
        request.num_logprobs.extend(rng.randrange(3) for _ in range(rows))
    if rng.random() < 0.3:
        request.presence_penalties.extend(rng.choice((0.0, 0.5)) for _ in range(rows))
        request.prompt_lens.extend([1] * rows)
        request.penalty_history_lens.extend([0] * rows)
    if rng.random() < 0.3:
        request.logit_bias_counts.extend([1] * rows)
        request.logit_bias_token_ids.extend(range(rows))
        request.logit_bias_values.extend([2.0] * rows)
    return request


def test_a_merged_forward_answers_each_batch_as_its_own_forward_would() -> None:
    rng = random.Random(0)
    merged_optional = 0
    for _ in range(300):
        requests = [random_request(rng) for _ in range(rng.randint(2, 4))]
        merged = merge_requests(requests)
        assert len(merged.num_new_tokens) == sum(len(r.num_new_tokens) for r in requests)
        for name in ("num_logprobs", "presence_penalties", "prompt_lens",
                     "penalty_history_lens", "logit_bias_counts"):
            column = getattr(merged, name)
            assert len(column) in (0, len(merged.num_new_tokens)), name
        # Some merges mix a batch with an optional column and one without it.
        merged_optional += any(len(r.num_logprobs) for r in requests) and not all(
            len(r.num_logprobs) for r in requests)
        answers = split_response(fake_forward(merged), requests)
        assert answers == [fake_forward(r) for r in requests]
    assert merged_optional > 30


def slow_forward(request: runner_pb2.ExecuteRequest,
                 parts: object = None) -> runner_pb2.ExecuteResponse:
    """fake_forward taking the time of a forward, during which other batches arrive."""
    time.sleep(0.003)
    return fake_forward(request)


def pipelined_client(merger: BatchMerger, client: str, steps: int, rng: random.Random,
                     results: dict[str, list[int]], barrier: threading.Barrier) -> None:
    """One row decoding `steps` tokens; step N+1 is sent before N's answer, its input token
    left to that answer (pending), as a gateway's runner loop does."""
    prompt = [rng.randrange(VOCAB) for _ in range(5)]
    tokens: list[int] = []
    barrier.wait()
    with ThreadPoolExecutor(1) as pool:
        request = runner_pb2.ExecuteRequest(
            epoch=3, client_id=client, step_id=1, num_new_tokens=[len(prompt)],
            start_positions=[0], token_ids=prompt, do_sample=[True], temperatures=[0.0],
            seeds=[0], top_ps=[1.0], top_ks=[0], min_ps=[0.0], block_table_lens=[0])
        in_flight = pool.submit(merger.run, request, lambda _: None, slow_forward)
        for step in range(2, steps + 1):
            following = runner_pb2.ExecuteRequest(
                epoch=3, client_id=client, step_id=step, after_step_id=step - 1,
                num_new_tokens=[1], start_positions=[len(prompt) + step - 2], token_ids=[0],
                pending_token_indices=[0], pending_sample_rows=[0], do_sample=[True],
                temperatures=[0.0], seeds=[0], top_ps=[1.0], top_ks=[0], min_ps=[0.0],
                block_table_lens=[0])
            next_in_flight = pool.submit(merger.run, following, lambda _: None, slow_forward)
            tokens.append(in_flight.result(timeout=30).token_ids[0])
            in_flight = next_in_flight
        tokens.append(in_flight.result(timeout=30).token_ids[0])
    results[client] = tokens


def alone(prompt: list[int], steps: int) -> list[int]:
    """The same decode, one step at a time (a fake model's row sees only its last token)."""
    tokens = [row_token(prompt, 0, 0, 0.0)]
    while len(tokens) < steps:
        tokens.append(row_token([tokens[-1]], len(prompt) + len(tokens) - 1, 0, 0.0))
    return tokens


def test_pipelined_clients_share_forwards_and_keep_their_order() -> None:
    merger = BatchMerger()
    clients, steps = 4, 40
    results: dict[str, list[int]] = {}
    barrier = threading.Barrier(clients)
    threads = [threading.Thread(target=pipelined_client,
                                args=(merger, f"c{i}", steps, random.Random(i), results,
                                      barrier)) for i in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    for i in range(clients):
        rng = random.Random(i)
        prompt = [rng.randrange(VOCAB) for _ in range(5)]
        assert results[f"c{i}"] == alone(prompt, steps)
    assert merger.batches == clients * steps
    assert merger.forwards < merger.batches * 0.75  # batches did share forwards


def test_a_refused_batch_fails_alone_and_a_retry_gets_its_first_answer() -> None:
    merger = BatchMerger()
    rng = random.Random(1)
    good, bad = random_request(rng, "good", 1), random_request(rng, "bad", 1)
    forwards: list[runner_pb2.ExecuteRequest] = []

    def forward(request: runner_pb2.ExecuteRequest,
                parts: object = None) -> runner_pb2.ExecuteResponse:
        forwards.append(request)
        return fake_forward(request)

    def check(request: runner_pb2.ExecuteRequest) -> None:
        if request.client_id == "bad":
            raise BatchError("bad columns")

    with ThreadPoolExecutor(2) as pool:
        runs = [pool.submit(merger.run, request, check, forward) for request in (good, bad)]
        assert runs[0].result(timeout=10) == fake_forward(good)
        with pytest.raises(BatchError, match="bad columns"):
            runs[1].result(timeout=10)
    retried = runner_pb2.ExecuteRequest()
    retried.CopyFrom(good)
    retried.token_ids[0] = (retried.token_ids[0] + 1) % VOCAB  # other contents, same step
    assert merger.run(retried, check, forward) == fake_forward(good)
    assert len(forwards) == 1


def test_a_waiting_step_that_leads_others_forward_still_gets_its_own() -> None:
    """A caller whose own step must wait may run the forward of the others' batches (it was
    free to); it must then go on waiting for its own turn, not return without an answer."""
    for _ in range(20):
        merger = BatchMerger()
        hold = threading.Event()

        def held(request: runner_pb2.ExecuteRequest, parts: object = None,
                 hold: threading.Event = hold) -> runner_pb2.ExecuteResponse:
            hold.wait(5)
            return fake_forward(request)

        def step(client: str, step: int, after: int) -> runner_pb2.ExecuteRequest:
            return runner_pb2.ExecuteRequest(
                epoch=3, client_id=client, step_id=step, after_step_id=after,
                num_new_tokens=[1], start_positions=[step], token_ids=[step],
                do_sample=[True], temperatures=[0.0], seeds=[0], top_ps=[1.0], top_ks=[0],
                min_ps=[0.0], block_table_lens=[0])

        with ThreadPoolExecutor(4) as pool:
            holder = pool.submit(merger.run, step("h", 1, 0), lambda _: None, held)
            while not merger._busy:
                time.sleep(0.001)
            early = pool.submit(merger.run, step("x", 2, 1), lambda _: None, fake_forward)
            other = pool.submit(merger.run, step("z", 1, 0), lambda _: None, fake_forward)
            time.sleep(0.01)
            hold.set()  # both wake: either may lead z's forward
            assert other.result(timeout=5) == fake_forward(step("z", 1, 0))
            first = merger.run(step("x", 1, 0), lambda _: None, fake_forward)
            assert early.result(timeout=5) == fake_forward(step("x", 2, 1))
            assert first == fake_forward(step("x", 1, 0))
            holder.result(timeout=5)


def test_a_step_whose_previous_one_never_comes_gives_up() -> None:
    merger = BatchMerger(wait_s=0.2)

    def run(step: int, after: int) -> None:
        request = runner_pb2.ExecuteRequest(client_id="c", step_id=step, after_step_id=after)
        merger.run(request, lambda _: None, lambda _, __: runner_pb2.ExecuteResponse())

    run(1, 0)
    with pytest.raises(PendingStepError, match="step 3 of client 'c' has not run"):
        run(4, 3)
    run(2, 1)  # step 1 has had its turn: no wait


# ---- the real model, through the servicer ---------------------------------------------------

@pytest.fixture(scope="module")
def runner(tiny_model_dirs: dict[str, Path]) -> ModelRunner:
    return make_runner(tiny_model_dirs["qwen3"], block_size=16, cache_bytes=8 << 20)


@pytest.fixture(scope="module")
def served(runner: ModelRunner) -> Iterator[tuple[runner_pb2_grpc.RunnerServiceStub,
                                                  RunnerServicer]]:
    servicer = RunnerServicer(runner)
    service = start_server(
        ServerOptions(port=0),
        lambda server: server.add_generic_rpc_handlers((register_handlers(servicer),)),
        [SERVICE_NAME])
    channel = grpc.insecure_channel(f"127.0.0.1:{service.port}")
    yield runner_pb2_grpc.RunnerServiceStub(channel), servicer
    channel.close()
    service.stop(0)


def client_driver(stub: runner_pb2_grpc.RunnerServiceStub, client: str, blocks: range,
                  temperature: float) -> PagedDriver:
    """A client with its own share of the cache's blocks (as the block service would give
    two gateways), sampling at `temperature` with fixed seeds."""
    info = stub.Info(runner_pb2.InfoRequest())
    steps = iter(range(1, 1 << 30))

    def execute(batch: ExecuteBatch) -> np.ndarray:
        batch.client_id, batch.step_id = client, next(steps)
        batch.temperatures[:] = temperature
        batch.seeds[:] = np.arange(batch.num_seqs, dtype=np.uint64) + 11
        return np.asarray(stub.Execute(batch_to_proto(batch), timeout=60).token_ids)

    driver = PagedDriver(execute, info.block_size, info.num_blocks)
    driver.pool = BlockPool(blocks.stop)
    driver.pool.free = [b for b in driver.pool.free if b in blocks]
    driver.epoch = info.epoch
    return driver


def hold_runner(servicer: RunnerServicer, seconds: float) -> threading.Thread:
    """Keeps the runner busy for `seconds` (a forward of nothing that takes that long), so
    that batches sent meanwhile queue and run together next."""
    merger = servicer._merger

    def held(_: runner_pb2.ExecuteRequest, parts: object = None) -> runner_pb2.ExecuteResponse:
        time.sleep(seconds)
        return runner_pb2.ExecuteResponse()

    thread = threading.Thread(
        target=merger.run, args=(runner_pb2.ExecuteRequest(), lambda _: None, held))
    thread.start()
    while not merger._busy:
        time.sleep(0.001)
    return thread


def generate_together(servicer: RunnerServicer, drivers: dict[str, PagedDriver],
                      prompts: dict[str, list[list[int]]], steps: int
                      ) -> dict[str, list[list[int]]]:
    """Both clients' steps sent while the runner is held: each forward is of both."""
    seqs = {name: [driver.add(p) for p in prompts[name]] for name, driver in drivers.items()}
    with ThreadPoolExecutor(len(drivers)) as pool:
        for _ in range(steps):
            holder = hold_runner(servicer, 0.05)
            runs = [pool.submit(driver.step, seqs[name]) for name, driver in drivers.items()]
            for run in runs:
                run.result(timeout=60)
            holder.join()
    return {name: [seq.generated for seq in seqs[name]] for name in drivers}


def test_two_clients_merged_get_what_each_gets_alone(
        served: tuple[runner_pb2_grpc.RunnerServiceStub, RunnerServicer],
        tiny_model_dirs: dict[str, Path], runner: ModelRunner) -> None:
    stub, servicer = served
    half = runner.num_blocks // 2
    prompts = {"a": random_prompts((3, 17, 9), seed=5), "b": random_prompts((31, 1, 16), seed=6)}
    shares = {"a": range(0, half), "b": range(half, runner.num_blocks)}
    steps = 10
    for temperature in (0.0, 0.8):
        alone_tokens = {}
        for name in prompts:
            driver = client_driver(stub, f"alone-{name}-{temperature}", shares[name],
                                   temperature)
            seqs = [driver.add(p) for p in prompts[name]]
            for _ in range(steps):
                driver.step(seqs)
            alone_tokens[name] = [seq.generated for seq in seqs]
        before = (servicer._merger.forwards, servicer._merger.batches)
        drivers = {name: client_driver(stub, f"merged-{name}-{temperature}", shares[name],
                                       temperature) for name in prompts}
        merged_tokens = generate_together(servicer, drivers, prompts, steps)
        forwards = servicer._merger.forwards - before[0] - steps  # less the holds
        batches = servicer._merger.batches - before[1] - steps
        assert (forwards, batches) == (steps, 2 * steps)  # every forward held both
        assert merged_tokens == alone_tokens
        if temperature == 0.0:  # and greedy is transformers' own
            folder = tiny_model_dirs["qwen3"]
            for name in prompts:
                assert alone_tokens[name] == [expected_tokens(folder, p, steps)
                                              for p in prompts[name]]


def test_merged_batches_keep_their_adapters_within_the_slot_table() -> None:
    """Adapters per sequence survive the merge ("" for a batch that names none), and a
    forward never names more adapters than the runner's slots: a batch that would push it
    over waits for the next forward."""
    rng = random.Random(5)
    plain, first, second = (random_request(rng, f"c{i}") for i in range(3))
    first.adapters.extend(["a"] * len(first.num_new_tokens))
    second.adapters.extend(["b"] * len(second.num_new_tokens))
    merged = merge_requests([plain, first])
    assert list(merged.adapters) == [""] * len(plain.num_new_tokens) + list(first.adapters)
    assert not merge_requests([plain, plain]).adapters

    from gpu_runner.merging import _Job
    merger = BatchMerger()
    merger.max_adapters = 1
    merger._queue = [_Job(r, lambda _r: None, 0.0) for r in (first, plain, second)]
    assert [job.request for job in merger._take_runnable()] == [first, plain]
    assert [job.request for job in merger._take_runnable()] == [second]
