"""The gateway end to end against the real block service and a checking fake runner.

The fake runner predicts each token from the context it reads back from its cache through
the block tables the gateway sent, so every table, slot, copy, chunk, fork and recompute the
gateway gets wrong shows up as a token that differs from the oracle (`expected_tokens`).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from prometheus_client import REGISTRY

from gateway.client import PagewireClient
from gateway.request import output_seed
from gateway.tokenizer import Tokenizer
from tests.gateway.fake_runner import expected_tokens
from tests.gateway.stack import BLOCK_SIZE, Stack
from tests.helpers.services import ServiceProcess


@pytest.fixture(scope="module")
def stack(tokenizer: Tokenizer, block_service: ServiceProcess) -> Iterator[Stack]:
    s = Stack(tokenizer, block_service, num_blocks=256, max_num_batched_tokens=32,
              max_num_seqs=16)
    yield s
    s.close()


def preemptions() -> float:
    """The gateway's preemption counter, from the in-process Prometheus registry."""
    return REGISTRY.get_sample_value("pagewire_gateway_preemptions_total") or 0.0


def prompt_of(i: int, length: int) -> list[int]:
    return [1000 + 37 * i + 11 * j for j in range(length)]


def test_concurrent_greedy_requests_match_the_oracle_with_chunked_prefill(stack: Stack) -> None:
    prompts = [prompt_of(i, 5 + 7 * i) for i in range(10)]  # up to 68 tokens: 3 chunks of 32
    with ThreadPoolExecutor(len(prompts)) as pool:
        results = list(pool.map(
            lambda p: stack.client.complete(token_ids=p, max_tokens=12, temperature=0), prompts))
    for prompt, result in zip(prompts, results, strict=True):
        assert result.token_ids[0] == expected_tokens(prompt, 12)
        assert result.finish_reasons == ["length"]
        assert result.usage.prompt_tokens == len(prompt)
        assert result.usage.completion_tokens == 12
    assert max(sum(b.num_new_tokens) for b in stack.runner.batches) <= 32
    assert any(len(b.num_new_tokens) > 1 for b in stack.runner.batches)  # mixed batches
    assert stack.wait_idle().used_blocks == 0


def test_a_shared_prefix_is_a_cache_hit_and_reads_the_cached_kv(stack: Stack) -> None:
    prefix = prompt_of(50, 12)
    first = stack.client.complete(token_ids=[*prefix, 5, 6], max_tokens=3, temperature=0)
    second = stack.client.complete(token_ids=[*prefix, 8, 9, 10], max_tokens=3, temperature=0)
    assert first.usage.cached_tokens == 0
    assert second.usage.cached_tokens == 12
    assert second.token_ids[0] == expected_tokens([*prefix, 8, 9, 10], 3)


def test_n_outputs_fork_the_prompt_and_use_one_seed_each(stack: Stack) -> None:
    prompt = prompt_of(60, 10)
    batches_before = len(stack.runner.batches)
    result = stack.client.complete(token_ids=prompt, max_tokens=6, temperature=0.8, seed=42,
                                   n=3)
    for i in range(3):
        assert result.token_ids[i] == expected_tokens(prompt, 6, output_seed(42, i))
    assert result.usage.completion_tokens == 18
    # The prompt but its last token was computed once; the last token once per output.
    positions = [
        (batch.start_positions[i], batch.num_new_tokens[i])
        for batch in stack.runner.batches[batches_before:]
        for i in range(len(batch.num_new_tokens))
    ]
    shared = sum(count for start, count in positions if start + count <= 9)
    last = sum(1 for start, count in positions if start == 9 and count == 1)
    assert (shared, last) == (9, 3)
    again = stack.client.complete(token_ids=prompt, max_tokens=6, temperature=0.8, seed=42, n=3)
    assert again.token_ids == result.token_ids


def test_n_outputs_of_a_one_token_prompt(stack: Stack) -> None:
    result = stack.client.complete(token_ids=[777], max_tokens=4, temperature=1.0, seed=5, n=2)
    for i in range(2):
        assert result.token_ids[i] == expected_tokens([777], 4, output_seed(5, i))


def test_stop_token_ids_and_max_tokens(stack: Stack) -> None:
    prompt = prompt_of(70, 6)
    expected = expected_tokens(prompt, 10)
    result = stack.client.complete(token_ids=prompt, max_tokens=10, temperature=0,
                                   stop_token_ids=[expected[3]])
    assert result.token_ids[0] == expected[:4]
    assert result.finish_reasons == ["stop"]
    result = stack.client.complete(token_ids=prompt, max_tokens=2, temperature=0)
    assert result.token_ids[0] == expected[:2] and result.finish_reasons == ["length"]


