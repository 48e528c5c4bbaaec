"""RunnerService over real gRPC on a loopback port: Info, parity through Execute, epochs,
validation status codes, retries; and `python -m gpu_runner` as a process."""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch
from grpc_health.v1 import health_pb2

from common.server import ServerOptions, start_server
from gpu_runner.batch import ExecuteBatch
from gpu_runner.merging import BatchError, RetryCache
from gpu_runner.runner import ExecuteResult, ModelRunner
from gpu_runner.servicer import (
    SERVICE_NAME,
    RunnerServicer,
    register_handlers,
)
from protos import runner_pb2, runner_pb2_grpc
from tests.gpu_runner.conftest import make_runner
from tests.gpu_runner.test_parity import STEPS, TINY_LENGTHS, expected_tokens, random_prompts
from tests.helpers.paged_driver import PagedDriver, batch_to_proto
from tests.helpers.services import ServiceProcess, health_status


@pytest.fixture(scope="module")
def runner(tiny_model_dirs: dict[str, Path]) -> ModelRunner:
    return make_runner(tiny_model_dirs["qwen3"], block_size=16, cache_bytes=8 << 20)


@pytest.fixture(scope="module")
def stub(runner: ModelRunner) -> Iterator[runner_pb2_grpc.RunnerServiceStub]:
    yield from serve_stub(RunnerServicer(runner))


def serve_stub(servicer: RunnerServicer) -> Iterator[runner_pb2_grpc.RunnerServiceStub]:
    """A stub of `servicer` served on a loopback port, until the generator is closed."""
    service = start_server(
        ServerOptions(port=0),
        lambda server: server.add_generic_rpc_handlers((register_handlers(servicer),)),
        [SERVICE_NAME],
    )
    channel = grpc.insecure_channel(f"127.0.0.1:{service.port}")
    yield runner_pb2_grpc.RunnerServiceStub(channel)
    channel.close()
    service.stop(0)


def grpc_driver(stub: runner_pb2_grpc.RunnerServiceStub, info: runner_pb2.InfoResponse,
                client_id: str = "") -> PagedDriver:
    steps = itertools.count(1)

    def execute(batch: ExecuteBatch) -> np.ndarray:
        batch.client_id, batch.step_id = client_id, next(steps)
        return np.asarray(stub.Execute(batch_to_proto(batch), timeout=60).token_ids)

    driver = PagedDriver(execute, info.block_size, info.num_blocks)
    driver.epoch = info.epoch
    return driver


def test_info_describes_the_runner(stub: runner_pb2_grpc.RunnerServiceStub,
                                   runner: ModelRunner) -> None:
    info = stub.Info(runner_pb2.InfoRequest())
    assert info.architecture == "Qwen3ForCausalLM"
    assert info.vocab_size == 49152 and list(info.eos_token_ids) == [2]
    assert info.num_blocks == runner.num_blocks > 0 and info.block_size == 16
    assert info.dtype == "float32" and info.device == "cpu"
    assert info.epoch != 0 and info.attention_backend == "torch"


def test_parity_through_execute(stub: runner_pb2_grpc.RunnerServiceStub,
                                tiny_model_dirs: dict[str, Path]) -> None:
    info = stub.Info(runner_pb2.InfoRequest())
    prompts = random_prompts(TINY_LENGTHS, seed=7)
    seqs = grpc_driver(stub, info).run_staggered(prompts, STEPS)
    for prompt, seq in zip(prompts, seqs, strict=True):
        assert seq.generated == expected_tokens(tiny_model_dirs["qwen3"], prompt)


def _one_prompt_request(info: runner_pb2.InfoResponse) -> runner_pb2.ExecuteRequest:
    driver = PagedDriver(lambda batch: np.zeros(0), info.block_size, info.num_blocks)
    driver.epoch = info.epoch
    batch, _ = driver.build([driver.add([5, 6, 7, 8, 9])])
    return batch_to_proto(batch)


def test_wrong_epoch_is_failed_precondition(stub: runner_pb2_grpc.RunnerServiceStub,
                                            runner: ModelRunner) -> None:
    info = stub.Info(runner_pb2.InfoRequest())
    request = _one_prompt_request(info)
    request.epoch = info.epoch ^ 1
    before = runner.kv_cache.clone()
    with pytest.raises(grpc.RpcError) as error:
        stub.Execute(request)
    assert error.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "epoch" in error.value.details()
    assert torch.equal(runner.kv_cache, before)


