"""The gateway when its block service goes away: restarted, it recovers and the streams go
on unchanged; gone for good, requests end with UNAVAILABLE."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from gateway.tokenizer import Tokenizer
from tests.gateway.fake_runner import expected_tokens
from tests.gateway.stack import Stack
from tests.helpers.services import ServiceProcess


def test_block_service_restart_mid_stream_is_recomputed(tokenizer: Tokenizer,
                                                        tmp_path: Path) -> None:
    blocks = ServiceProcess("block_service").start(tmp_path).wait_serving(60)
    stack = Stack(tokenizer, blocks, num_blocks=64, epoch=31)
    try:
        stack.runner.proceed.clear()  # hold the runner so the stream is mid-way
        prompt = [300 + i for i in range(9)]
        stream = stack.client.generate(token_ids=prompt, max_tokens=30, temperature=0)
        blocks.kill()  # all sessions, pools and tables are lost
        blocks = ServiceProcess("block_service", port=blocks.port).start(tmp_path)
        blocks.wait_serving(60)
        stack.runner.proceed.set()
        tokens = [t for message in stream for o in message.outputs for t in o.token_ids]
        assert tokens == expected_tokens(prompt, 30)
    finally:
        stack.runner.proceed.set()
        stack.close()
        blocks.terminate()


def test_block_service_gone_for_good_ends_requests_with_unavailable(
        tokenizer: Tokenizer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Give up after 3 s instead of the default 30 s that rides out a restart.
    monkeypatch.setenv("PAGEWIRE_GATEWAY_BACKEND_DOWN_TIMEOUT_S", "3")
    blocks = ServiceProcess("block_service").start(tmp_path).wait_serving(60)
    stack = Stack(tokenizer, blocks, num_blocks=64, epoch=33)
    try:
        blocks.kill()
        with pytest.raises(grpc.RpcError) as error:
            stack.client.complete(token_ids=[1, 2, 3], max_tokens=3, temperature=0)
        assert error.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        stack.close()
