"""Greedy generation with Hugging Face transformers: the outside oracle of the e2e tests."""

from __future__ import annotations

import functools
import inspect
import os
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from common.model_store import resolve_model
from tests.e2e.close_logprobs import Generation

# Computing a few more tokens than asked lets tests that want fewer share one generation.
_MIN_NEW_TOKENS = 24
# (model folder, prompt) -> (tokens generated, max_new_tokens they were generated with)
_generated: dict[tuple[Path | None, tuple[int, ...]], tuple[list[int], int]] = {}
# (model folder, dtype, prompt, top k) -> (generation, max_new_tokens it was generated with)
_with_logprobs: dict[tuple[Path | None, torch.dtype, tuple[int, ...], int],
                     tuple[Generation, int]] = {}


def _model(path: Path | None, dtype: torch.dtype = torch.float32) -> AutoModelForCausalLM:
    # One key per folder and dtype however they are named: each model is loaded once.
    return _load(path or resolve_model(None), dtype)


@functools.cache
def _load(path: Path, dtype: torch.dtype) -> AutoModelForCausalLM:
    # Two threads at most: the services under test share the CPU, and torch's thread pool
    # spins badly when oversubscribed; but the tests ask the oracle after their requests are
    # answered, when the services are idle, and there two threads beat one (tests/e2e:
    # 227 -> 192 s on the 2-core VM, 2026-12-06).
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    model.eval()
    return model


def greedy(prompt_ids: Sequence[int], max_new_tokens: int,
           model: Path | None = None) -> list[int]:
    """transformers' greedy generate for one prompt alone (stops after EOS, like pagewire),
    with the model in folder `model` (default: the default model)."""
    key = (model, tuple(prompt_ids))
    known = _generated.get(key)
    if known is None or known[1] < max_new_tokens:
        budget = max(max_new_tokens, _MIN_NEW_TOKENS)
        known = (_generate(model, key[1], budget), budget)
        _generated[key] = known
    return known[0][:max_new_tokens]


def _generate(path: Path | None, prompt_ids: tuple[int, ...],
              max_new_tokens: int) -> list[int]:
    model = _model(path)
    with torch.no_grad():
        output = model.generate(
            torch.tensor([list(prompt_ids)]), max_new_tokens=max_new_tokens, do_sample=False,
            attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
        )
    return [int(t) for t in output[0, len(prompt_ids):]]


def greedy_logprobs(prompt_ids: Sequence[int], max_new_tokens: int,
                    model: Path | None = None, dtype: torch.dtype = torch.bfloat16,
                    top_k: int = 5) -> Generation:
    """transformers' greedy generate for one prompt alone with the model in `dtype` (stops
    after EOS), with the `top_k` most likely (token, log-prob) at each generated position:
    log_softmax in float32 of the raw logits, before any logits processor."""
    key = (model, dtype, tuple(prompt_ids), top_k)
    known = _with_logprobs.get(key)
    if known is None or known[1] < max_new_tokens:
        known = (_generate_logprobs(model, dtype, key[2], max_new_tokens, top_k),
                 max_new_tokens)
        _with_logprobs[key] = known
    generation = known[0]
    return Generation(generation.tokens[:max_new_tokens], generation.top[:max_new_tokens])


def _generate_logprobs(path: Path | None, dtype: torch.dtype, prompt_ids: tuple[int, ...],
                       max_new_tokens: int, top_k: int) -> Generation:
    with torch.no_grad():
        output = _model(path, dtype).generate(
            torch.tensor([list(prompt_ids)]), max_new_tokens=max_new_tokens, do_sample=False,
            attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
            output_logits=True, return_dict_in_generate=True,
        )
    tokens = [int(t) for t in output.sequences[0, len(prompt_ids):]]
    top = []
    for logits in output.logits:  # one [1, vocab] per generated token
        values, ids = torch.log_softmax(logits[0].float(), dim=-1).topk(top_k)
        top.append([(int(i), float(v)) for i, v in zip(ids, values, strict=True)])
    return Generation(tokens, top)


