"""Token masks (structured output) in the runner: the sampler samples only allowed tokens,
for every sampling mode, and leaves logprobs raw; masks inline or late (SupplyMasks), merged
batches, and a batch whose late masks never come failing alone."""

from __future__ import annotations

import random
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest
import torch

from gpu_runner.masks import MaskBoard, MissingMasks, check_masks, words_per_row
from gpu_runner.merging import merge_requests
from gpu_runner.runner import ModelRunner
from gpu_runner.sampler import TokenMasks, sample, unpack_masks
from gpu_runner.servicer import RunnerServicer
from protos import runner_pb2, runner_pb2_grpc
from tests.gpu_runner.test_sampler import fixed_logits, make_params
from tests.gpu_runner.test_servicer import (  # noqa: F401
    _one_prompt_request,
    runner,
    serve_stub,
)


@pytest.fixture(scope="module")
def servicer(runner: ModelRunner) -> RunnerServicer:  # noqa: F811
    return RunnerServicer(runner)


@pytest.fixture(scope="module")
def stub(servicer: RunnerServicer) -> Iterator[runner_pb2_grpc.RunnerServiceStub]:
    yield from serve_stub(servicer)


def pack(allowed: np.ndarray) -> bytes:
    """bool [rows, vocab] -> runner.proto's packed rows."""
    rows, vocab = allowed.shape
    padded = np.zeros((rows, words_per_row(vocab) * 32), dtype=np.uint8)
    padded[:, :vocab] = allowed
    return np.packbits(padded, axis=1, bitorder="little").tobytes()


def random_allowed(rng: np.random.Generator, rows: int, vocab: int) -> np.ndarray:
    allowed = np.zeros((rows, vocab), dtype=bool)
    for row in range(rows):
        count = int(rng.integers(1, 12))
        allowed[row, rng.choice(vocab, size=count, replace=False)] = True
    return allowed


def test_pack_and_unpack_agree() -> None:
    rng = np.random.default_rng(0)
    for vocab in (1, 31, 32, 33, 1000, 49152):
        allowed = rng.random((3, vocab)) < 0.3
        data = pack(allowed)
        check_masks(data, 3, vocab)
        assert np.array_equal(unpack_masks(data, 3, vocab, torch.device("cpu")).numpy(),
                              allowed)
    with pytest.raises(ValueError, match="bytes"):
        check_masks(b"\0" * 7, 1, 100)


