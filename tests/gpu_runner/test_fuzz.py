"""Hostile input over real gRPC to the runner (its core in-process, a tiny model): Execute with
valid-shaped batches broken one field at a time, fully random batches, stale epochs, and raw
bytes; Info.

Each call must end with a documented status: OK, INVALID_ARGUMENT (a batch that breaks the
contract, or bytes that do not parse) or FAILED_PRECONDITION (a stale epoch); never UNKNOWN
or INTERNAL, whatever the input. After every refused batch the KV cache is bit-identical to
before. Each fuzz test checks that it ran every example its settings allow, and the message
fuzzes that (nearly) every example reached the batch validator, so that a strategy refused
earlier (a stale step, another epoch) cannot pass for a test of the validator. The last test
runs greedy decoding through Execute on the runner the fuzz has hammered and compares it
with transformers. PAGEWIRE_FUZZ_EXAMPLES raises the counts.
"""

from __future__ import annotations

import itertools
import math
import os
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import DecodeError
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import gpu_runner.sampler as sampler_module
import gpu_runner.servicer as servicer_module
from common.server import ServerOptions, start_server
from gpu_runner.batch import BatchLimits, ExecuteBatch, validate_batch
from gpu_runner.penalties import PenaltyTensors, penalised
from gpu_runner.runner import ModelRunner
from gpu_runner.servicer import SERVICE_NAME, RunnerServicer, register_handlers
from protos import runner_pb2, runner_pb2_grpc
from tests.gpu_runner.conftest import load_oracle, make_runner
from tests.helpers.paged_driver import (
    PagedDriver,
    Penalties,
    Seq,
    batch_to_proto,
    with_penalties,
)
from tests.helpers.tiny_models import make_tiny_model

EXAMPLES = int(os.environ.get("PAGEWIRE_FUZZ_EXAMPLES", "2000"))
C = grpc.StatusCode
ALLOWED = {C.OK, C.INVALID_ARGUMENT, C.FAILED_PRECONDITION}
# Share of a message fuzz's examples that must reach validate_batch. Every example of both
# message fuzzes is built to (fresh client id, the runner's epoch, no after_step_id), so 100 %
# is what they do; the margin leaves room for a mutation kind that is refused earlier.
VALIDATED_SHARE = 0.9
INT_COLUMNS = ("num_new_tokens", "start_positions", "token_ids", "slot_mapping",
               "block_table_lens", "block_tables", "top_ks", "num_logprobs",
               "copy_src_block_ids", "copy_dst_block_ids", "prompt_lens",
               "penalty_history_lens", "penalty_token_ids", "logit_bias_counts",
               "logit_bias_token_ids")
FLOAT_COLUMNS = ("temperatures", "top_ps", "min_ps", "presence_penalties",
                 "frequency_penalties", "repetition_penalties", "logit_bias_values")
# Share of the broken-batch fuzz's examples that must reach the penalty checks (a base with
# penalty columns, 1 in 4 of the bases, or a mutation that adds a column) and the penalty
# code itself (a penalised base whose mutations left it valid); measured 0.38 and 0.04.
PENALTY_VALIDATED_SHARE = 0.15
PENALTY_APPLIED_SHARE = 0.005


def fuzz_examples(share: float) -> int:
    return max(1, int(EXAMPLES * share))


BROKEN_EXAMPLES = fuzz_examples(0.50)
PENALTY_EXAMPLES = fuzz_examples(0.05)
RANDOM_EXAMPLES = fuzz_examples(0.15)
STALE_EXAMPLES = fuzz_examples(0.05)
RAW_EXAMPLES = fuzz_examples(0.25)


@dataclass
class Served:
    model: Path
    runner: ModelRunner
    stub: runner_pb2_grpc.RunnerServiceStub
    channel: grpc.Channel
    info: runner_pb2.InfoResponse
    bases: list[runner_pb2.ExecuteRequest]
    # Calls of the servicer's validate_batch (wrapped by the fixture). It runs in the batch's
    # turn, before Execute answers, so a test reads it safely once its call returned.
    validations: int = 0
    # Of those, the batches with a penalty or logit-bias column; and the sampler's calls of
    # penalised (batches that got past the validator and use them).
    penalty_validations: int = 0
    penalty_applications: int = 0


