"""Checks of a Generate request, done before any work starts.

Each check raises InvalidRequest with a message that names the field and the allowed range;
the servicer answers INVALID_ARGUMENT with it. Nothing here has side effects.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from gateway.sequence import SamplingConfig
from protos import gateway_pb2

MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256


class InvalidRequest(ValueError):
    """A request that cannot be served as sent."""


@dataclass(frozen=True)
class Limits:
    """What the served model and the gateway's configuration allow."""

    vocab_size: int
    max_len: int  # longest prompt + output
    max_n: int


def check_prompt_ids(token_ids: Sequence[int], limits: Limits) -> None:
    """The prompt is non-empty, every id is in the vocabulary, and room is left to generate."""
    if not token_ids:
        raise InvalidRequest("the prompt is empty")
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
                    random_seed: int) -> SamplingConfig:
    """Validated parameters with defaults filled in (`random_seed` when none is given)."""
    room = limits.max_len - prompt_len
    max_tokens = room
    if params.HasField("max_tokens"):
        if params.max_tokens < 1:
            raise InvalidRequest("max_tokens must be >= 1")
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
        raise InvalidRequest(f"n must be in [1, {limits.max_n}], got {n}")
    logprobs = params.logprobs if params.HasField("logprobs") else None
    if logprobs is not None and logprobs > MAX_LOGPROBS:
        raise InvalidRequest(f"logprobs must be <= {MAX_LOGPROBS}, got {logprobs}")
    _check_stop(params, limits)
    return SamplingConfig(
        max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
        min_p=min_p, seed=params.seed if params.HasField("seed") else random_seed,
        stop=tuple(params.stop), stop_token_ids=frozenset(params.stop_token_ids),
        ignore_eos=params.ignore_eos, n=n, logprobs=logprobs,
    )


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
    if len(params.stop) > MAX_STOP_STRINGS:
        raise InvalidRequest(f"at most {MAX_STOP_STRINGS} stop strings")
    for stop in params.stop:
        if not stop:
            raise InvalidRequest("stop strings must not be empty")
        if len(stop) > MAX_STOP_STRING_CHARS:
            raise InvalidRequest(f"stop strings must be at most {MAX_STOP_STRING_CHARS} characters")
    for token_id in params.stop_token_ids:
        if not 0 <= token_id < limits.vocab_size:
            raise InvalidRequest(
                f"stop_token_ids: {token_id} is outside [0, {limits.vocab_size})"
            )