def test_logprobs_are_streamed_per_token(stack: Stack) -> None:
    result = stack.client.complete(token_ids=prompt_of(80, 4), max_tokens=3, temperature=0,
                                   logprobs=2)
    assert len(result.logprobs[0]) == 3
    for position, token in zip(result.logprobs[0], result.token_ids[0], strict=True):
        assert position.token.token_id == token
        assert [t.token_id for t in position.top] == [token, token + 1]


def test_final_only_sends_the_whole_completion_in_one_message(stack: Stack) -> None:
    params = dict(token_ids=prompt_of(90, 5), max_tokens=7, temperature=0.9, seed=11, n=2,
                  logprobs=2, stop_token_ids=[expected_tokens(prompt_of(90, 5), 7,
                                                              output_seed(11, 1))[4]])
    streamed = stack.client.complete(**params)
    final = stack.client.complete(**params, final_only=True)
    assert streamed.num_messages > 1 and final.num_messages == 1
    assert final.token_ids == streamed.token_ids
    assert final.texts == streamed.texts
    assert final.logprobs == streamed.logprobs
    assert final.finish_reasons == streamed.finish_reasons == ["length", "stop"]
    assert final.usage == streamed.usage


def test_cancel_frees_the_blocks(stack: Stack) -> None:
    stream = stack.client.generate(token_ids=prompt_of(90, 9), max_tokens=1000, temperature=0)
    next(stream)
    assert stack.stats().used_blocks > 0
    stream.cancel()
    assert stack.wait_idle().used_blocks == 0


def test_max_tokens_default_is_what_fits_in_the_model_length(stack: Stack) -> None:
    info = stack.client.model_info()
    assert info.max_model_len == 2048 and info.block_size == BLOCK_SIZE
    # The whole pool (256 blocks of 4) holds less than max_model_len: it is the limit.
    limit = min(info.max_model_len, info.num_blocks * info.block_size)
    assert limit == 1024
    prompt = prompt_of(95, limit - 5)
    result = stack.client.complete(token_ids=prompt, temperature=0)
    assert result.token_ids[0] == expected_tokens(prompt, 5)
    assert result.finish_reasons == ["length"]


def test_preemption_recomputes_and_keeps_outputs_unchanged(
        tokenizer: Tokenizer, block_service: ServiceProcess) -> None:
    # 14 blocks of 4 tokens = 56 tokens for 4 requests of 8 + 10 tokens = 72: someone waits.
    small = Stack(tokenizer, block_service, num_blocks=14, epoch=9, max_num_seqs=4)
    try:
        before = preemptions()
        prompts = [prompt_of(100 + i, 8) for i in range(4)]
        with ThreadPoolExecutor(4) as pool:
            results = list(pool.map(
                lambda p: small.client.complete(token_ids=p, max_tokens=10, temperature=0),
                prompts))
        for prompt, result in zip(prompts, results, strict=True):
            assert result.token_ids[0] == expected_tokens(prompt, 10)
        assert preemptions() > before
        assert small.wait_idle().used_blocks == 0
    finally:
        small.close()


def test_a_preempted_fork_child_reports_no_cache_hit_of_its_own_tokens(
        tokenizer: Tokenizer, block_service: ServiceProcess) -> None:
    # 8 blocks of 4 tokens cannot hold 8 children of 2 + 12 tokens: children are preempted
    # and re-admitted, and their re-admission finds their own generated tokens cached. That is
    # not a prompt cache hit (the fuzz found usage.cached_tokens 4 for a 2-token prompt).
    small = Stack(tokenizer, block_service, num_blocks=8, epoch=21, max_tokens_limit=16,
                  max_n=8, max_num_seqs=8, max_num_batched_tokens=64)
    try:
        before = preemptions()
        result = small.client.complete(token_ids=[1000, 1003], max_tokens=12, n=8,
                                       temperature=0.5, seed=5)
        assert preemptions() > before
        assert result.usage.prompt_tokens == 2
        assert result.usage.cached_tokens == 0
        assert small.wait_idle().used_blocks == 0
    finally:
        small.close()


def test_runner_restart_recomputes_in_flight_requests(
        tokenizer: Tokenizer, block_service: ServiceProcess) -> None:
    restarting = Stack(tokenizer, block_service, num_blocks=64, epoch=11)
    try:
        prompt = prompt_of(120, 7)
        stream = restarting.client.generate(token_ids=prompt, max_tokens=40, temperature=0)
        first = next(stream)
        with restarting.runner.lock:  # the runner "restarts": new epoch, empty cache
            restarting.runner.epoch += 1
            restarting.runner.cache[:] = -1
        tokens = list(first.outputs[0].token_ids)
        for message in stream:
            for output in message.outputs:
                tokens.extend(output.token_ids)
        assert tokens == expected_tokens(prompt, 40)
    finally:
        restarting.close()


