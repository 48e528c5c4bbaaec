"""The gateway's retry rule and health bookkeeping, without processes: the same request is
sent again after UNAVAILABLE / DEADLINE_EXCEEDED until it succeeds or the backend-down timeout
has passed; other errors are not retried; a backend failing for down_after_s is down until a
call succeeds, and the health listener hears each change once."""

from __future__ import annotations

from typing import Any

import grpc
import pytest

from gateway.config import GatewayConfig
from gateway.retry import (
    BACKEND_DOWN_TIMEOUT_ENV,
    RPC_TIMEOUT_ENV,
    DependencyHealth,
    RetryPolicy,
    call_with_retry,
)

pytestmark = pytest.mark.timeout(30)


class FakeRpcError(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode) -> None:
        super().__init__(code.name)
        self._code = code

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._code.name


class ScriptedRpc:
    """Fails with the scripted codes in order, then answers "ok"; records what it was sent."""

    def __init__(self, *codes: grpc.StatusCode) -> None:
        self.codes = list(codes)
        self.requests: list[Any] = []
        self.timeouts: list[float] = []

    def __call__(self, request: Any, timeout: float) -> str:
        self.requests.append(request)
        self.timeouts.append(timeout)
        if self.codes:
            raise FakeRpcError(self.codes.pop(0))
        return "ok"


def test_retries_the_same_request_until_it_succeeds() -> None:
    rpc = ScriptedRpc(grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
                      grpc.StatusCode.UNAVAILABLE)
    request = object()
    assert call_with_retry(rpc, request, timeout_s=2.5) == "ok"
    assert len(rpc.requests) == 4
    assert all(sent is request for sent in rpc.requests)  # same object: same step id
    assert rpc.timeouts == [2.5] * 4  # every attempt has the deadline


def test_other_errors_are_not_retried() -> None:
    rpc = ScriptedRpc(grpc.StatusCode.FAILED_PRECONDITION)
    with pytest.raises(grpc.RpcError) as error:
        call_with_retry(rpc, object(), timeout_s=1)
    assert error.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert len(rpc.requests) == 1


def test_gives_up_after_the_backend_down_timeout() -> None:
    rpc = ScriptedRpc(*[grpc.StatusCode.UNAVAILABLE] * 1000)
    policy = RetryPolicy(down_after_s=0.0, give_up_s=0.3)
    with pytest.raises(grpc.RpcError) as error:
        call_with_retry(rpc, object(), 1, policy)
    assert error.value.code() == grpc.StatusCode.UNAVAILABLE
    assert 2 <= len(rpc.requests) < 1000


def test_a_failing_backend_is_down_until_a_call_succeeds() -> None:
    health = DependencyHealth()
    heard: list[bool] = []
    health.set_listener(heard.append)
    policy = RetryPolicy(down_after_s=0.0, give_up_s=10.0)
    rpc = ScriptedRpc(grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNAVAILABLE)
    assert call_with_retry(rpc, object(), 1, policy, health, "runner") == "ok"
    assert heard == [True, False, True]  # set_listener reports the current state first
    assert health.serving and health.problem() == ""


def test_health_names_every_backend_that_is_down() -> None:
    health = DependencyHealth()
    health.mark_down("runner", "Info: UNAVAILABLE")
    health.mark_down("block service", "KeepAlive: UNAVAILABLE")
    assert not health.serving
    assert "runner is unreachable (Info: UNAVAILABLE)" in health.problem()
    assert "block service is unreachable" in health.problem()
    health.mark_up("runner")
    assert not health.serving
    health.mark_up("block service")
    assert health.serving


def test_policy_from_config_and_environment() -> None:
    config = GatewayConfig(rpc_timeout_s=60.0)
    policy = RetryPolicy.from_config(config, environ={})
    assert policy.execute_timeout_s == 60.0 and policy.control_timeout_s == 10.0
    policy = RetryPolicy.from_config(config, environ={RPC_TIMEOUT_ENV: "1.5",
                                                      BACKEND_DOWN_TIMEOUT_ENV: "4"})
    assert policy.execute_timeout_s == policy.control_timeout_s == 1.5
    assert policy.give_up_s == 4.0
    with pytest.raises(ValueError):
        RetryPolicy.from_config(config, environ={BACKEND_DOWN_TIMEOUT_ENV: "0"})
