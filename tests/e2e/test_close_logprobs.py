"""The close-log-probs rule of the reduced-precision tests can fail, and says why."""

from __future__ import annotations

import pytest

from tests.e2e.close_logprobs import Generation, check_logprobs_close, first_difference

TOKENS = list(range(100, 112))  # 12 tokens


def generation(tokens: list[int], alternatives: dict[int, list[int]] | None = None
               ) -> Generation:
    """`tokens` with a top-5 at each position: the token itself (log-prob -0.1), then
    `alternatives[position]` (default: tokens no test uses) at -1.1, -2.1, ..."""
    alternatives = alternatives or {}
    top = []
    for position, token in enumerate(tokens):
        others = alternatives.get(position, [900, 901, 902, 903])
        top.append([(t, -0.1 - i) for i, t in enumerate([token, *others])])
    return Generation(tokens, top)


def with_top(generation: Generation, position: int, top: list[tuple[int, float]]
             ) -> Generation:
    """`generation` with another top list at `position`."""
    tops = list(generation.top)
    tops[position] = top
    return Generation(generation.tokens, tops)


def diverged(at: int, token: int) -> list[int]:
    return [*TOKENS[:at], token, *TOKENS[at + 1:]]


def test_first_difference() -> None:
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2


def test_identical_generations_pass() -> None:
    assert check_logprobs_close(generation(TOKENS), generation(TOKENS)) is None


def test_a_difference_inside_the_first_eight_fails_even_within_top_5() -> None:
    reference = generation(TOKENS, {3: [7, 900, 901, 902]})
    tested = generation(diverged(3, 7), {3: [TOKENS[3], 900, 901, 902]})
    with pytest.raises(AssertionError, match="differ at position 3, inside the first 8"):
        check_logprobs_close(reference, tested)


def test_a_near_tie_inside_the_first_eight_passes_only_within_the_tolerance() -> None:
    # The reference's top two are 0.05 apart, the tested side's 0.2 apart.
    reference = with_top(generation(TOKENS), 2, [(TOKENS[2], -0.1), (7, -0.15), (900, -2.0)])
    tested = with_top(generation(diverged(2, 7)), 2, [(7, -0.1), (TOKENS[2], -0.3), (900, -2.0)])
    assert check_logprobs_close(reference, tested, tie_tolerance=0.06) == 2
    with pytest.raises(AssertionError, match=r"inside the first 8 and not a tie within 0\.04"):
        check_logprobs_close(reference, tested, tie_tolerance=0.04)


def test_a_difference_outside_the_reference_top_5_fails() -> None:
    reference = generation(TOKENS)  # 7 is not among its alternatives
    tested = generation(diverged(9, 7), {9: [TOKENS[9], 900, 901, 902]})
    with pytest.raises(AssertionError, match="not in each other's top 5") as failure:
        check_logprobs_close(reference, tested, label="prompt 0", describe=lambda t: f"<{t}>")
    message = str(failure.value)
    # The message names the prompt, the position, both tokens and both top-5 lists.
    assert message.startswith("prompt 0: the tokens differ at position 9")
    assert "reference: token 109 '<109>'; top 5: 109 '<109>' -0.100, 900 '<900>' -1.100" in message
    assert "tested: token 7 '<7>'; top 5: 7 '<7>' -0.100, 109 '<109>' -1.100" in message


def test_a_difference_outside_the_tested_top_5_fails() -> None:
    reference = generation(TOKENS, {9: [7, 900, 901, 902]})
    tested = generation(diverged(9, 7))  # the reference's token is not among its top 5
    with pytest.raises(AssertionError, match="not in each other's top 5"):
        check_logprobs_close(reference, tested)


def test_a_difference_inside_both_top_5_after_eight_passes() -> None:
    reference = generation(TOKENS, {8: [900, 901, 902, 7]})  # 7 is the fifth
    tested = generation([*diverged(8, 7)[:9], 1, 2, 3], {8: [900, TOKENS[8], 901, 902]})
    # Everything after the difference differs too, and is not compared.
    assert check_logprobs_close(reference, tested) == 8


def test_a_generation_that_ends_early_fails() -> None:
    with pytest.raises(AssertionError, match="one generation ended at position 10"):
        check_logprobs_close(generation(TOKENS), generation(TOKENS[:10]))
