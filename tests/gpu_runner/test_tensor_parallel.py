"""Tensor parallelism end to end on CPU (gloo): real `python -m gpu_runner` processes with
--tensor-parallel-size 1 and 2, driven over gRPC, must produce transformers' greedy tokens;
a killed worker must take the runner's health to NOT_SERVING.
"""

from __future__ import annotations

import os
import re
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2

from gpu_runner.batch import ExecuteBatch
from gpu_runner.distributed import ShardSpec, TensorParallelError, check_tensor_parallel
from protos import runner_pb2, runner_pb2_grpc
from tests.gpu_runner.conftest import load_oracle
from tests.helpers.paged_driver import PagedDriver, batch_to_proto
from tests.helpers.services import ServiceProcess, health_status, pid_alive

BLOCK_SIZE = 16
STEPS = 5
PROMPT_LENGTHS = (7, 23, 40, 12)
ARCHS = ("qwen2", "qwen3")


def _runner(folder: Path, tp: int) -> ServiceProcess:
    return ServiceProcess("gpu_runner", [
        "--model", str(folder), "--block-size", str(BLOCK_SIZE),
        "--kv-cache-memory", str(4 << 20), "--max-model-len", "256", "--num-threads", "1",
        "--tensor-parallel-size", str(tp)])


@pytest.fixture(scope="module")
def runners(tiny_model_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[dict[tuple[str, int], ServiceProcess]]:
    """TP 1 and TP 2 runners per arch, plus spare TP 2 ones to kill a worker of ("kill", 2)
    and to stop ("stop", 2)."""
    log_dir = tmp_path_factory.mktemp("tp_logs")
    wanted = [(arch, tp) for arch in ARCHS for tp in (1, 2)] + [("kill", 2), ("stop", 2)]
    processes = {}
    try:
        for arch, tp in wanted:
            folder = tiny_model_dirs.get(arch, tiny_model_dirs["qwen3"])
            processes[(arch, tp)] = _runner(folder, tp).start(log_dir)
        for process in processes.values():
            process.wait_serving(180)
        yield processes
    finally:
        for process in processes.values():
            process.kill()


def _prompts() -> list[list[int]]:
    rng = np.random.default_rng(3)
    return [rng.integers(3, 1000, size=n).tolist() for n in PROMPT_LENGTHS]


def _generate_over_grpc(process: ServiceProcess, prompts: list[list[int]]) -> list[list[int]]:
    with grpc.insecure_channel(process.address) as channel:
        stub = runner_pb2_grpc.RunnerServiceStub(channel)
        info = stub.Info(runner_pb2.InfoRequest(), timeout=10)

        def execute(batch: ExecuteBatch) -> np.ndarray:
            reply = stub.Execute(batch_to_proto(batch), timeout=60)
            return np.asarray(reply.token_ids, dtype=np.int64)

        driver = PagedDriver(execute, info.block_size, info.num_blocks)
        driver.epoch = info.epoch
        # Staggered: batches mix prompts joining with sequences already decoding.
        return [seq.generated for seq in driver.run_staggered(prompts, STEPS)]


def _info(process: ServiceProcess) -> runner_pb2.InfoResponse:
    with grpc.insecure_channel(process.address) as channel:
        return runner_pb2_grpc.RunnerServiceStub(channel).Info(runner_pb2.InfoRequest(),
                                                                timeout=10)


@pytest.mark.parametrize("arch", ARCHS)
def test_tensor_parallel_2_gives_transformers_greedy_tokens(
    runners: dict, tiny_model_dirs: dict[str, Path], arch: str
) -> None:
    prompts = _prompts()
    oracle = load_oracle(tiny_model_dirs[arch])
    expected = [oracle.generate(prompt, STEPS)[0] for prompt in prompts]
    single = _generate_over_grpc(runners[(arch, 1)], prompts)
    split = _generate_over_grpc(runners[(arch, 2)], prompts)
    assert single == expected
    assert split == expected


def test_info_reports_tensor_parallel_size(runners: dict) -> None:
    assert _info(runners[("qwen3", 1)]).tensor_parallel_size == 1
    info = _info(runners[("qwen3", 2)])
    assert info.tensor_parallel_size == 2
    # Blocks are counted per rank: each holds half the KV heads, so twice as many fit.
    assert info.num_blocks == 2 * _info(runners[("qwen3", 1)]).num_blocks


def _worker_pid(process: ServiceProcess) -> int:
    match = re.search(r"tensor-parallel worker rank 1 started \(pid (\d+)\)", process.log())
    assert match, process.log()
    return int(match.group(1))


def test_killed_worker_turns_health_not_serving(runners: dict) -> None:
    process = runners[("kill", 2)]
    assert health_status(process.address) == health_pb2.HealthCheckResponse.SERVING
    os.kill(_worker_pid(process), signal.SIGKILL)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if health_status(process.address) == health_pb2.HealthCheckResponse.NOT_SERVING:
            break
        time.sleep(0.1)
    assert health_status(process.address) == health_pb2.HealthCheckResponse.NOT_SERVING
    with grpc.insecure_channel(process.address) as channel, pytest.raises(grpc.RpcError) as error:
        stub = runner_pb2_grpc.RunnerServiceStub(channel)
        info = stub.Info(runner_pb2.InfoRequest(), timeout=10)
        stub.Execute(runner_pb2.ExecuteRequest(epoch=info.epoch), timeout=10)
    assert error.value.code() == grpc.StatusCode.UNAVAILABLE


def test_stopping_the_runner_stops_its_workers(runners: dict) -> None:
    process = runners[("stop", 2)]
    worker = _worker_pid(process)
    assert pid_alive(worker)
    assert process.terminate(timeout_s=30) == 0
    deadline = time.monotonic() + 15
    while pid_alive(worker) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not pid_alive(worker)


# ---- shape rules (no processes) ----


def test_kv_heads_must_divide_by_tp(tiny_model_dirs: dict[str, Path]) -> None:
    from gpu_runner.config import load_model_config

    config = load_model_config(tiny_model_dirs["qwen3"])  # 2 kv heads
    check_tensor_parallel(config, 2)
    with pytest.raises(TensorParallelError, match=r"num_key_value_heads \(2\)"):
        check_tensor_parallel(config, 4)


def test_vocab_shards_cover_the_vocabulary_once() -> None:
    ranges = [ShardSpec(rank, 3).vocab_range(10) for rank in range(3)]
    assert ranges == [(0, 4), (4, 8), (8, 10)]
    assert ShardSpec(0, 3).vocab_shard_rows(10) == 4