def fuzz_settings(max_examples: int) -> settings:
    return settings(max_examples=max_examples, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


# A client id per batch: the retry cache refuses a step id below its client's last one before
# the validator runs, so one shared id with random step ids would test the retry cache instead.
_CLIENT_IDS = (f"fuzz-{n}" for n in itertools.count())


def _base_requests(info: runner_pb2.InfoResponse) -> list[runner_pb2.ExecuteRequest]:
    """Well-formed batches: two prompts; a decode step after them; a forked child that
    copies its shared last block before writing (copy-on-write); the decode step again with
    penalties and logit bias."""
    driver = PagedDriver(lambda batch: np.zeros(0), info.block_size, info.num_blocks)
    driver.epoch = info.epoch
    first, second = driver.add(list(range(5, 25))), driver.add([7, 8, 9])
    prompts, _ = driver.build([first, second])
    first.tokens.append(40)
    second.tokens.append(41)
    decode, _ = driver.build([first, second])
    penalised = with_penalties(decode, [first, second], PENALISED)
    child = driver.fork(second)
    child.tokens.append(42)
    fork, _ = driver.build([child])
    return [batch_to_proto(batch)  # type: ignore[misc]
            for batch in (prompts, decode, fork, penalised)]


PENALISED = [Penalties(0.5, 0.3, 1.2, {3: 1.0}), Penalties(0.1, bias={7: -2.0, 9: 100.0})]


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
    served = Served(Path(model), runner, stub, channel, info, _base_requests(info))

    def counting_validate(batch: ExecuteBatch, limits: BatchLimits) -> None:
        served.validations += 1
        served.penalty_validations += bool(batch.has_penalties or batch.logit_bias_counts.size)
        validate_batch(batch, limits)

    def counting_penalised(logits: torch.Tensor,
                           penalties: PenaltyTensors) -> AbstractContextManager[None]:
        served.penalty_applications += 1
        return penalised(logits, penalties)

    # The servicer validates each client's batch in its turn (after the epoch check and the
    # retry memory; the runner validates the merged forward again) through its module's
    # name: counting there sees exactly the batches that got past the rest.
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(servicer_module, "validate_batch", counting_validate)
        patch.setattr(sampler_module, "penalised", counting_penalised)
        yield served
    channel.close()
    service.stop(0)


def kv_bytes(runner: ModelRunner) -> torch.Tensor:
    """The KV cache seen as bytes (no copy): compared bit for bit, NaN equals NaN."""
    return runner.kv_cache.detach().contiguous().view(torch.uint8)


@dataclass
class Tally:
    """What one fuzz test's examples did: how many ran to their end, how many of those reached
    the batch validator, and their statuses (shown when a count falls short)."""

    examples: int = 0
    validated: int = 0
    codes: Counter[str] = field(default_factory=Counter)
    # The KV cache's bytes as this test's last accepted call left them (None: take them anew).
    # Kept across refusals, which must not change them: copying the cache before every call
    # cost a few ms an example, more than the call itself.
    kv: torch.Tensor | None = None

    def call(self, served: Served, call: Callable[[], object]) -> grpc.StatusCode:
        """Runs one example's call and counts it. Its status must be an allowed one, and a
        refusal must leave the KV cache bit for bit as it was."""
        kv = self.kv = kv_bytes(served.runner).clone() if self.kv is None else self.kv
        before = served.validations
        try:
            call()
            code = C.OK
            self.kv = None  # an executed batch writes the cache
        except grpc.RpcError as error:
            code = error.code()
            assert code in ALLOWED, f"{code}: {error.details()}"
            assert torch.equal(kv_bytes(served.runner), kv), (
                f"KV changed by {error.details()}")
        self.examples += 1
        self.validated += served.validations > before
        self.codes[code.name] += 1
        return code

    def assert_ran(self, max_examples: int, validated_share: float = 0.0) -> None:
        # Hypothesis runs max_examples valid examples unless it exhausts a strategy, and none
        # of these can be exhausted; examples it abandons mid-draw (too much data, a rejected
        # float) never reach `call`, and it draws new ones in their place.
        assert self.examples == max_examples, (
            f"{self.examples} examples ran, settings allow {max_examples}: {dict(self.codes)}")
        assert self.validated >= validated_share * self.examples, (
            f"only {self.validated} of {self.examples} examples reached validate_batch: "
            f"{dict(self.codes)}")


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
    """Breaks one thing of `request` in place. Never its epoch: a stale epoch is refused
    before the validator (test_stale_epochs_are_failed_precondition covers it), and here it
    took about a quarter of the examples away from the validator."""
    kind = draw(st.sampled_from(["set", "append", "drop", "clear", "seed", "do_sample"]))
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


def test_execute_with_broken_batches(served: Served) -> None:
    tally = Tally()

    @fuzz_settings(BROKEN_EXAMPLES)
    @given(data=st.data())
    def example(data: st.DataObject) -> None:
        request = runner_pb2.ExecuteRequest()
        request.CopyFrom(data.draw(st.sampled_from(served.bases)))
        request.client_id = next(_CLIENT_IDS)
        request.step_id = data.draw(st.integers(0, 2**64 - 1))
        for _ in range(data.draw(st.integers(1, 3))):
            data.draw(mutation(request))
        tally.call(served, lambda: served.stub.Execute(request, timeout=60))

    before = (served.penalty_validations, served.penalty_applications)
    example()
    tally.assert_ran(BROKEN_EXAMPLES, VALIDATED_SHARE)
    checked = served.penalty_validations - before[0]
    applied = served.penalty_applications - before[1]
    assert checked >= PENALTY_VALIDATED_SHARE * BROKEN_EXAMPLES, (
        f"only {checked} of {BROKEN_EXAMPLES} examples reached the penalty checks")
    assert applied >= max(1, PENALTY_APPLIED_SHARE * BROKEN_EXAMPLES), (
        f"only {applied} of {BROKEN_EXAMPLES} examples reached the penalty code")


PENALTY_FLOATS = st.one_of(st.sampled_from([0.0, -0.0, 1.0, -2.0, 2.0, 1e-30, 3.4e38]),
                           st.floats(-5, 5, width=32))


def test_execute_with_valid_random_penalties(served: Served) -> None:
    """Valid but extreme penalties and biases on the penalised decode: always OK, a token in
    the vocabulary, and every example reaches the penalty code."""
    tally = Tally()
    base = served.bases[3]
    vocab = served.info.vocab_size

    @fuzz_settings(PENALTY_EXAMPLES)
    @given(data=st.data())
    def example(data: st.DataObject) -> None:
        request = runner_pb2.ExecuteRequest()
        request.CopyFrom(base)
        request.client_id = next(_CLIENT_IDS)
        request.presence_penalties[:] = data.draw(st.lists(PENALTY_FLOATS, min_size=2,
                                                           max_size=2))
        request.frequency_penalties[:] = data.draw(st.lists(PENALTY_FLOATS, min_size=2,
                                                            max_size=2))
        request.repetition_penalties[:] = data.draw(st.lists(
            st.floats(float(np.float32(1e-3)), 4, width=32), min_size=2, max_size=2))
        request.temperatures[:] = data.draw(st.lists(st.sampled_from([0.0, 0.7, 1.5]),
                                                     min_size=2, max_size=2))
        ids = data.draw(st.lists(st.integers(0, vocab - 1), max_size=6, unique=True))
        split = data.draw(st.integers(0, len(ids)))
        request.logit_bias_counts[:] = [split, len(ids) - split]
        request.logit_bias_token_ids[:] = ids
        request.logit_bias_values[:] = data.draw(st.lists(
            st.floats(-1e4, 1e4, width=32), min_size=len(ids), max_size=len(ids)))
        answers: list[runner_pb2.ExecuteResponse] = []
        code = tally.call(served, lambda: answers.append(served.stub.Execute(request,
                                                                             timeout=60)))
        assert code == C.OK
        assert all(0 <= t < vocab for t in answers[0].token_ids)

    before = served.penalty_applications
    example()
    tally.assert_ran(PENALTY_EXAMPLES, validated_share=1.0)
    assert served.penalty_applications - before == PENALTY_EXAMPLES


def test_execute_with_random_batches(served: Served) -> None:
    tally = Tally()

    @fuzz_settings(RANDOM_EXAMPLES)
    @given(data=st.data())
    def example(data: st.DataObject) -> None:
        # No client id: nothing is remembered, so the retry cache cannot refuse it first.
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
        tally.call(served, lambda: served.stub.Execute(request, timeout=60))

    example()
    tally.assert_ran(RANDOM_EXAMPLES, VALIDATED_SHARE)


def test_stale_epochs_are_failed_precondition(served: Served) -> None:
    # The epoch check comes before the validator: these examples are not meant to reach it.
    tally = Tally()

    @fuzz_settings(STALE_EXAMPLES)
    @given(epoch=st.integers(0, 2**64 - 1), base=st.integers(0, 2))
    def example(epoch: int, base: int) -> None:
        request = runner_pb2.ExecuteRequest()
        request.CopyFrom(served.bases[base])
        request.epoch = epoch
        code = tally.call(served, lambda: served.stub.Execute(request, timeout=60))
        if epoch != served.info.epoch:
            assert code == C.FAILED_PRECONDITION

    example()
    tally.assert_ran(STALE_EXAMPLES)


def _raw(served: Served, method: str) -> Callable[..., bytes]:
    return served.channel.unary_unary(
        f"/{SERVICE_NAME}/{method}",
        request_serializer=lambda b: b,
        response_deserializer=lambda b: b)


def test_raw_bytes_as_requests(served: Served) -> None:
    """Random bytes: where they parse, the message meets the same rules as any other; where
    they do not, the answer is INVALID_ARGUMENT (not gRPC's own INTERNAL "Exception
    deserializing request!") and the runner keeps serving."""
    tally = Tally()

    @fuzz_settings(RAW_EXAMPLES)
    @given(method=st.sampled_from(["Execute", "Info"]),
           data=st.one_of(st.binary(max_size=200),
                          # 0x3a: start_positions (field 7), packed, 4 bytes long.
                          st.binary(max_size=200).map(lambda b: b"\x3a\x04" + b)))
    def example(method: str, data: bytes) -> None:
        request_class = (runner_pb2.ExecuteRequest if method == "Execute"
                         else runner_pb2.InfoRequest)
        try:
            request_class.FromString(data)
            parses = True
        except DecodeError:
            parses = False
        call = _raw(served, method)
        code = tally.call(served, lambda: call(data, timeout=60))
        if not parses:
            assert code == C.INVALID_ARGUMENT

    example()
    tally.assert_ran(RAW_EXAMPLES)


@pytest.mark.parametrize("method", ["Execute", "Info"])
def test_unparsable_bytes_are_invalid_argument(served: Served, method: str) -> None:
    call = _raw(served, method)
    with pytest.raises(grpc.RpcError) as error:
        # Execute: client_id (field 2) holding invalid UTF-8; Info: a truncated tag.
        call(b"\x12\x02\xc3\x28" if method == "Execute" else b"\xff\xff", timeout=10)
    assert error.value.code() == C.INVALID_ARGUMENT


ORACLE_PROMPTS = ([11, 300, 4100, 77, 9000, 12, 5, 48000, 600, 31, 7],  # 11: two blocks of 8
                  [7, 8, 9, 4000, 30000, 15, 16, 17, 901, 49000, 3, 44, 45],  # 13
                  list(range(1000, 20000, 1000)))  # 19: prefilled in two chunks
ORACLE_STEPS = 6
LOGPROB_ATOL = 1e-4


def test_after_the_fuzz_decoding_matches_transformers(served: Served) -> None:
    """Last in the file, so that it runs on the runner the fuzz has hammered: greedy decoding
    through Execute (mixed prefill and decode batches, a chunked prefill, a fork whose first
    write copies its shared block) gives transformers' greedy tokens, and each sampled token's
    logprob is transformers' to LOGPROB_ATOL."""
    client_id, step_ids = next(_CLIENT_IDS), itertools.count(1)
    answers: list[runner_pb2.ExecuteResponse] = []
    copies = 0

    def execute(batch: ExecuteBatch) -> np.ndarray:
        nonlocal copies
        copies += len(batch.copy_src_block_ids)
        request: runner_pb2.ExecuteRequest = batch_to_proto(batch)  # type: ignore[assignment]
        request.client_id, request.step_id = client_id, next(step_ids)
        request.num_logprobs[:] = [0] * batch.num_seqs  # the sampled token's logprob only
        answers.append(served.stub.Execute(request, timeout=60))
        return np.asarray(answers[-1].token_ids)

    driver = PagedDriver(execute, served.info.block_size, served.info.num_blocks)
    driver.epoch = served.info.epoch
    # (sequence, position of a sampled token, the runner's logprob of it)
    sampled: list[tuple[Seq, int, float]] = []

    def step(seqs: list[Seq], chunk: dict[int, int] | None = None) -> None:
        for seq, logprob in zip(driver.step(seqs, chunk), answers[-1].logprobs, strict=True):
            sampled.append((seq, len(seq.tokens) - 1, logprob))

    first, second, third = (driver.add(prompt) for prompt in ORACLE_PROMPTS)
    step([first, second])  # two prefills
    step([first, second, third], chunk={2: 8})  # two decodes and a first prefill chunk
    child = driver.fork(second)  # shares second's blocks, its last one partly filled
    seqs = [first, second, third, child]
    while active := [seq for seq in seqs if len(seq.generated) < ORACLE_STEPS]:
        step(active)
    assert copies == 1, f"{copies} block copies; the fork was to make one"

    oracle = load_oracle(served.model)
    for seq, prompt in zip(seqs, [*ORACLE_PROMPTS, ORACLE_PROMPTS[1]], strict=True):
        assert seq.generated == oracle.generate(prompt, ORACLE_STEPS)[0], f"prompt {prompt}"
    with torch.inference_mode():
        expected = {id(seq): torch.log_softmax(
            oracle.model(torch.tensor([seq.tokens])).logits[0].float(), dim=-1)
            for seq in seqs}
    for seq, position, logprob in sampled:
        reference = float(expected[id(seq)][position - 1, seq.tokens[position]])
        assert logprob == pytest.approx(reference, abs=LOGPROB_ATOL), (seq.tokens, position)