def generate(prompt_ids: Sequence[int], max_new_tokens: int,
             model: Path | None = None, **options: object) -> list[int]:
    """transformers' generate with more options (e.g. repetition_penalty), greedy, stopping
    after EOS like pagewire."""
    with torch.no_grad():
        output = _model(model).generate(
            torch.tensor([list(prompt_ids)]), max_new_tokens=max_new_tokens, do_sample=False,
            attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long), **options)
    return [int(t) for t in output[0, len(prompt_ids):]]


def greedy_openai_penalties(prompt_ids: Sequence[int], max_new_tokens: int,
                            presence_penalty: float = 0.0, frequency_penalty: float = 0.0,
                            logit_bias: dict[int, float] | None = None,
                            model: Path | None = None) -> list[int]:
    """A reference greedy loop over transformers' logits: the logit bias added, then OpenAI's
    penalties over the output so far, ``logit[j] -= count[j] * frequency_penalty +
    (count[j] > 0) * presence_penalty``, then argmax; stops after EOS."""
    eos_ids = set(_eos_ids(model))

    def pick(logits: torch.Tensor, output: list[int]) -> tuple[int, bool]:
        for token_id, bias in (logit_bias or {}).items():
            logits[token_id] += bias
        for token_id in set(output):
            count = output.count(token_id)
            logits[token_id] -= count * frequency_penalty + (count > 0) * presence_penalty
        token = int(logits.argmax())
        return token, token in eos_ids

    return _greedy_loop(prompt_ids, max_new_tokens, model, pick)


def greedy_constrained(prompt_ids: Sequence[int], max_new_tokens: int, grammar: str,
                       model: Path | None = None) -> list[int]:
    """A reference greedy loop under a format: transformers' logits, every token the
    llguidance matcher of `grammar` (an llguidance grammar, e.g. from
    LLMatcher.grammar_from_json_schema) does not allow set to -inf, then argmax; stops when the
    format is complete (as pagewire does, without sampling the end-of-sequence token)."""
    import llguidance

    folder = model or resolve_model(None)
    tokenizer = llguidance.LLTokenizer(str(folder / "tokenizer.json"),
                                       eos_token=_eos_ids(model) or None)
    matcher = llguidance.LLMatcher(tokenizer, grammar)
    assert not matcher.is_error(), matcher.get_error()

    def pick(logits: torch.Tensor, output: list[int]) -> tuple[int, bool]:
        mask = torch.frombuffer(bytearray(matcher.compute_bitmask()), dtype=torch.uint8)
        allowed = torch.zeros(mask.numel() * 8, dtype=torch.bool)
        for bit in range(8):  # little-endian words: token t is bit t % 8 of byte t // 8
            allowed[bit::8] = (mask >> bit) & 1 == 1
        logits[~allowed[:logits.numel()]] = float("-inf")
        token = int(logits.argmax())
        assert matcher.consume_token(token), matcher.get_error()
        return token, matcher.is_stopped()

    return _greedy_loop(prompt_ids, max_new_tokens, model, pick)


def _eos_ids(model: Path | None) -> list[int]:
    eos = _model(model).generation_config.eos_token_id
    return eos if isinstance(eos, list) else [] if eos is None else [eos]


def _greedy_loop(prompt_ids: Sequence[int], max_new_tokens: int, model: Path | None,
                 pick: Callable[[torch.Tensor, list[int]], tuple[int, bool]]) -> list[int]:
    """Token by token over transformers' logits (its KV cache carried): `pick(logits, output
    so far)` gives the next token and whether the output ends with it."""
    hf = _model(model)
    # transformers renames forward's KV cache argument (past_key_values -> cache).
    cache_arg = ("cache" if "cache" in inspect.signature(type(hf).forward).parameters
                 else "past_key_values")
    inputs, past = list(prompt_ids), None
    output: list[int] = []
    for _ in range(max_new_tokens):
        with torch.no_grad():
            out = hf(torch.tensor([inputs]), **{cache_arg: past}, use_cache=True)
        past = out.cache if hasattr(out, "cache") else out.past_key_values
        token, ends = pick(out.logits[0, -1].float().clone(), output)
        inputs = [token]
        output.append(token)
        if ends:
            break
    return output
