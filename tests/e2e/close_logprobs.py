"""Greedy outputs in reduced precision compared the way serving engines compare them ("close
log-probs", as vLLM's check_logprobs_close): tokens equal up to the first difference, and
there each side's token among the other side's most likely ones.

After the first difference the two continue from different contexts, so nothing after it is
compared.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

# One position's most likely tokens, most likely first: (token id, log-probability).
TopLogprobs = Sequence[tuple[int, float]]


@dataclass(frozen=True)
class Generation:
    """A greedy generation: its tokens and, per token, the top log-probs at that position."""

    tokens: Sequence[int]
    top: Sequence[TopLogprobs]


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """The first position where `a` and `b` differ (a missing token counts); None if equal."""
    for position in range(max(len(a), len(b))):
        if position >= len(a) or position >= len(b) or a[position] != b[position]:
            return position
    return None


def check_logprobs_close(reference: Generation, tested: Generation, *, min_equal: int = 8,
                         top_k: int = 5, tie_tolerance: float | None = None, label: str = "",
                         describe: Callable[[int], str] | None = None) -> int | None:
    """Asserts that `tested` is close to `reference`: the tokens are equal for at least the
    first `min_equal` positions (or all of them) and, at the first position where they differ,
    each side's token is among the other side's `top_k` log-probs there. Returns that position
    (None: equal throughout). `describe` gives a token's text for the failure message.

    With `tie_tolerance`, a difference inside the first `min_equal` is accepted where, on either
    side, the two tokens' log-probs are within it: a near tie, which rounding alone can turn
    either way (for models whose next-token distributions are nearly flat)."""
    position = first_difference(reference.tokens, tested.tokens)
    if position is None:
        return None
    where = f"{label}: " if label else ""
    details = _difference_details(reference, tested, position, top_k, describe)
    assert position < len(reference.tokens) and position < len(tested.tokens), (
        f"{where}one generation ended at position {position} and the other did not\n{details}")
    ref_top = _top_tokens(reference.top[position], top_k)
    tested_top = _top_tokens(tested.top[position], top_k)
    mutual = tested.tokens[position] in ref_top and reference.tokens[position] in tested_top
    assert mutual, (f"{where}the tokens differ at position {position} and are not in each "
                    f"other's top {top_k}\n{details}")
    near_tie = tie_tolerance is not None and min(
        _gap(reference, position, tested.tokens[position]),
        _gap(tested, position, reference.tokens[position])) <= tie_tolerance
    assert position >= min_equal or near_tie, (
        f"{where}the tokens differ at position {position}, inside the first {min_equal}"
        f"{'' if tie_tolerance is None else f' and not a tie within {tie_tolerance}'}"
        f"\n{details}")
    return position


def _gap(generation: Generation, position: int, other: int) -> float:
    """How much more likely `generation`'s own token is than `other` at `position` (in log-prob;
    infinite when either is not in its top list)."""
    logprobs = dict(generation.top[position])
    own = generation.tokens[position]
    if own not in logprobs or other not in logprobs:
        return float("inf")
    return logprobs[own] - logprobs[other]


def _top_tokens(top: TopLogprobs, top_k: int) -> list[int]:
    return [token for token, _ in top[:top_k]]


def _difference_details(reference: Generation, tested: Generation, position: int, top_k: int,
                        describe: Callable[[int], str] | None) -> str:
    """Both tokens and both top-k lists at `position`, for a failure message."""
    lines = []
    for name, generation in (("reference", reference), ("tested", tested)):
        if position >= len(generation.tokens):
            lines.append(f"  {name}: ended after {len(generation.tokens)} tokens")
            continue
        token = generation.tokens[position]
        top = ", ".join(f"{_show(t, describe)} {lp:.3f}"
                        for t, lp in generation.top[position][:top_k])
        lines.append(f"  {name}: token {_show(token, describe)}; top {top_k}: {top}")
    lines.append(f"  equal before it: {list(reference.tokens[:position])}")
    return "\n".join(lines)


def _show(token: int, describe: Callable[[int], str] | None) -> str:
    return str(token) if describe is None else f"{token} {describe(token)!r}"
