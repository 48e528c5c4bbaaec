"""Checks of a Generate request, done before any work starts.

Each check raises InvalidRequest with a message that names the field and the allowed range;
the servicer answers INVALID_ARGUMENT with it. Nothing here has side effects.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from gateway.sequence import SamplingConfig
from protos import gateway_pb2

MAX_LOGPROBS = 20
# Defaults of the configurable limits (GatewayConfig and its flags use these).
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_PROMPT_TOKENS = 32_768
MAX_TOKENS_LIMIT = 8_192
# The block service refuses a whole step (every request in it) when one cache salt is longer
# than its MAX_CACHE_SALT_BYTES (1024), so the gateway must refuse such a request alone.
MAX_CACHE_SALT_BYTES = 1024
# The start of a LoRA adapter request's cache salt (gateway/adapters.py), refused in clients'.
ADAPTER_SALT_PREFIX = "lora:"
# request_id is echoed in every message of a stream: bounded so it cannot amplify traffic.
MAX_REQUEST_ID_CHARS = 256
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGIT_BIAS = 1024  # entries of logit_bias
MAX_STREAM_INTERVAL = 4096  # tokens per message
LOGIT_BIAS_LIMIT = 100.0  # biases are clamped to [-LOGIT_BIAS_LIMIT, LOGIT_BIAS_LIMIT]


class InvalidRequest(ValueError):
    """A request that cannot be served as sent."""


class LimitReached(Exception):
    """A concurrency limit is reached: the call is refused with RESOURCE_EXHAUSTED."""


@dataclass(frozen=True)
class Limits:
    """What the served model and the gateway's configuration allow."""

    vocab_size: int
    max_len: int  # longest prompt + output
    max_n: int
    max_prompt_tokens: int = MAX_PROMPT_TOKENS
    max_tokens: int = MAX_TOKENS_LIMIT
    max_stop_strings: int = MAX_STOP_STRINGS
    max_stop_string_chars: int = MAX_STOP_STRING_CHARS


class StreamLimiter:
    """Counts open Generate streams, per client and in all, and refuses those over a limit.

    A client is whatever `peer_key` names it by (its bearer token, else its address); the
    counts live only while the streams do, so a client's count never outlives its calls.
    """

    def __init__(self, max_streams: int, max_streams_per_client: int,
                 flags: tuple[str, str] = ("--max-streams", "--max-streams-per-client")
                 ) -> None:
        """`flags`: the flags that set the two limits, named in refusals."""
        self.max_streams = max_streams
        self.max_streams_per_client = max_streams_per_client
        self._flags = flags
        self._lock = threading.Lock()
        self._open: dict[str, int] = {}
        self._total = 0

    def acquire(self, client: str) -> Callable[[], None]:
        """Takes a stream slot for `client`; LimitReached when none is left.

        Returns the function that gives the slot back; calling it again does nothing.
        """
        with self._lock:
            if self._total >= self.max_streams:
                raise LimitReached(
                    f"the gateway has {self._total} open streams, its limit "
                    f"({self._flags[0]} {self.max_streams}): retry later")
            held = self._open.get(client, 0)
            if held >= self.max_streams_per_client:
                raise LimitReached(
                    f"this client has {held} open streams, the per-client limit "
                    f"({self._flags[1]} {self.max_streams_per_client}): retry later")
            self._open[client] = held + 1
            self._total += 1
        released = threading.Event()

        def release() -> None:
            with self._lock:
                if released.is_set():
                    return
                released.set()
                self._release(client)
        return release

    def _release(self, client: str) -> None:
        """Gives one of `client`'s slots back (the caller holds the lock)."""
        held = self._open.get(client, 0)
        if held <= 1:
            self._open.pop(client, None)
        else:
            self._open[client] = held - 1
        self._total -= 1

    @property
    def open_streams(self) -> int:
        with self._lock:
            return self._total


def peer_key(metadata: Sequence[tuple[str, object]] | None, peer: str,
             trust_token: bool) -> str:
    """Who a call is from: its bearer token when tokens are checked (`trust_token`: the server
    has --auth-token-file, so the token is a verified identity), else its address without port.

    An unchecked token is not an identity (a client could make up a new one per call), and
    ports are dropped because one client opens many connections from different ports.
    """
    if trust_token:
        for key, value in metadata or ():
            if key == "authorization":
                return f"token:{value!s}"
    host, _, port = peer.rpartition(":")
    return host if host and port.isdigit() else peer


