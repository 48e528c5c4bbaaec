"""Prefix-cache isolation: the public request's cache_salt reaches the block service's
ALLOCATE, so prompts are shared only between requests with the same salt."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from gateway.tokenizer import Tokenizer
from tests.gateway.conftest import block_service, tokenizer  # noqa: F401 (fixtures)
from tests.gateway.fake_runner import expected_tokens
from tests.gateway.stack import BLOCK_SIZE, Stack
from tests.helpers.services import ServiceProcess

PREFIX = [2000 + 13 * i for i in range(3 * BLOCK_SIZE)]  # three full blocks


@pytest.fixture(scope="module")
def stack(tokenizer: Tokenizer, block_service: ServiceProcess  # noqa: F811
          ) -> Iterator[Stack]:
    s = Stack(tokenizer, block_service, num_blocks=128, epoch=41)
    yield s
    s.close()


def cached(stack: Stack, suffix: list[int], salt: str) -> int:
    prompt = [*PREFIX, *suffix]
    result = stack.client.complete(token_ids=prompt, max_tokens=2, temperature=0,
                                   cache_salt=salt)
    assert result.token_ids[0] == expected_tokens(prompt, 2)  # the right KV was read
    return result.usage.cached_tokens


def test_tenants_share_prefixes_only_within_their_salt(stack: Stack) -> None:
    assert cached(stack, [1, 2], "tenant-a") == 0
    assert cached(stack, [3, 4], "tenant-a") == len(PREFIX)  # same salt: shared
    assert cached(stack, [5, 6], "tenant-b") == 0  # other salt: not shared
    assert cached(stack, [7, 8], "") == 0  # no salt is its own tenant
    assert cached(stack, [9, 10], "tenant-b") == len(PREFIX)
    assert cached(stack, [11, 12], "") == len(PREFIX)
    assert cached(stack, [13, 14], "tenant-a") == len(PREFIX)
    assert stack.wait_idle().used_blocks == 0


def test_salts_that_only_differ_slightly_do_not_collide(stack: Stack) -> None:
    prefix_salts = ["x", "x ", "X", "x\x00", "xx"]
    assert cached(stack, [20], prefix_salts[0]) == 0
    for salt in prefix_salts[1:]:
        assert cached(stack, [21], salt) == 0, salt