def test_malformed_batch_is_invalid_argument(stub: runner_pb2_grpc.RunnerServiceStub,
                                             runner: ModelRunner) -> None:
    info = stub.Info(runner_pb2.InfoRequest())
    request = _one_prompt_request(info)
    request.token_ids[0] = info.vocab_size
    before = runner.kv_cache.clone()
    with pytest.raises(grpc.RpcError) as error:
        stub.Execute(request)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "token_ids[0]" in error.value.details()
    assert torch.equal(runner.kv_cache, before)


def test_retried_step_returns_the_first_answer(stub: runner_pb2_grpc.RunnerServiceStub,
                                               runner: ModelRunner) -> None:
    info = stub.Info(runner_pb2.InfoRequest())
    request = _one_prompt_request(info)
    request.client_id, request.step_id = "retry-test", 10
    first = stub.Execute(request)
    # Same (client, step) with other contents: not executed, the first answer comes back.
    changed = runner_pb2.ExecuteRequest()
    changed.CopyFrom(request)
    changed.token_ids[:] = [11, 12, 13, 14, 15]
    before = runner.kv_cache.clone()
    again = stub.Execute(changed)
    assert list(again.token_ids) == list(first.token_ids)
    assert torch.equal(runner.kv_cache, before)
    changed.step_id = 9
    with pytest.raises(grpc.RpcError) as error:
        stub.Execute(changed)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_loading_runner_is_unavailable() -> None:
    servicer = RunnerServicer(None)
    service = start_server(
        ServerOptions(port=0),
        lambda server: server.add_generic_rpc_handlers((register_handlers(servicer),)),
        [SERVICE_NAME], serving=False,
    )
    try:
        address = f"127.0.0.1:{service.port}"
        assert health_status(address) == health_pb2.HealthCheckResponse.NOT_SERVING
        with grpc.insecure_channel(address) as channel, pytest.raises(grpc.RpcError) as error:
            runner_pb2_grpc.RunnerServiceStub(channel).Info(runner_pb2.InfoRequest())
        assert error.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        service.stop(0)


def test_main_serves_a_model_folder(tiny_model_dirs: dict[str, Path], tmp_path: Path) -> None:
    process = ServiceProcess("gpu_runner", [
        "--model", str(tiny_model_dirs["qwen2"]), "--kv-cache-memory", str(4 << 20),
        "--max-model-len", "128", "--block-size", "32",
    ]).start(tmp_path)
    try:
        process.wait_serving(timeout_s=120)
        with grpc.insecure_channel(process.address) as channel:
            stub = runner_pb2_grpc.RunnerServiceStub(channel)
            info = stub.Info(runner_pb2.InfoRequest())
            assert info.architecture == "Qwen2ForCausalLM" and info.block_size == 32
            assert info.max_model_len == 128
            reply = stub.Execute(_one_prompt_request(info))
            assert len(reply.token_ids) == 1 and reply.epoch == info.epoch
    finally:
        assert process.terminate() == 0


def test_the_model_loads_on_the_thread_that_runs_its_batches(
        runner: ModelRunner, monkeypatch: pytest.MonkeyPatch) -> None:
    """Loading and every batch share one OS thread, so the process holds one OpenMP team."""
    threads: dict[str, int] = {}

    def make_runner() -> ModelRunner:
        threads["load"] = threading.get_ident()
        return runner

    def execute(batch: ExecuteBatch, late_masks: object = None) -> ExecuteResult:
        threads["execute"] = threading.get_ident()
        return original_execute(batch)

    original_execute = runner.execute
    monkeypatch.setattr(runner, "execute", execute)
    servicer = RunnerServicer()
    service = start_server(
        ServerOptions(port=0),
        lambda server: server.add_generic_rpc_handlers((register_handlers(servicer),)),
        [SERVICE_NAME],
    )
    try:
        assert servicer.load(make_runner) is runner
        with grpc.insecure_channel(f"127.0.0.1:{service.port}") as channel:
            stub = runner_pb2_grpc.RunnerServiceStub(channel)
            reply = stub.Execute(_one_prompt_request(stub.Info(runner_pb2.InfoRequest())))
        assert len(reply.token_ids) == 1
        assert threads["execute"] == threads["load"] != threading.get_ident()
    finally:
        service.stop(0)
        servicer.close()