def check_identifiers(request_id: str, cache_salt: str) -> None:
    """request_id and cache_salt fit their (fixed) limits."""
    if len(request_id) > MAX_REQUEST_ID_CHARS:
        raise InvalidRequest(
            f"request_id has {len(request_id)} characters, over the limit of "
            f"{MAX_REQUEST_ID_CHARS}")
    if cache_salt.startswith(ADAPTER_SALT_PREFIX):
        # An adapter request's salt starts so (gateway/adapters.py): a client's own must not,
        # or a base request could share an adapter's cached KV.
        raise InvalidRequest(f"cache_salt must not start with {ADAPTER_SALT_PREFIX!r} "
                             "(reserved for LoRA adapters' prefixes)")
    salt_bytes = len(cache_salt.encode("utf-8", "surrogatepass"))
    if salt_bytes > MAX_CACHE_SALT_BYTES:
        raise InvalidRequest(
            f"cache_salt has {salt_bytes} bytes, over the limit of {MAX_CACHE_SALT_BYTES} "
            f"bytes (the block service's)")


def stream_interval(asked: int | None, default: int) -> int:
    """A request's stream_interval: its own (checked) or the gateway's --stream-interval."""
    if asked is None:
        return default
    if not 1 <= asked <= MAX_STREAM_INTERVAL:
        raise InvalidRequest(f"stream_interval must be in [1, {MAX_STREAM_INTERVAL}], "
                             f"got {asked}")
    return asked


def check_prompt_length(num_tokens: int, limits: Limits) -> None:
    """The prompt is within --max-prompt-tokens (checked before its ids are copied out)."""
    if num_tokens > limits.max_prompt_tokens:
        raise InvalidRequest(
            f"the prompt has {num_tokens} tokens, over the limit of "
            f"{limits.max_prompt_tokens} prompt tokens (--max-prompt-tokens)"
        )


def check_prompt_ids(token_ids: Sequence[int], limits: Limits) -> None:
    """The prompt is non-empty, every id is in the vocabulary, and room is left to generate."""
    if not token_ids:
        raise InvalidRequest("the prompt is empty")
    check_prompt_length(len(token_ids), limits)
    low, high = min(token_ids), max(token_ids)
    if low < 0 or high >= limits.vocab_size:
        bad = low if low < 0 else high
        raise InvalidRequest(f"prompt token id {bad} is outside [0, {limits.vocab_size})")
    if len(token_ids) >= limits.max_len:
        raise InvalidRequest(
            f"the prompt has {len(token_ids)} tokens; this server takes at most "
            f"{limits.max_len} tokens of prompt and output together (max_model_len, or what "
            f"its KV cache holds), so at most {limits.max_len - 1} prompt tokens"
        )


def sampling_config(params: gateway_pb2.SamplingParams, prompt_len: int, limits: Limits,
                    random_seed: int, default_max_tokens: int | None = None) -> SamplingConfig:
    """Validated parameters with defaults filled in (`random_seed` when none is given;
    max_tokens: what fits, capped at `default_max_tokens` when given)."""
    room = limits.max_len - prompt_len
    max_tokens = min(room, limits.max_tokens, default_max_tokens or room)
    if params.HasField("max_tokens"):
        if params.max_tokens < 1:
            raise InvalidRequest("max_tokens must be >= 1")
        if params.max_tokens > limits.max_tokens:
            raise InvalidRequest(
                f"max_tokens {params.max_tokens} is over the limit of {limits.max_tokens} "
                f"(--max-tokens-limit)"
            )
        if params.max_tokens > room:
            raise InvalidRequest(
                f"max_tokens {params.max_tokens} does not fit: prompt ({prompt_len} tokens) + "
                f"max_tokens must be <= {limits.max_len}"
            )
        max_tokens = params.max_tokens
    temperature = _temperature(params)
    top_p = _top_p(params)
    top_k = params.top_k if params.HasField("top_k") else 0
    if top_k > limits.vocab_size:
        raise InvalidRequest(f"top_k {top_k} exceeds the vocabulary size {limits.vocab_size}")
    min_p = params.min_p if params.HasField("min_p") else 0.0
    if not (math.isfinite(min_p) and 0.0 <= min_p <= 1.0):
        raise InvalidRequest(f"min_p must be in [0, 1], got {min_p}")
    n = params.n if params.HasField("n") else 1
    if not 1 <= n <= limits.max_n:
        raise InvalidRequest(f"n must be in [1, {limits.max_n}] (--max-n), got {n}")
    logprobs = params.logprobs if params.HasField("logprobs") else None
    if logprobs is not None and logprobs > MAX_LOGPROBS:
        raise InvalidRequest(f"logprobs must be <= {MAX_LOGPROBS}, got {logprobs}")
    _check_stop(params, limits)
    presence, frequency, repetition = _penalties(params)
    return SamplingConfig(
        max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
        min_p=min_p, seed=params.seed if params.HasField("seed") else random_seed,
        stop=tuple(params.stop), stop_token_ids=frozenset(params.stop_token_ids),
        ignore_eos=params.ignore_eos, n=n, logprobs=logprobs, presence_penalty=presence,
        frequency_penalty=frequency, repetition_penalty=repetition,
        logit_bias=_logit_bias(params, limits),
    )