@pytest.mark.parametrize("mode", ["greedy", "temperature", "top_p", "top_k", "min_p"])
def test_sampled_tokens_are_always_allowed(mode: str) -> None:
    vocab, rows = 1000, 64
    rng = np.random.default_rng(1)
    settings = {"greedy": {}, "temperature": {"temperature": 1.5},
                "top_p": {"temperature": 1.0, "top_p": 0.5},
                "top_k": {"temperature": 1.0, "top_k": 3},
                "min_p": {"temperature": 1.0, "min_p": 0.2}}[mode]
    checked = 0
    for trial in range(5):
        logits = fixed_logits(rows, vocab, seed=trial, scale=4.0)
        raw = logits.clone()
        masked_rows = np.sort(rng.choice(rows, size=rows // 2, replace=False))
        allowed = random_allowed(rng, masked_rows.shape[0], vocab)
        params = make_params(rows, seeds=trial, num_logprobs=[2] * rows, **settings)
        params.masks = TokenMasks(torch.from_numpy(masked_rows),
                                  torch.from_numpy(allowed))
        out = sample(logits, params)
        unmasked = sample(logits, make_params(rows, seeds=trial, num_logprobs=[2] * rows,
                                              **settings))
        for j, row in enumerate(masked_rows):
            assert allowed[j, int(out.token_ids[row])]
            checked += 1
        others = np.setdiff1d(np.arange(rows), masked_rows)
        assert torch.equal(out.token_ids[others], unmasked.token_ids[others])
        # Logprobs are the raw distribution's, masked or not; the logits are untouched.
        assert torch.equal(out.top_logprobs, unmasked.top_logprobs)
        assert torch.equal(logits, raw)
    assert checked == 5 * rows // 2


def test_a_row_that_allows_nothing_is_sampled_unmasked() -> None:
    logits = fixed_logits(2, 50, seed=3)
    params = make_params(2)
    params.masks = TokenMasks(torch.tensor([1]), torch.zeros(1, 50, dtype=torch.bool))
    assert torch.equal(sample(logits, params).token_ids, sample(logits, make_params(2)).token_ids)


def test_the_board_hands_late_masks_over_and_times_out() -> None:
    board = MaskBoard(wait_s=0.2)
    with ThreadPoolExecutor(1) as pool:
        taken = pool.submit(board.take, "c", 3)
        board.put("c", 3, b"abc")
        assert taken.result(timeout=5) == b"abc"
    board.put("c", 4, b"early")  # before its batch: kept until taken
    assert board.take("c", 4) == b"early"
    with pytest.raises(MissingMasks, match="step 5"):
        board.take("c", 5)


def test_merged_masks_are_renumbered_and_follow_if_any_follows() -> None:
    def part(num_seqs: int, masked: list[int], follow: bool) -> runner_pb2.ExecuteRequest:
        return runner_pb2.ExecuteRequest(
            num_new_tokens=[1] * num_seqs, mask_seq_indices=masked,
            masks=b"" if follow else b"m" * len(masked), masks_follow=follow)

    inline = merge_requests([part(2, [1], False), part(3, [0, 2], False)])
    assert list(inline.mask_seq_indices) == [1, 2, 4]
    assert inline.masks == b"mmm" and not inline.masks_follow
    mixed = merge_requests([part(2, [0], False), part(2, [1], True)])
    assert list(mixed.mask_seq_indices) == [0, 3]
    assert mixed.masks_follow and not mixed.masks


def _masked(request: runner_pb2.ExecuteRequest, vocab: int, allowed_token: int,
            follow: bool) -> bytes:
    allowed = np.zeros((1, vocab), dtype=bool)
    allowed[0, allowed_token] = True
    request.mask_seq_indices.append(0)
    data = pack(allowed)
    if follow:
        request.masks_follow = True
    else:
        request.masks = data
    return data


def test_masks_inline_and_late_through_grpc(stub: runner_pb2_grpc.RunnerServiceStub) -> None:
    info = stub.Info(runner_pb2.InfoRequest())
    rng = random.Random(4)
    for step, follow in enumerate([False, True, True, False], start=1):
        token = rng.randrange(info.vocab_size)
        request = _one_prompt_request(info)
        request.client_id, request.step_id = "masks", step
        data = _masked(request, info.vocab_size, token, follow)
        with ThreadPoolExecutor(1) as pool:
            answer = pool.submit(stub.Execute, request, timeout=30)
            if follow:
                stub.SupplyMasks(runner_pb2.SupplyMasksRequest(
                    client_id="masks", step_id=step, masks=data))
            assert list(answer.result().token_ids) == [token]


def test_malformed_masks_are_invalid_argument(stub: runner_pb2_grpc.RunnerServiceStub) -> None:
    info = stub.Info(runner_pb2.InfoRequest())
    cases = [
        ({"mask_seq_indices": [0], "masks": b"\0" * 3}, "bytes"),
        ({"mask_seq_indices": [1], "masks": b""}, "mask_seq_indices"),
        ({"mask_seq_indices": [0, 0], "masks_follow": True}, "twice"),
        ({"masks": b"\0" * 4}, "without mask_seq_indices"),
        ({"mask_seq_indices": [0], "masks_follow": True, "client_id": ""}, "client_id"),
    ]
    for fields, message in cases:
        request = _one_prompt_request(info)
        request.client_id, request.step_id = "bad-masks", 1
        for name, value in fields.items():
            if isinstance(value, list):
                getattr(request, name).extend(value)
            else:
                setattr(request, name, value)
        with pytest.raises(grpc.RpcError) as raised:
            stub.Execute(request, timeout=30)
        assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT, fields
        assert message in raised.value.details(), raised.value.details()


def test_late_masks_that_never_come_fail_their_batch_alone(
        stub: runner_pb2_grpc.RunnerServiceStub, servicer: RunnerServicer,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Two clients' batches in one forward: the one whose masks do not come gets
    FAILED_PRECONDITION, the other its tokens."""
    info = stub.Info(runner_pb2.InfoRequest())
    monkeypatch.setattr(servicer._masks, "wait_s", 0.5)
    late = _one_prompt_request(info)
    late.client_id, late.step_id = "never", 1
    _masked(late, info.vocab_size, 7, follow=True)
    fine = _one_prompt_request(info)
    fine.client_id, fine.step_id = "fine", 1
    fine.slot_mapping[:] = [s + 16 for s in fine.slot_mapping]  # another block
    fine.block_tables[:] = [b + 1 for b in fine.block_tables]
    _masked(fine, info.vocab_size, 9, follow=False)
    with ThreadPoolExecutor(2) as pool:
        calls = [pool.submit(stub.Execute, r, timeout=30) for r in (late, fine)]
        assert list(calls[1].result().token_ids) == [9]
        with pytest.raises(grpc.RpcError) as raised:
            calls[0].result()
    assert raised.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "did not come" in raised.value.details()