def _decode_after(prompt_request: runner_pb2.ExecuteRequest, client_id: str, step_id: int
                  ) -> runner_pb2.ExecuteRequest:
    """The decode that follows `_one_prompt_request`'s prefill: position 5, greedy."""
    block = prompt_request.block_tables[0]
    size = prompt_request.slot_mapping[1] - prompt_request.slot_mapping[0]
    assert size == 1 and prompt_request.slot_mapping[0] % 16 == 0
    return runner_pb2.ExecuteRequest(
        epoch=prompt_request.epoch, client_id=client_id, step_id=step_id,
        num_new_tokens=[1], start_positions=[5], token_ids=[0], slot_mapping=[block * 16 + 5],
        block_table_lens=[1], block_tables=[block], do_sample=[True], temperatures=[0.0],
        top_ps=[1.0], top_ks=[0], min_ps=[0.0], seeds=[0])


def test_a_step_sent_before_its_previous_one_waits_for_it_and_takes_its_sample(
        stub: runner_pb2_grpc.RunnerServiceStub) -> None:
    info = stub.Info(runner_pb2.InfoRequest())
    # Reference, one step at a time: the decode's input is the prefill's sample.
    prefill = _one_prompt_request(info)
    prefill.client_id, prefill.step_id = "in-order", 1
    sampled = stub.Execute(prefill).token_ids[0]
    decode = _decode_after(prefill, "in-order", 2)
    decode.token_ids[:] = [sampled]
    expected = list(stub.Execute(decode).token_ids)
    # Pipelined: the decode leaves its input to the prefill's answer and arrives FIRST.
    prefill.client_id = "pipelined"
    decode = _decode_after(prefill, "pipelined", 2)
    decode.after_step_id = 1
    decode.pending_token_indices[:] = [0]
    decode.pending_sample_rows[:] = [0]
    with ThreadPoolExecutor(1) as pool:
        early = pool.submit(stub.Execute, decode, timeout=60)
        time.sleep(0.3)
        assert not early.done()  # held until step 1 has run
        assert stub.Execute(prefill).token_ids[0] == sampled
        assert list(early.result().token_ids) == expected


def test_a_step_after_a_step_that_failed_is_failed_precondition(
        stub: runner_pb2_grpc.RunnerServiceStub, runner: ModelRunner) -> None:
    info = stub.Info(runner_pb2.InfoRequest())
    prefill = _one_prompt_request(info)
    prefill.client_id, prefill.step_id = "failing", 1
    prefill.token_ids[0] = info.vocab_size  # rejected: nothing runs, no answer is stored
    with pytest.raises(grpc.RpcError) as error:
        stub.Execute(prefill)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    decode = _decode_after(prefill, "failing", 2)
    decode.after_step_id = 1
    decode.pending_token_indices[:] = [0]
    decode.pending_sample_rows[:] = [0]
    before = runner.kv_cache.clone()
    with pytest.raises(grpc.RpcError) as error:
        stub.Execute(decode, timeout=10)
    assert error.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "step 1" in error.value.details()
    assert torch.equal(runner.kv_cache, before)


@pytest.mark.parametrize(("change", "message"), [
    (lambda r: r.pending_sample_rows.append(0), "pending_sample_rows"),
    (lambda r: r.ClearField("after_step_id"), "after_step_id"),
    (lambda r: r.pending_token_indices.__setitem__(0, 1), "distinct indices"),
    (lambda r: r.pending_sample_rows.__setitem__(0, 1), "row 1"),
])
def test_malformed_pending_tokens_are_invalid(
        change: Callable[[runner_pb2.ExecuteRequest], None], message: str) -> None:
    cache = RetryCache()
    cache.store("c", 1, runner_pb2.ExecuteResponse(token_ids=[42]))
    request = runner_pb2.ExecuteRequest(client_id="c", step_id=2, after_step_id=1,
                                        token_ids=[0], pending_token_indices=[0],
                                        pending_sample_rows=[0])
    change(request)
    with pytest.raises(BatchError, match=message):
        cache.fill_pending(request)


def test_pending_tokens_are_filled_and_cleared() -> None:
    cache = RetryCache()
    cache.store("c", 1, runner_pb2.ExecuteResponse(token_ids=[42, 43]))
    request = runner_pb2.ExecuteRequest(client_id="c", step_id=2, after_step_id=1,
                                        token_ids=[7, 0, 8, 0], pending_token_indices=[3, 1],
                                        pending_sample_rows=[0, 1])
    cache.fill_pending(request)
    assert list(request.token_ids) == [7, 43, 8, 42]
    assert not request.pending_token_indices and not request.pending_sample_rows