def _penalties(params: gateway_pb2.SamplingParams) -> tuple[float, float, float]:
    """presence_penalty and frequency_penalty in [-2, 2], repetition_penalty in (0, 2]."""
    values = []
    for name, default in (("presence_penalty", 0.0), ("frequency_penalty", 0.0)):
        value = getattr(params, name) if params.HasField(name) else default
        if not (math.isfinite(value) and -2.0 <= value <= 2.0):
            raise InvalidRequest(f"{name} must be in [-2, 2], got {value}")
        values.append(value)
    repetition = params.repetition_penalty if params.HasField("repetition_penalty") else 1.0
    if not (math.isfinite(repetition) and 0.0 < repetition <= 2.0):
        raise InvalidRequest(f"repetition_penalty must be in (0, 2], got {repetition}")
    return values[0], values[1], repetition


def _logit_bias(params: gateway_pb2.SamplingParams,
                limits: Limits) -> tuple[tuple[int, float], ...]:
    """logit_bias as (token id, bias) sorted by token id, the biases clamped to [-100, 100]
    (OpenAI's semantics); refused: too many entries, ids outside the vocabulary, NaN / inf."""
    bias = params.logit_bias
    if not bias:
        return ()
    if len(bias) > MAX_LOGIT_BIAS:
        raise InvalidRequest(
            f"logit_bias has {len(bias)} entries, over the limit of {MAX_LOGIT_BIAS}")
    entries = []
    for token_id, value in sorted(bias.items()):
        if not 0 <= token_id < limits.vocab_size:
            raise InvalidRequest(
                f"logit_bias: token id {token_id} is outside [0, {limits.vocab_size})")
        if not math.isfinite(value):
            raise InvalidRequest(
                f"logit_bias: the bias of token {token_id} must be a finite number in "
                f"[-{LOGIT_BIAS_LIMIT:g}, {LOGIT_BIAS_LIMIT:g}], got {value}")
        entries.append((token_id, min(max(value, -LOGIT_BIAS_LIMIT), LOGIT_BIAS_LIMIT)))
    return tuple(entries)


def _temperature(params: gateway_pb2.SamplingParams) -> float:
    temperature = params.temperature if params.HasField("temperature") else 1.0
    if not (math.isfinite(temperature) and temperature >= 0.0):
        raise InvalidRequest(f"temperature must be finite and >= 0, got {temperature}")
    return temperature


def _top_p(params: gateway_pb2.SamplingParams) -> float:
    top_p = params.top_p if params.HasField("top_p") else 1.0
    if not (math.isfinite(top_p) and 0.0 < top_p <= 1.0):
        raise InvalidRequest(f"top_p must be in (0, 1], got {top_p}")
    return top_p


def _check_stop(params: gateway_pb2.SamplingParams, limits: Limits) -> None:
    if len(params.stop) > limits.max_stop_strings:
        raise InvalidRequest(
            f"{len(params.stop)} stop strings, over the limit of {limits.max_stop_strings} "
            f"(--max-stop-strings)"
        )
    for stop in params.stop:
        if not stop:
            raise InvalidRequest("stop strings must not be empty")
        if len(stop) > limits.max_stop_string_chars:
            raise InvalidRequest(
                f"a stop string has {len(stop)} characters, over the limit of "
                f"{limits.max_stop_string_chars} (--max-stop-string-chars)"
            )
    if len(params.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise InvalidRequest(
            f"{len(params.stop_token_ids)} stop_token_ids, over the limit of "
            f"{MAX_STOP_TOKEN_IDS}")
    for token_id in params.stop_token_ids:
        if not 0 <= token_id < limits.vocab_size:
            raise InvalidRequest(
                f"stop_token_ids: {token_id} is outside [0, {limits.vocab_size})"
            )
