"""Hostile input over real gRPC to the runner (its core in-process, a tiny model): Execute with
valid-shaped batches broken one field at a time, fully random batches, and raw bytes; Info.

Each call must end with a documented status: OK, INVALID_ARGUMENT (a batch that breaks the
contract, or bytes that do not parse) or FAILED_PRECONDITION (a stale epoch); never UNKNOWN
or INTERNAL. After every refused batch the KV cache is bit-identical to before, and the
runner still computes right afterwards. PAGEWIRE_FUZZ_EXAMPLES raises the counts.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import DecodeError
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from common.server import ServerOptions, start_server
from gpu_runner.runner import ModelRunner
from gpu_runner.servicer import SERVICE_NAME, RunnerServicer, register_handlers
from protos import runner_pb2, runner_pb2_grpc
from tests.gpu_runner.conftest import make_runner
from tests.helpers.paged_driver import PagedDriver, batch_to_proto
from tests.helpers.tiny_models import make_tiny_model

EXAMPLES = int(os.environ.get("PAGEWIRE_FUZZ_EXAMPLES", "2000"))
C = grpc.StatusCode
ALLOWED = {C.OK, C.INVALID_ARGUMENT, C.FAILED_PRECONDITION}
EXECUTE = f"/{SERVICE_NAME}/Execute"
INT_COLUMNS = ("num_new_tokens", "start_positions", "token_ids", "slot_mapping",
               "block_table_lens", "block_tables", "top_ks", "num_logprobs",
               "copy_src_block_ids", "copy_dst_block_ids")
FLOAT_COLUMNS = ("temperatures", "top_ps", "min_ps")


@dataclass
class Served:
    runner: ModelRunner
    stub: runner_pb2_grpc.RunnerServiceStub
    channel: grpc.Channel
    info: runner_pb2.InfoResponse
    bases: list[runner_pb2.ExecuteRequest]


def fuzz_settings(share: float) -> settings:
    return settings(max_examples=max(1, int(EXAMPLES * share)), deadline=None, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def _base_requests(info: runner_pb2.InfoResponse) -> list[runner_pb2.ExecuteRequest]:
    """Well-formed batches: two prompts; a decode step after them; a forked child that
    copies its shared last block before writing (copy-on-write)."""
    driver = PagedDriver(lambda batch: np.zeros(0), info.block_size, info.num_blocks)
    driver.epoch = info.epoch
    first, second = driver.add(list(range(5, 25))), driver.add([7, 8, 9])
    prompts, _ = driver.build([first, second])
    first.tokens.append(40)
    second.tokens.append(41)
    decode, _ = driver.build([first, second])
    child = driver.fork(second)
    child.tokens.append(42)
    fork, _ = driver.build([child])
    return [batch_to_proto(batch) for batch in (prompts, decode, fork)]  # type: ignore[misc]


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    model = make_tiny_model("qwen2", tmp_path_factory.mktemp("fuzz_model") / "qwen2", seed=3)
    runner = make_runner(Path(model), block_size=8, cache_bytes=1 << 20, max_model_len=128)
    servicer = RunnerServicer(runner)
    service = start_server(
        ServerOptions(port=0),
        lambda server: server.add_generic_rpc_handlers((register_handlers(servicer),)),
        [SERVICE_NAME])
    channel = grpc.insecure_channel(f"127.0.0.1:{service.port}")
    stub = runner_pb2_grpc.RunnerServiceStub(channel)
    info = stub.Info(runner_pb2.InfoRequest())
    yield Served(runner, stub, channel, info, _base_requests(info))
    # Still computing right: the same prompt batch gives the same greedy tokens twice.
    again = runner_pb2.ExecuteRequest()
    again.CopyFrom(_base_requests(info)[0])
    assert list(stub.Execute(again).token_ids) == list(stub.Execute(again).token_ids)
    channel.close()
    service.stop(0)


def kv_bytes(runner: ModelRunner) -> torch.Tensor:
    return runner.kv_cache.detach().clone().contiguous().view(torch.uint8)


def call_keeps_kv_on_refusal(served: Served, call: object) -> grpc.StatusCode:
    before = kv_bytes(served.runner)
    try:
        call()  # type: ignore[operator]
    except grpc.RpcError as error:
        assert error.code() in ALLOWED, f"{error.code()}: {error.details()}"
        assert torch.equal(kv_bytes(served.runner), before), f"KV changed by {error.details()}"
        event(error.code().name)
        return error.code()
    event("OK")
    return C.OK


HOSTILE_INTS = st.one_of(
    st.sampled_from([-1, 0, 1, 7, 8, 9, 15, 16, 127, 128, 49151, 49152, 2**31 - 1, -(2**31),
                     2**63 - 1, -(2**63)]),
    st.integers(-(2**63), 2**63 - 1), st.integers(-3, 300))
HOSTILE_FLOATS = st.one_of(st.sampled_from([math.nan, math.inf, -math.inf, -0.0, 0.0, 1.0,
                                            -1.0, 1e-45, 3.4e38]),
                           st.floats(width=32))


_RANGES = {  # the proto's integer types
    "int32": (-(2**31), 2**31 - 1), "int64": (-(2**63), 2**63 - 1),
    "uint32": (0, 2**32 - 1), "uint64": (0, 2**64 - 1),
}
_TYPE_NAMES = {FieldDescriptor.TYPE_INT32: "int32", FieldDescriptor.TYPE_INT64: "int64",
               FieldDescriptor.TYPE_UINT32: "uint32", FieldDescriptor.TYPE_UINT64: "uint64"}


def fit(column: str, value: int) -> int:
    """`value` clamped into the column's proto type (the wire can carry nothing else)."""
    field = runner_pb2.ExecuteRequest.DESCRIPTOR.fields_by_name[column]
    low, high = _RANGES[_TYPE_NAMES[field.type]]
    return max(low, min(high, value))


