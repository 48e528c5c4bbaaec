"""bench/control_plane.py counts and checks every Step (its quickest run of both servers, its
recording checked against the service's code in-process, a replayed answer compared in full);
bench/sim_runner.py answers Info and Execute as a runner does: deterministic tokens, pending
tokens from the step before, idempotent retries."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from bench import control_plane_load
from bench.control_plane import SERVERS
from bench.control_plane_load import BadAnswer, RunnerLoop, describe_difference, record
from bench.harness import free_port_run
from bench.sim_runner import CostModel, sim_token
from block_service.core import BlockServiceCore
from gateway.scheduler import OPERATION_ORDER
from protos import block_pb2, runner_pb2, runner_pb2_grpc
from tests.helpers.services import ServiceProcess

ROOT = Path(__file__).resolve().parents[2]


def test_quickest_run_of_both_servers_counts_steps_and_finds_every_answer_valid(
        tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "bench/control_plane.py", "--loops", "4", "--sweep-loops", "",
         "--floor-loops", "2", "--journal", "both", "--snapshot-every-records", "50",
         "--warm-s", "0.3", "--measure-s", "0.8", "--profile-steps", "20", "--routes", "20",
         "--settle-max-s", "0", "--results", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    data = json.loads((tmp_path / "control_plane.json").read_text())
    shapes = [(row["server"], row["loops"], row["batch"], row["journal"])
              for row in data["points"]]
    assert shapes == [(server, *shape) for server in SERVERS
                      for shape in [(4, 256, False), (4, 256, True), (2, 1, False)]]
    for row in data["points"]:
        assert row["bad_answers"] == 0, row["errors"]
        assert row["steps"] > 0 and not row["ran_out"]
        assert row["answers_checked"] > row["steps"]  # set-up and warm-up are checked too
        assert row["batch"] - 6 <= row["appends_per_step"] <= row["batch"]
        assert row["server_cpu_s"] > 0 and row["clients_cpu_s"] > 0
        if row["journal"]:  # 4 loops at 8 ms: ~500 records a second, one snapshot per 50
            assert row["snapshots"] > 0
    assert set(data["profile"]) == {"compiled", "compiled, journal", "Python",
                                    "Python, journal"}
    assert data["profile"]["compiled"]["steps"] == 20
    assert [row["server"] for row in data["routes"]] == list(SERVERS)
    assert all(row["cpu_us_per_route"] > 0 and row["last_cached_tokens"] > 0
               for row in data["routes"])
    text = (tmp_path / "control_plane.md").read_text()
    assert "Against the target" in text and "aio + compiled against threads + Python" in text


def in_process_loop() -> tuple[RunnerLoop, BlockServiceCore]:
    core = BlockServiceCore()
    loop = RunnerLoop(0, seed=1)
    core.create_pool(loop.pool_id, loop.pool_blocks, control_plane_load.BLOCK_SIZE, 1)
    loop.session_id, _ = core.open_session("test", 60_000)
    return loop, core


def step(core: BlockServiceCore, plan: control_plane_load.Plan) -> block_pb2.StepResponse:
    return block_pb2.StepResponse.FromString(core.step_wire(plan.request.SerializeToString()))


# Which of a plan's groups (gateway/scheduler.py OPERATION_ORDER) each operation kind is.
GROUP_OF_KIND = {block_pb2.OP_KIND_FREE: "frees", block_pb2.OP_KIND_COMMIT: "commits",
                 block_pb2.OP_KIND_FORK: "forks", block_pb2.OP_KIND_APPEND: "appends",
                 block_pb2.OP_KIND_ALLOCATE: "allocates"}


def test_loop_steps_check_out_against_the_service_through_frees_and_allocates() -> None:
    """...and each Step orders its operations as the gateway does."""
    loop, core = in_process_loop()
    appends = allocates = frees = 0
    kinds_seen: set[str] = set()
    for _ in range(300):
        plan = loop.plan_step()
        groups = [GROUP_OF_KIND[kind] for kind in plan.request.op_kinds]
        kinds_seen.update(groups)
        ranks = [OPERATION_ORDER.index(group) for group in groups]
        assert ranks == sorted(ranks), f"step {loop.step_id}: {groups}"
        loop.check(step(core, plan), plan)
        appends += len(plan.rows)
        allocates += len(plan.allocates)
        frees += len(plan.frees)
    assert allocates > 256 and frees == allocates - 256  # sequences were replaced
    assert appends > 290 * 250
    assert loop.checked == 300
    assert kinds_seen == {"frees", "appends", "allocates"}


def test_a_recording_replays_on_another_pool_and_session_with_the_same_answers() -> None:
    recording = record(control_plane_load.BATCH, seed=3, num_steps=40)
    assert recording.set_up == control_plane_load.ALLOCATE_STEPS + 1  # then every row appends
    assert sum(step.allocates for step in recording.steps) >= 256
    core = BlockServiceCore()  # the compiled path, another pool id and session
    core.create_pool("sim-r9", recording.batch * control_plane_load.BLOCKS_PER_SEQUENCE,
                     control_plane_load.BLOCK_SIZE, 1)
    session_id, _ = core.open_session("replay", 60_000)
    prefix = control_plane_load.header(session_id, "sim-r9")
    for recorded in recording.steps:
        assert core.step_wire(prefix + recorded.request) == recorded.answer
    assert core.stats("sim-r9").num_sequences == 256
    wrong = block_pb2.StepResponse.FromString(recording.steps[-1].answer)
    wrong.slot_mapping[0] += 1
    assert "slot_mapping" in describe_difference(wrong.SerializeToString(),
                                                 recording.steps[-1].answer)


@pytest.mark.parametrize("damage", ["slot", "status", "new block", "step id"])
def test_loop_check_refuses_a_wrong_answer(damage: str) -> None:
    loop, core = in_process_loop()
    for _ in range(20):  # past the set-up: decode Steps
        plan = loop.plan_step()
        loop.check(step(core, plan), plan)
    while True:  # a Step in which some position starts a new block
        plan = loop.plan_step()
        answer = step(core, plan)
        if any(answer.table_counts):
            break
        loop.check(answer, plan)
    if damage == "slot":
        answer.slot_mapping[7] += 1
    elif damage == "status":
        answer.op_statuses[3] = block_pb2.OP_STATUS_NO_SPACE
    elif damage == "new block":
        index = list(answer.table_counts).index(1)  # an APPEND's new block: give it one in use
        taken = next(iter(loop.in_use))
        shift = (answer.table_block_ids[0] - taken) * control_plane_load.BLOCK_SIZE
        answer.table_block_ids[0] = taken
        answer.slot_mapping[index - len(plan.frees)] -= shift
    else:
        answer.step_id += 1
    with pytest.raises(BadAnswer):
        loop.check(answer, plan)


def test_cost_model_scales_from_the_decode_step() -> None:
    model = CostModel()
    assert model.decode_step_s(256) == pytest.approx(0.008)
    half = CostModel.for_decode_step(0.004)
    assert half.step_time_s(100, 500) == pytest.approx(model.step_time_s(100, 500) / 2)
    assert CostModel.for_decode_step(0.0).step_time_s(256) == 0.0
    assert model.step_time_s(0, 0) == 0.0


def execute(row_tokens: list[list[int]], starts: list[int], step_id: int, epoch: int = 7,
            after_step_id: int = 0, pending: tuple[list[int], list[int]] = ([], []),
            ) -> runner_pb2.ExecuteRequest:
    """A batch of one row per entry of row_tokens; row 1 samples with seed 5."""
    rows = len(row_tokens)
    tables = [[10 + row] for row in range(rows)]
    slots = [tables[row][0] * 16 + starts[row] + k for row in range(rows)
             for k in range(len(row_tokens[row]))]
    return runner_pb2.ExecuteRequest(
        epoch=epoch, client_id="gateway-a", step_id=step_id, after_step_id=after_step_id,
        num_new_tokens=[len(tokens) for tokens in row_tokens], start_positions=starts,
        token_ids=[t for tokens in row_tokens for t in tokens], slot_mapping=slots,
        block_table_lens=[1] * rows, block_tables=[t for table in tables for t in table],
        do_sample=[True] * rows, temperatures=[0.0, 0.7][:rows], top_ps=[1.0] * rows,
        top_ks=[0] * rows, min_ps=[0.0] * rows, seeds=[0, 5][:rows],
        pending_token_indices=pending[0], pending_sample_rows=pending[1])


def test_sim_runner_answers_info_and_pending_steps_deterministically(tmp_path: Path) -> None:
    port = free_port_run(2)  # --count 2 serves on both
    service = ServiceProcess("bench.sim_runner", ["--count", "2", "--step-ms", "2",
                                                  "--epoch", "7"], port=port)
    service.start(tmp_path).wait_serving(60)
    second = ServiceProcess("bench.sim_runner", port=port + 1)
    second.process = service.process
    second.wait_serving(10)
    try:
        with grpc.insecure_channel(service.address) as channel, \
                grpc.insecure_channel(second.address) as other_channel:
            stub = runner_pb2_grpc.RunnerServiceStub(channel)
            info = stub.Info(runner_pb2.InfoRequest())
            assert (info.model, info.vocab_size, info.block_size, info.epoch, info.device) == \
                ("sim", 32000, 16, 7, "sim")
            assert list(info.eos_token_ids) == [2]

            # Step 1: two prompts. Step 2, sent "while 1 runs": each row's token is pending,
            # the one step 1 samples for it.
            first = stub.Execute(execute([[101, 102, 103], [201, 202]], [0, 0], 1))
            assert list(first.token_ids) == [sim_token(103, 3, None), sim_token(202, 2, 5)]
            assert min(first.token_ids) >= 16
            cost = CostModel.for_decode_step(0.002)
            assert first.forward_ms == pytest.approx(cost.step_time_s(0, 5) * 1e3, rel=1e-5)
            request = execute([[0], [0]], [3, 2], 2, after_step_id=1, pending=([0, 1], [0, 1]))
            second_step = stub.Execute(request)
            assert list(second_step.token_ids) == [sim_token(first.token_ids[0], 4, None),
                                                   sim_token(first.token_ids[1], 3, 5)]
            assert second_step.forward_ms == pytest.approx(cost.step_time_s(2) * 1e3, rel=1e-5)
            # A retry gets the first answer itself (its total_ms too): nothing ran again.
            assert stub.Execute(request) == second_step

            with pytest.raises(grpc.RpcError) as stale:
                stub.Execute(execute([[5]], [0], 3, epoch=8))
            assert stale.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            with pytest.raises(grpc.RpcError) as older:
                stub.Execute(execute([[5]], [9], 1))
            assert older.value.code() == grpc.StatusCode.INVALID_ARGUMENT

            # The second runner is another runner: same model, its own memory of clients.
            other = runner_pb2_grpc.RunnerServiceStub(other_channel)
            assert other.Info(runner_pb2.InfoRequest()).epoch == 7
            assert other.Execute(execute([[101, 102, 103]], [0], 1)).token_ids[0] == \
                first.token_ids[0]
            malformed_request = execute([[1], [2]], [5, 5], 2)
            malformed_request.ClearField("seeds")  # a column short
            with pytest.raises(grpc.RpcError) as malformed:
                other.Execute(malformed_request)
            assert malformed.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    finally:
        assert service.terminate() == 0
