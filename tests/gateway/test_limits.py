"""Each configurable limit of the gateway, enforced over real gRPC with a message naming it."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import grpc
import pytest

from common.security import open_channel
from common.server import ServerOptions
from gateway.client import PagewireClient, build_request
from gateway.config import GatewayConfig, config_from_args
from gateway.server import Gateway, build_parser
from gateway.server import main as gateway_main
from gateway.tokenizer import Tokenizer
from gateway.validation import peer_key
from protos import gateway_pb2_grpc
from tests.gateway.conftest import start_fake_runner
from tests.gateway.fake_runner import FakeRunner, expected_tokens
from tests.helpers.services import ServiceProcess

MAX_MESSAGE_BYTES = 16 * 1024
TOKENS = ("tenant-a", "tenant-b", "tenant-c")  # the gateway checks them: each is a client
LIMITS = dict(max_prompt_tokens=20, max_tokens_limit=10, max_n=2, max_stop_strings=2,
              max_stop_string_chars=5, max_streams=3, max_streams_per_client=2)


class LimitedGateway:
    """A gateway with small limits on a fake runner (which can be paused to hold streams)."""

    def __init__(self, tokenizer: Tokenizer, block_service: ServiceProcess) -> None:
        self.runner = FakeRunner(num_blocks=128, block_size=4, epoch=21)
        self.runner_server = start_fake_runner(self.runner)
        config = GatewayConfig(block_service=block_service.address,
                               runners=[f"127.0.0.1:{self.runner_server.port}"],
                               **LIMITS)  # type: ignore[arg-type]
        options = ServerOptions(port=0, max_workers=32, max_message_bytes=MAX_MESSAGE_BYTES,
                                auth_tokens=TOKENS)
        self.gateway = Gateway(config, options, tokenizer)
        self.gateway.start(timeout_s=30)
        assert self.gateway.service is not None
        self.address = f"127.0.0.1:{self.gateway.service.port}"
        self.client = PagewireClient(self.address, token=TOKENS[0])

    def open_streams(self) -> int:
        assert self.gateway.servicer is not None
        return self.gateway.servicer.streams.open_streams

    def close(self) -> None:
        self.runner.proceed.set()
        self.client.close()
        self.gateway.stop()
        self.runner_server.stop(0)


@pytest.fixture(scope="module")
def limited(tokenizer: Tokenizer, block_service: ServiceProcess) -> Iterator[LimitedGateway]:
    stack = LimitedGateway(tokenizer, block_service)
    yield stack
    stack.close()


def refusal(call: Callable[[], object]) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as error:
        call()
    return error.value


def test_requests_within_the_limits_are_served(limited: LimitedGateway) -> None:
    prompt = list(range(100, 120))  # exactly max_prompt_tokens
    result = limited.client.complete(token_ids=prompt, max_tokens=10, temperature=0, n=2,
                                     stop=["abcde", "x"])
    assert result.token_ids[0] == expected_tokens(prompt, 10)
    assert result.finish_reasons == ["length", "length"]


def test_prompt_tokens_over_the_limit(limited: LimitedGateway) -> None:
    error = refusal(lambda: limited.client.complete(token_ids=list(range(100, 121))))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "--max-prompt-tokens" in str(error.details()) and "21" in str(error.details())


def test_text_prompt_over_the_token_limit_in_generate_and_tokenize(
        limited: LimitedGateway) -> None:
    text = " ".join(["word"] * 40)  # 40 tokens at least: one per word
    for call in (lambda: limited.client.complete(prompt=text),
                 lambda: limited.client.tokenize(prompt=text)):
        error = refusal(call)
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "--max-prompt-tokens" in str(error.details())


def test_max_tokens_over_the_limit(limited: LimitedGateway) -> None:
    error = refusal(lambda: limited.client.complete(token_ids=[5, 6], max_tokens=11))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "--max-tokens-limit" in str(error.details())


def test_max_tokens_defaults_to_the_limit(limited: LimitedGateway) -> None:
    result = limited.client.complete(token_ids=[5, 6, 7], temperature=0)
    assert len(result.token_ids[0]) == LIMITS["max_tokens_limit"]


def test_n_over_the_limit(limited: LimitedGateway) -> None:
    error = refusal(lambda: limited.client.complete(token_ids=[5, 6], max_tokens=2, n=3))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "--max-n" in str(error.details())


def test_too_many_stop_strings(limited: LimitedGateway) -> None:
    error = refusal(lambda: limited.client.complete(token_ids=[5, 6], max_tokens=2,
                                                    stop=["a", "b", "c"]))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "--max-stop-strings" in str(error.details())


def test_stop_string_too_long(limited: LimitedGateway) -> None:
    error = refusal(lambda: limited.client.complete(token_ids=[5, 6], max_tokens=2,
                                                    stop=["abcdef"]))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "--max-stop-string-chars" in str(error.details())


def test_message_over_the_size_limit(limited: LimitedGateway) -> None:
    error = refusal(lambda: limited.client.complete(prompt="a" * (2 * MAX_MESSAGE_BYTES)))
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "larger than max" in str(error.details()).lower()
    assert limited.client.model_info().vocab_size > 0  # and the gateway still serves


def _wait_open(limited: LimitedGateway, count: int) -> None:
    deadline = time.monotonic() + 10
    while limited.open_streams() != count:
        assert time.monotonic() < deadline, f"{limited.open_streams()} streams open, not {count}"
        time.sleep(0.01)


def test_concurrent_streams_per_client_and_in_all(limited: LimitedGateway) -> None:
    limited.runner.proceed.clear()  # streams stay open while the runner is held
    channels = []
    try:
        held = [limited.client.generate(token_ids=[7, 8, i], max_tokens=2, temperature=0)
                for i in range(2)]
        _wait_open(limited, 2)
        error = refusal(lambda: limited.client.complete(token_ids=[7, 8, 9], max_tokens=2))
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "--max-streams-per-client" in str(error.details())
        # Another (checked) bearer token is another client, with its own count, up to the
        # global limit.
        stubs = []
        for name in TOKENS[1:]:
            channel = open_channel(limited.address, None, name)
            channels.append(channel)
            stubs.append(gateway_pb2_grpc.GenerationServiceStub(channel))
        request = build_request(token_ids=[7, 8, 10], max_tokens=2, temperature=0)
        held.append(stubs[0].Generate(request))
        _wait_open(limited, 3)
        error = refusal(lambda: list(stubs[1].Generate(request)))
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "--max-streams " in str(error.details())
        limited.runner.proceed.set()
        for stream in held:
            assert len(list(stream)) >= 1
        _wait_open(limited, 0)
        # Slots are given back: the refused identities are served now.
        assert len(list(stubs[1].Generate(request))) >= 1
        assert limited.client.complete(token_ids=[7, 8, 9], max_tokens=2).token_ids
    finally:
        limited.runner.proceed.set()
        for channel in channels:
            channel.close()


def test_a_cancelled_stream_gives_its_slot_back(limited: LimitedGateway) -> None:
    limited.runner.proceed.clear()
    try:
        stream = limited.client.generate(token_ids=[9, 9, 9], max_tokens=2, temperature=0)
        _wait_open(limited, 1)
        stream.cancel()  # type: ignore[attr-defined]
        _wait_open(limited, 0)
    finally:
        limited.runner.proceed.set()


def test_an_unchecked_token_is_not_an_identity() -> None:
    """Without --auth-token-file a client could make up a token per call to dodge the
    per-client limit: then only the address (without port) names the client."""
    metadata = [("authorization", "Bearer made-up")]
    assert peer_key(metadata, "ipv4:10.1.2.3:40000", trust_token=False) == "ipv4:10.1.2.3"
    assert peer_key(metadata, "ipv4:10.1.2.3:40000", trust_token=True) == \
        "token:Bearer made-up"
    assert peer_key(None, "ipv6:[::1]:5555", trust_token=True) == "ipv6:[::1]"
    assert peer_key(None, "unix:/tmp/socket", trust_token=False) == "unix:/tmp/socket"


def test_a_long_cache_salt_is_refused_alone(limited: LimitedGateway) -> None:
    """Regression (found by the fuzz): the block service refuses a whole step when one salt
    is over its 1024-byte limit, so an unchecked long salt failed every request in the step
    with INTERNAL. The gateway refuses that request alone now."""
    limited.runner.proceed.clear()
    try:
        victim = limited.client.generate(token_ids=[11, 12, 13], max_tokens=3, temperature=0,
                                         cache_salt="tenant")
        _wait_open(limited, 1)
        error = refusal(lambda: limited.client.complete(token_ids=[11, 12], max_tokens=2,
                                                        cache_salt="é" * 513))  # 1026 bytes
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "cache_salt has 1026 bytes" in str(error.details())
        limited.runner.proceed.set()
        tokens = [t for message in victim for o in message.outputs for t in o.token_ids]
        assert tokens == expected_tokens([11, 12, 13], 3)
    finally:
        limited.runner.proceed.set()
    assert limited.client.complete(token_ids=[11, 12], max_tokens=2,
                                   cache_salt="é" * 512).token_ids  # 1024 bytes: at the limit


def test_a_long_request_id_is_refused(limited: LimitedGateway) -> None:
    error = refusal(lambda: limited.client.complete(token_ids=[5], max_tokens=1,
                                                    request_id="r" * 257))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "request_id" in str(error.details())


def test_too_many_stop_token_ids(limited: LimitedGateway) -> None:
    error = refusal(lambda: limited.client.complete(token_ids=[5], max_tokens=1,
                                                    stop_token_ids=[100] * 1025))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "stop_token_ids" in str(error.details())


def test_flags_set_every_limit_and_the_defaults_are_safe() -> None:
    args = build_parser().parse_args([
        "--max-prompt-tokens", "7", "--max-tokens-limit", "8", "--max-stop-strings", "3",
        "--max-stop-string-chars", "9", "--max-streams", "10", "--max-streams-per-client", "4",
        "--max-n", "2"])
    config = config_from_args(args)
    assert (config.max_prompt_tokens, config.max_tokens_limit, config.max_stop_strings,
            config.max_stop_string_chars, config.max_streams, config.max_streams_per_client,
            config.max_n) == (7, 8, 3, 9, 10, 4, 2)
    defaults = build_parser().parse_args([])
    assert defaults.max_message_bytes == 4 * 1024 * 1024  # the public API's, not 64 MiB
    assert config_from_args(defaults).max_streams < defaults.max_workers
    with pytest.raises(ValueError, match="--max-streams-per-client"):
        GatewayConfig(max_streams_per_client=0)


def test_a_token_budget_below_the_running_sequences_is_refused() -> None:
    # Each running sequence decodes one token per step; all of them must fit in the budget.
    with pytest.raises(ValueError, match=r"--max-num-batched-tokens \(63\) must be >= "
                                         r"--max-num-seqs \(64\)"):
        GatewayConfig(max_num_batched_tokens=63, max_num_seqs=64)
    assert GatewayConfig(max_num_batched_tokens=64, max_num_seqs=64).max_num_seqs == 64


def test_inconsistent_flags_end_the_gateway_with_a_usage_error(
        capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        gateway_main(["--max-num-batched-tokens", "8", "--max-num-seqs", "64"])
    assert exit_info.value.code == 2
    assert "--max-num-batched-tokens (8) must be >= --max-num-seqs (64)" in capsys.readouterr().err