@st.composite
def mutation(draw: st.DrawFn, request: runner_pb2.ExecuteRequest) -> None:
    """Breaks one thing of `request` in place."""
    kind = draw(st.sampled_from(["set", "append", "drop", "clear", "epoch", "seed",
                                 "do_sample"]))
    if kind == "epoch":
        request.epoch = draw(st.integers(0, 2**64 - 1))
        return
    if kind == "seed":
        request.seeds[:] = draw(st.lists(st.integers(0, 2**64 - 1), max_size=4))
        return
    if kind == "do_sample":
        request.do_sample[:] = draw(st.lists(st.booleans(), max_size=4))
        return
    column = draw(st.sampled_from(INT_COLUMNS + FLOAT_COLUMNS))
    values = getattr(request, column)
    if column in FLOAT_COLUMNS:
        value: float = draw(HOSTILE_FLOATS)
    else:
        value = fit(column, draw(HOSTILE_INTS))
    if kind == "set" and len(values):
        values[draw(st.integers(0, len(values) - 1))] = value
    elif kind == "append":
        values.append(value)
    elif kind == "drop" and len(values):
        del values[draw(st.integers(0, len(values) - 1))]
    elif kind == "clear":
        del values[:]


@fuzz_settings(0.55)
@given(data=st.data())
def test_execute_with_broken_batches(served: Served, data: st.DataObject) -> None:
    request = runner_pb2.ExecuteRequest()
    request.CopyFrom(data.draw(st.sampled_from(served.bases)))
    request.client_id = "fuzz"
    request.step_id = data.draw(st.integers(0, 2**64 - 1))
    for _ in range(data.draw(st.integers(1, 3))):
        data.draw(mutation(request))
    call_keeps_kv_on_refusal(served, lambda: served.stub.Execute(request, timeout=60))


@fuzz_settings(0.15)
@given(data=st.data())
def test_execute_with_random_batches(served: Served, data: st.DataObject) -> None:
    request = runner_pb2.ExecuteRequest(epoch=served.info.epoch)
    for column in ("num_new_tokens", "block_table_lens", "top_ks", "num_logprobs"):
        values = data.draw(st.lists(st.integers(-2, 40), max_size=4))
        getattr(request, column).extend(fit(column, v) for v in values)
    for column in ("start_positions", "token_ids", "slot_mapping", "block_tables",
                   "copy_src_block_ids", "copy_dst_block_ids"):
        values = data.draw(st.lists(st.integers(-2, 300), max_size=40))
        getattr(request, column).extend(fit(column, v) for v in values)
    for column in FLOAT_COLUMNS:
        getattr(request, column).extend(data.draw(st.lists(HOSTILE_FLOATS, max_size=4)))
    request.do_sample.extend(data.draw(st.lists(st.booleans(), max_size=4)))
    request.seeds.extend(data.draw(st.lists(st.integers(0, 2**64 - 1), max_size=4)))
    call_keeps_kv_on_refusal(served, lambda: served.stub.Execute(request, timeout=60))


@fuzz_settings(0.05)
@given(epoch=st.integers(0, 2**64 - 1), base=st.integers(0, 2))
def test_stale_epochs_are_failed_precondition(served: Served, epoch: int, base: int) -> None:
    request = runner_pb2.ExecuteRequest()
    request.CopyFrom(served.bases[base])
    request.epoch = epoch
    code = call_keeps_kv_on_refusal(served, lambda: served.stub.Execute(request, timeout=60))
    if epoch != served.info.epoch:
        assert code == C.FAILED_PRECONDITION


def _raw(served: Served, method: str) -> object:
    return served.channel.unary_unary(f"/{SERVICE_NAME}/{method}",
                                      request_serializer=lambda b: b,
                                      response_deserializer=lambda b: b)


@fuzz_settings(0.25)
@given(method=st.sampled_from(["Execute", "Info"]),
       data=st.one_of(st.binary(max_size=200),
                      st.binary(max_size=200).map(lambda b: b"\x3a\x04" + b)))
def test_raw_bytes_as_requests(served: Served, method: str, data: bytes) -> None:
    """Random bytes: where they parse, the message meets the same rules as any other; where
    they do not, the runner answers gRPC's own INTERNAL "Exception deserializing request!"
    today (the regression test below wants INVALID_ARGUMENT) and keeps serving."""
    request_class = runner_pb2.ExecuteRequest if method == "Execute" else runner_pb2.InfoRequest
    try:
        request_class.FromString(data)
    except DecodeError:
        call = _raw(served, method)
        with pytest.raises(grpc.RpcError) as error:
            call(data, timeout=60)  # type: ignore[operator]
        assert error.value.code() in {C.INTERNAL, C.INVALID_ARGUMENT}
        event("does not parse")
        return
    call = _raw(served, method)
    call_keeps_kv_on_refusal(served, lambda: call(data, timeout=60))  # type: ignore[operator]


@pytest.mark.parametrize("method", ["Execute", "Info"])
def test_unparsable_bytes_are_invalid_argument(served: Served, method: str) -> None:
    call = _raw(served, method)
    with pytest.raises(grpc.RpcError) as error:
        # Execute: client_id (field 2) holding invalid UTF-8; Info: a truncated tag.
        call(b"\x12\x02\xc3\x28" if method == "Execute" else b"\xff\xff",  # type: ignore
             timeout=10)
    assert error.value.code() == C.INVALID_ARGUMENT
