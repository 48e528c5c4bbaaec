"""Requests for the gateway fuzz: hostile ones, and hostile-but-valid ones with their oracle.

Hostile requests mostly stop at validation. Hostile-but-valid ones sit at the edges of every
limit the gateway documents (gateway/validation.py, protos/gateway.proto) and are built to
pass them all, so they reach the scheduler and the engine; `check_completion` then holds what
the gateway streamed against the fake model (`expected_tokens`), computed here, apart from it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from hypothesis import strategies as st

from gateway.client import Completion
from gateway.request import output_seed
from gateway.tokenizer import CHAT_ROLES, ChatMessage, Tokenizer
from gateway.validation import (
    MAX_CACHE_SALT_BYTES,
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    MAX_REQUEST_ID_CHARS,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
)
from protos import gateway_pb2
from tests.gateway.fake_runner import EOS, VOCAB, expected_tokens
from tests.gateway.stack import BLOCK_SIZE

# The fuzzed gateway: 64 blocks of 4 tokens, so prompt + output <= 256 (max_len).
# --max-prompt-tokens is max_len, so both prompt checks can refuse (a prompt of max_len
# tokens leaves no room, one token more is over the limit) and a valid prompt may leave less
# room than max_tokens (and, with n outputs, need preemption to finish). max_tokens stays at
# 4, as before valid requests were fuzzed: each costs a few steps, so the run time stays
# close to what it was.
NUM_BLOCKS = 64
MAX_LEN = NUM_BLOCKS * BLOCK_SIZE
MAX_TOKENS = 4
MAX_PROMPT_TOKENS = MAX_LEN
MAX_N = 8
LIMITS = dict(max_tokens_limit=MAX_TOKENS, max_prompt_tokens=MAX_PROMPT_TOKENS, max_n=MAX_N,
              max_num_seqs=MAX_N, max_num_batched_tokens=64)

# Float32 edges (the proto's floats are float32): the smallest subnormal and normal, the
# largest finite value, and the float32 just under 1.
F32_TINY = 1.401298464324817e-45
F32_SMALLEST_NORMAL = 1.1754943508222875e-38
F32_MAX = 3.4028234663852886e38
F32_BELOW_ONE = 0.9999999403953552


T = TypeVar("T")


@dataclass(frozen=True)
class Case:
    """A request to send, and whether it was built within every limit (then it must be
    served: OK, never INVALID_ARGUMENT)."""

    request: gateway_pb2.GenerateRequest
    valid: bool


# Strategies are built once, here: building them inside a composite on every draw costs
# Hypothesis more time (validating them) than the gateway spends serving the request.

# ----- hostile requests: any value of every field ------------------------------------------

HOSTILE_FLOATS = st.one_of(
    st.sampled_from([math.nan, math.inf, -math.inf, -0.0, 0.0, 1.0, -1.0, 3.4e38, -3.4e38,
                     1e-45]),
    st.floats(width=32, allow_nan=True, allow_infinity=True),
)
U32 = st.one_of(st.sampled_from([0, 1, 2, 3, 4, 5, MAX_TOKENS, MAX_TOKENS + 1, 2**31 - 1,
                                 2**32 - 1]),
                st.integers(0, 2**32 - 1))
I32 = st.one_of(st.sampled_from([-(2**31), -1, 0, 1, VOCAB - 1, VOCAB, 2**31 - 1]),
                st.integers(-(2**31), 2**31 - 1), st.integers(0, 300))
TEXT = st.text(max_size=200)
# Around the limits of request_id (256 characters) and cache_salt (1024 bytes).
LONG_OR_SHORT = st.one_of(st.text(max_size=40), st.text(min_size=250, max_size=1100))
ROLES = st.one_of(st.sampled_from(["system", "user", "assistant", "", "tool", "USER",
                                   "user\x00"]), st.text(max_size=10))
HOSTILE_MESSAGES = st.lists(st.tuples(ROLES, TEXT), max_size=5)
# Around --max-prompt-tokens and max_len, and far over both. Long prompts repeat a few drawn
# ids: drawing each of hundreds of ids would mostly overrun Hypothesis's buffer, and the
# request would never be sent.
HOSTILE_PROMPT_LENGTHS = st.sampled_from([0, 1, 5, 30, MAX_LEN - 1, MAX_LEN,
                                          MAX_PROMPT_TOKENS + 1, 2000])
HOSTILE_ID_PATTERNS = st.lists(I32, min_size=1, max_size=8)
HOSTILE_PARAMS = (("max_tokens", U32), ("temperature", HOSTILE_FLOATS),
                  ("top_p", HOSTILE_FLOATS), ("top_k", U32), ("min_p", HOSTILE_FLOATS),
                  ("seed", st.integers(0, 2**64 - 1)), ("n", U32), ("logprobs", U32),
                  ("presence_penalty", HOSTILE_FLOATS), ("frequency_penalty", HOSTILE_FLOATS),
                  ("repetition_penalty", HOSTILE_FLOATS))
# Around the entry limit (1024), ids around the vocabulary, biases NaN / inf / huge.
HOSTILE_LOGIT_BIAS = st.one_of(
    st.dictionaries(I32, HOSTILE_FLOATS, max_size=6),
    st.builds(lambda n, v: {i: v for i in range(n)},
              st.sampled_from([MAX_LOGIT_BIAS, MAX_LOGIT_BIAS + 1]), st.just(1.0)))
HOSTILE_STOPS = st.lists(st.text(max_size=300), max_size=20)
HOSTILE_STOP_IDS = st.lists(I32, max_size=20)
INPUTS = st.sampled_from(["prompt", "messages", "token_ids", "none"])


@st.composite
def hostile_sampling_params(draw: st.DrawFn) -> gateway_pb2.SamplingParams:
    params = gateway_pb2.SamplingParams()
    for name, strategy in HOSTILE_PARAMS:
        if draw(st.booleans()):
            setattr(params, name, draw(strategy))
    params.stop.extend(draw(HOSTILE_STOPS))
    params.stop_token_ids.extend(draw(HOSTILE_STOP_IDS))
    params.ignore_eos = draw(st.booleans())
    if draw(st.booleans()):
        params.logit_bias.update(draw(HOSTILE_LOGIT_BIAS))
    return params


@st.composite
def hostile_requests(draw: st.DrawFn) -> gateway_pb2.GenerateRequest:
    request = gateway_pb2.GenerateRequest(request_id=draw(LONG_OR_SHORT),
                                          cache_salt=draw(LONG_OR_SHORT))
    which = draw(INPUTS)
    if which == "prompt":
        request.prompt = draw(TEXT)
    elif which == "messages":
        request.messages.SetInParent()
        for role, content in draw(HOSTILE_MESSAGES):
            request.messages.messages.add(role=role, content=content)
    elif which == "token_ids":
        request.prompt_token_ids.SetInParent()
        size = draw(HOSTILE_PROMPT_LENGTHS)
        pattern = draw(HOSTILE_ID_PATTERNS)
        request.prompt_token_ids.token_ids.extend((pattern * size)[:size])
    if draw(st.booleans()):
        request.sampling_params.CopyFrom(draw(hostile_sampling_params()))
    return request


# ----- hostile-but-valid requests ----------------------------------------------------------

# Characters tokenizers and text handling trip on: NUL and controls, combining marks, astral
# characters (4 UTF-8 bytes, two UTF-16 units; never surrogates, which proto strings cannot
# hold), right-to-left text and overrides, zero-width characters and the BOM, the last code
# point, and the model's own special-token text.
EDGE_CHARS = ["\x00", "\x01", "\n", "\r", "\t", " ", "a", "\u0301", "\u0338", "\u20dd",
              "\U0001F600", "\U0001F1FA", "\U0001F1F8", "\U0001D54F", "\U00020000",
              "\u202e", "\u200f", "\u05d0", "\u0627", "\ufb50", "\u200b", "\u200d", "\u2060",
              "\ufeff", "\ufffd", "\U0010ffff", "é", "\u00a0"]
SPECIAL_TEXT = ["<|im_end|>", "<|im_start|>", "<|endoftext|>"]
EDGE_CHAR = st.one_of(st.sampled_from(EDGE_CHARS), st.characters(codec="utf-8"))
# UTF-8 takes at most 4 bytes a character and the byte-level tokenizer at most one token a
# byte, so these sizes keep every text prompt (chat template included: ~30 tokens plus ~5 a
# message) well under max_len; `valid_prompt` asserts it.
MAX_PROMPT_CHARS = 48
MAX_MESSAGE_CHARS = 16


def edge_text(min_size: int, max_size: int) -> st.SearchStrategy[str]:
    """Text of edge characters, sometimes with a special token's text spliced in (cut to
    `max_size`; `min_size` holds for the plain text only)."""
    plain = st.text(EDGE_CHAR, min_size=min_size, max_size=max_size)
    spliced = st.builds(lambda a, s, b: (a + s + b)[:max_size],
                        st.text(EDGE_CHAR, max_size=4), st.sampled_from(SPECIAL_TEXT),
                        st.text(EDGE_CHAR, max_size=4))
    return st.one_of(plain, spliced)


def long_text(size: int) -> st.SearchStrategy[str]:
    """Text of exactly `size` characters: a short edge piece repeated (drawing each of
    hundreds of characters would mostly overrun Hypothesis's buffer)."""
    return st.text(EDGE_CHAR, min_size=1, max_size=5).map(
        lambda piece: (piece * (size // len(piece) + 1))[:size])


def maybe(strategy: st.SearchStrategy[T]) -> st.SearchStrategy[T | None]:
    """The value, or None for "leave the field unset" (its default applies)."""
    return st.one_of(st.none(), strategy)


PROMPT_KINDS = st.sampled_from(["token_ids", "prompt", "messages"])
TEXT_PROMPTS = edge_text(1, MAX_PROMPT_CHARS)
MESSAGES = st.lists(st.tuples(st.sampled_from(CHAT_ROLES), edge_text(0, MAX_MESSAGE_CHARS)),
                    min_size=1, max_size=3)
# A token-id prompt is an arithmetic run (base + step * i) ending in a few drawn ids. Bases
# and steps repeat often (later prompts hit the prefix cache, and a wrong hit shows as wrong
# tokens); step 0 gives runs of one id: all EOS, all 0, all the last id.
TOKEN_ID = st.one_of(st.sampled_from([0, 1, EOS, 15, 16, VOCAB - 1]), st.integers(0, VOCAB - 1))
RUN_BASES = st.one_of(st.sampled_from([0, EOS, 300, VOCAB - 1]), st.integers(0, VOCAB - 1))
RUN_STEPS = st.one_of(st.sampled_from([0, 1, 7]), st.integers(0, VOCAB - 1))
TAILS = st.lists(TOKEN_ID, max_size=8)
VALID_PROMPT_LENGTHS = st.one_of(
    st.sampled_from([1, 2, 3, 4, 5, 8, 9, 63, 64, 65, MAX_LEN - MAX_TOKENS, MAX_LEN - 3,
                     MAX_LEN - 1]),
    st.integers(1, 80),
)
MAX_TOKENS_ASKED = maybe(st.one_of(st.sampled_from([1, MAX_TOKENS]),
                                   st.integers(1, MAX_TOKENS)))
SEEDS = st.one_of(st.sampled_from([0, 1, 2**31 - 1, 2**32, 2**63 - 1, 2**63, 2**64 - 1]),
                  st.integers(0, 2**64 - 1))
TEMPERATURES = st.one_of(st.sampled_from([0.0, -0.0, F32_TINY, F32_SMALLEST_NORMAL, 1.0,
                                          F32_MAX]),
                         st.floats(0.0, F32_MAX, width=32))
TOP_PS = st.one_of(st.sampled_from([F32_TINY, F32_SMALLEST_NORMAL, F32_BELOW_ONE, 1.0]),
                   st.floats(F32_TINY, 1.0, width=32))
TOP_KS = st.one_of(st.sampled_from([0, 1, 2, VOCAB - 1, VOCAB]), st.integers(0, VOCAB))
MIN_PS = st.one_of(st.sampled_from([0.0, F32_TINY, 0.5, F32_BELOW_ONE, 1.0]),
                   st.floats(0.0, 1.0, width=32))
LOGPROBS = st.one_of(st.sampled_from([0, 1, MAX_LOGPROBS]), st.integers(0, MAX_LOGPROBS))
NS = st.one_of(st.sampled_from([1, 2, MAX_N]), st.integers(1, MAX_N))
# A prompt that fills most of the pool leaves no block for its outputs' own last blocks, so
# all outputs but one are preempted and recomputed, ~35 ms each here: 3 outputs still
# preempt, twice, while n = 8 would take ~0.3 s a request.
LONG_PROMPT_MAX_N = 3
# Penalties at and inside their ranges (presence / frequency [-2, 2], repetition (0, 2]).
PENALTIES = st.one_of(st.sampled_from([-2.0, -0.0, 0.0, 0.5, 2.0]), st.floats(-2, 2, width=32))
REPETITION_PENALTIES = st.one_of(st.sampled_from([F32_TINY, 1.0, 1.3, 2.0]),
                                 st.floats(F32_TINY, 2.0, width=32))
# Biases: within [-100, 100], and finite ones past it (clamped, not refused); up to the limit.
LOGIT_BIAS = st.one_of(
    st.dictionaries(TOKEN_ID, st.floats(-F32_MAX, F32_MAX, width=32), max_size=6),
    st.builds(lambda start, v: {(start + i) % VOCAB: v for i in range(MAX_LOGIT_BIAS)},
              st.integers(0, VOCAB - 1), st.sampled_from([-100.0, 100.0, 1e30])))
VALID_PARAMS: tuple[tuple[str, st.SearchStrategy[Any]], ...] = (
    ("temperature", maybe(TEMPERATURES)), ("top_p", maybe(TOP_PS)), ("top_k", maybe(TOP_KS)),
    ("min_p", maybe(MIN_PS)), ("seed", maybe(SEEDS)), ("n", maybe(NS)),
    ("logprobs", maybe(LOGPROBS)), ("presence_penalty", maybe(PENALTIES)),
    ("frequency_penalty", maybe(PENALTIES)),
    ("repetition_penalty", maybe(REPETITION_PENALTIES)))
# Salts: a few short ones shared between requests (cache hits, and separation between salts),
# and long ones up to the byte limit (4 bytes a character at most).
SALTS = st.one_of(st.sampled_from(["", "a", "b", "\x00", "\U0001F600"]),
                  st.text(EDGE_CHAR, max_size=8), long_text(MAX_CACHE_SALT_BYTES // 4))
REQUEST_IDS = st.one_of(st.text(EDGE_CHAR, max_size=8), long_text(MAX_REQUEST_ID_CHARS))
# Stop strings up to the count and length limits (lengths count characters, so 256 astral
# characters, 1 KiB of UTF-8, still fit), leaving room for one that fires.
STOPS = st.lists(st.one_of(edge_text(1, 8), long_text(MAX_STOP_STRING_CHARS)),
                 max_size=MAX_STOP_STRINGS - 1)
# Stop ids: a few, or a run over the vocabulary up to the limit (but one, for one that fires).
MANY_STOP_IDS = st.builds(
    lambda start, step, count: [(start + step * i) % VOCAB for i in range(count)],
    st.integers(0, VOCAB - 1), st.integers(1, VOCAB - 1),
    st.sampled_from([MAX_STOP_TOKEN_IDS - 1, MAX_STOP_TOKEN_IDS - 300]))
STOP_IDS = st.one_of(st.lists(TOKEN_ID, max_size=8), MANY_STOP_IDS)
ANY_INDEX = st.integers(0, 1 << 16)  # taken modulo a length: one strategy for every length


@st.composite
def valid_prompt(draw: st.DrawFn, request: gateway_pb2.GenerateRequest,
                 tokenizer: Tokenizer) -> list[int]:
    """Sets a prompt on `request` that passes validation; returns its token ids."""
    which = draw(PROMPT_KINDS)
    if which == "token_ids":
        length = draw(VALID_PROMPT_LENGTHS)
        tail = draw(TAILS)[:length]
        base, step = draw(RUN_BASES), draw(RUN_STEPS)
        run = [(base + step * i) % VOCAB for i in range(length - len(tail))]
        prompt_ids = [*run, *tail]
        request.prompt_token_ids.token_ids.extend(prompt_ids)
    elif which == "prompt":
        request.prompt = draw(TEXT_PROMPTS)
        prompt_ids = tokenizer.encode(request.prompt)
        if not prompt_ids:
            # The default model's vocabulary lacks a few control bytes (\x04, \x06, \x13,
            # \x14, \x16, \x1d), which its tokenizer drops: a text of only those is an empty
            # prompt, rightly refused. One plain character keeps the request valid.
            request.prompt += "a"
            prompt_ids = tokenizer.encode(request.prompt)
    else:
        messages = draw(MESSAGES)
        for role, content in messages:
            request.messages.messages.add(role=role, content=content)
        prompt_ids = tokenizer.encode_chat([ChatMessage(r, c) for r, c in messages])
    assert 1 <= len(prompt_ids) < MAX_LEN, "the strategy built an invalid prompt"
    return prompt_ids


@st.composite
def valid_cases(draw: st.DrawFn, tokenizer: Tokenizer) -> Case:
    """A request at the edges of every limit that the gateway must serve."""
    request = gateway_pb2.GenerateRequest(request_id=draw(REQUEST_IDS),
                                          cache_salt=draw(SALTS),
                                          final_only=draw(st.booleans()))
    prompt_ids = draw(valid_prompt(request, tokenizer))
    params = request.sampling_params
    max_tokens = draw(MAX_TOKENS_ASKED)
    if max_tokens is not None:
        # Cut to the room the prompt leaves: a long prompt then asks for exactly that room.
        params.max_tokens = min(max_tokens, MAX_LEN - len(prompt_ids))
    for name, strategy in VALID_PARAMS:
        value = draw(strategy)
        if value is not None:
            setattr(params, name, value)
    if len(prompt_ids) > MAX_LEN // 2 and params.n > LONG_PROMPT_MAX_N:
        params.n = LONG_PROMPT_MAX_N
    params.ignore_eos = draw(st.booleans())
    if draw(st.booleans()):
        params.logit_bias.update(draw(LOGIT_BIAS))
    params.stop.extend(draw(STOPS))
    params.stop_token_ids.extend(draw(STOP_IDS))
    # Stops that fire: a token and a piece of text the first output will produce (known
    # only when the request is greedy or seeded).
    expected = predicted_tokens(request, prompt_ids, 0)
    if expected and draw(st.booleans()):
        params.stop_token_ids.append(expected[draw(ANY_INDEX) % len(expected)])
    if expected and draw(st.booleans()):
        text = tokenizer.decode(expected)
        start = draw(ANY_INDEX) % (len(text) + 1)
        piece = text[start:start + 1 + draw(ANY_INDEX) % 6]
        if piece:
            params.stop.append(piece)
    assert len(params.stop) <= MAX_STOP_STRINGS
    assert len(params.stop_token_ids) <= MAX_STOP_TOKEN_IDS
    return Case(request, valid=True)


# About two requests in five are valid (Hypothesis does not draw uniformly: 45-53 % in runs
# of 900): each costs the gateway a few steps (~15 ms here) where a refused one costs ~1 ms,
# so more would slow the fuzz for little. With the hostile ones that pass, about half of the
# requests reach the engine.
VALID_OR_NOT = st.sampled_from([False, False, False, True, True])


@st.composite
def cases(draw: st.DrawFn, tokenizer: Tokenizer) -> Case:
    """A hostile request, or a hostile-but-valid one."""
    if draw(VALID_OR_NOT):
        return draw(valid_cases(tokenizer))
    return Case(draw(hostile_requests()), valid=False)


# ----- the oracle --------------------------------------------------------------------------

def prompt_ids_of(request: gateway_pb2.GenerateRequest, tokenizer: Tokenizer) -> list[int]:
    """The prompt's token ids (for a request the gateway served, so the prompt is valid)."""
    which = request.WhichOneof("input")
    if which == "prompt_token_ids":
        return list(request.prompt_token_ids.token_ids)
    if which == "prompt":
        return tokenizer.encode(request.prompt)
    return tokenizer.encode_chat([ChatMessage(m.role, m.content)
                                  for m in request.messages.messages])


def effective_max_tokens(request: gateway_pb2.GenerateRequest, prompt_len: int) -> int:
    """max_tokens as the gateway applies it: as asked, or what the limits leave."""
    params = request.sampling_params
    if params.HasField("max_tokens"):
        return params.max_tokens
    return min(MAX_LEN - prompt_len, MAX_TOKENS)


def predicted_tokens(request: gateway_pb2.GenerateRequest, prompt_ids: Sequence[int],
                     index: int) -> list[int] | None:
    """What output `index` generates when nothing stops it, or None when it cannot be known
    (sampling with a seed the gateway picks at random). The fake model is greedy at
    temperature 0 (-0.0 included) and otherwise seeded with the output's seed."""
    params = request.sampling_params
    temperature = params.temperature if params.HasField("temperature") else 1.0
    if temperature == 0:
        seed = None
    elif params.HasField("seed"):
        seed = output_seed(params.seed, index)
    else:
        return None
    return expected_tokens(prompt_ids, effective_max_tokens(request, len(prompt_ids)), seed)


def check_completion(request: gateway_pb2.GenerateRequest, prompt_ids: Sequence[int],
                     completion: Completion) -> None:
    """What a served request streamed agrees with the fake model and the request's params."""
    params = request.sampling_params
    n = params.n if params.HasField("n") else 1
    max_tokens = effective_max_tokens(request, len(prompt_ids))
    # Tokens that end an output: stop ids, and EOS unless ignored (the fake model never
    # samples EOS, but a prompt may hold it: it must not end anything there).
    stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else {EOS})
    assert len(completion.token_ids) == n, f"{len(completion.token_ids)} outputs, asked {n}"
    usage = completion.usage
    assert usage is not None, "no usage in the last message"
    assert usage.prompt_tokens == len(prompt_ids)
    assert usage.completion_tokens == sum(len(ids) for ids in completion.token_ids)
    assert usage.cached_tokens <= usage.prompt_tokens, f"cached {usage.cached_tokens} > prompt"
    for index, (ids, text, reason) in enumerate(zip(
            completion.token_ids, completion.texts, completion.finish_reasons, strict=True)):
        where = f"output {index} ({len(ids)} tokens, {reason!r})"
        assert 1 <= len(ids) <= max_tokens, where
        predicted = predicted_tokens(request, prompt_ids, index)
        if predicted is not None:
            assert ids == predicted[:len(ids)], f"{where}: not the oracle's tokens"
        # The first stop token ends the output; it is returned, as the last token.
        assert not stop_ids.intersection(ids[:-1]), f"{where}: went on past a stop token"
        if ids[-1] in stop_ids:
            assert reason == "stop", where
        elif reason == "stop":
            assert params.stop, f"{where}: stopped with no stop token or string"
        else:
            assert reason == "length" and len(ids) == max_tokens, where
        assert not any(stop in text for stop in params.stop), f"{where}: stop string streamed"
        logprobs = completion.logprobs[index]
        if params.HasField("logprobs"):
            assert [p.token.token_id for p in logprobs] == ids, where
            assert all(len(p.top) == params.logprobs for p in logprobs), where
        else:
            assert not logprobs, where