def test_full_waiting_queue_is_resource_exhausted(
        tokenizer: Tokenizer, block_service: ServiceProcess) -> None:
    busy = Stack(tokenizer, block_service, num_blocks=64, epoch=13, max_num_seqs=1,
                 max_waiting=1)
    busy.runner.proceed.clear()
    try:
        running = busy.client.generate(token_ids=[5, 6, 7], max_tokens=2, temperature=0)
        deadline = time.monotonic() + 5
        while busy.gateway.engine.loops[0].scheduler.running == [] and time.monotonic() < deadline:
            time.sleep(0.01)
        queued = busy.client.generate(token_ids=[5, 6, 8], max_tokens=2, temperature=0)
        time.sleep(0.2)  # let the engine take the second request into its queue
        with pytest.raises(grpc.RpcError) as error:
            busy.client.complete(token_ids=[5, 6, 9], max_tokens=2, temperature=0)
        assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        busy.runner.proceed.set()
        assert len(list(running)) >= 1 and len(list(queued)) >= 1
    finally:
        busy.runner.proceed.set()
        busy.close()


def sent(counter: str) -> float:
    return REGISTRY.get_sample_value(f"pagewire_gateway_{counter}_total") or 0.0


def test_the_next_step_goes_out_while_the_execute_runs(stack: Stack) -> None:
    """Step N+1 (reserving the position of the token N samples) and Execute N+1 (leaving that
    token to the runner) are sent while Execute N is still held in the runner; the output is
    the oracle's all the same, and no step runs past max_tokens."""
    prompt = prompt_of(60, 9)
    steps_before, executes_before = sent("steps"), sent("executes")
    batches_before = len(stack.runner.batches)
    stack.runner.proceed.clear()
    try:
        with ThreadPoolExecutor(1) as pool:
            result = pool.submit(stack.client.complete, token_ids=prompt, max_tokens=5,
                                 temperature=0)
            deadline = time.monotonic() + 10
            while sent("executes") < executes_before + 2 and time.monotonic() < deadline:
                time.sleep(0.01)
            # The prefill's Step and Execute, and the first decode's: the prefill still held.
            assert sent("steps") == steps_before + 2
            assert sent("executes") == executes_before + 2
            assert len(stack.runner.batches) == batches_before
            stack.runner.proceed.set()
            assert result.result(timeout=30).token_ids[0] == expected_tokens(prompt, 5)
    finally:
        stack.runner.proceed.set()
    # One Execute per token: none for the position after the last.
    assert len(stack.runner.batches) == batches_before + 5
    assert stack.wait_idle().used_blocks == 0


def test_a_reader_that_stops_reading_holds_up_no_one_and_gets_everything_merged(
        stack: Stack) -> None:
    """A client that stops reading: gRPC's flow control (a 1 KiB window here) soon stops the
    server's writes to it, its messages wait in the gateway merged (at most one unread per
    stream), other streams run on, and when it reads again it gets every token in order."""
    # A tiny stream window and no BDP probing: the server's writes block after ~1 KiB.
    channel = grpc.insecure_channel(
        f"127.0.0.1:{stack.gateway.service.port}",  # type: ignore[union-attr]
        options=[("grpc.http2.lookahead_bytes", 1024), ("grpc.http2.bdp_probe", 0)])
    slow = PagewireClient(channel=channel)
    prompt = prompt_of(80, 6)
    max_tokens = 600
    try:
        stream = slow.generate(token_ids=prompt, max_tokens=max_tokens, temperature=0,
                               ignore_eos=True)
        first = next(stream)  # placed and streaming; from here on, nobody reads it
        others = [prompt_of(81 + i, 5) for i in range(3)]
        for other in others:  # served in full while the slow stream is stuck
            result = stack.client.complete(token_ids=other, max_tokens=8, temperature=0,
                                           timeout=30)
            assert result.token_ids[0] == expected_tokens(other, 8)
        assert stack.wait_idle(timeout_s=30).used_blocks == 0  # the slow request ended too
        messages = [first, *stream]
    finally:
        channel.close()  # the client does not own a channel it was given
    tokens = [t for message in messages for out in message.outputs for t in out.token_ids]
    assert tokens == expected_tokens(prompt, max_tokens)
    # Far fewer messages than tokens: once the window was full, its progress was merged
    # instead of queued a message per token.
    assert len(messages) < max_tokens // 2, len(messages)
