"""A step's token masks (structured output): which of its rows are masked, and their bits.

A row whose output follows a format (gateway/grammar.py) samples under a mask of the tokens
the format allows next. The runner loop sends a step while the step before it is still
sampling; a decode row's mask depends on that token, so such a step's masks follow it
(runner.proto masks_follow): the loop fills them as soon as the previous step's tokens have
advanced the matchers, while the step's forward runs, and sends them in a SupplyMasks call.
A step whose masked rows all have their tokens (first tokens after a prompt, a step with no
step before it in flight) carries its masks inline.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from gateway import metrics
from gateway.grammar import Backend, FormatMatcher
from gateway.scheduler import Work
from gateway.sequence import Sequence


@dataclass
class StepMasks:
    """The masked rows of one Execute: their indices among its sequences, and the matchers
    whose state (once advanced by every token before) gives each row's mask."""

    seq_indices: list[int]
    matchers: list[FormatMatcher]
    backend: Backend

    def fill(self) -> bytes:
        """The packed rows, as runner.proto's masks."""
        with metrics.MASK_SECONDS.time():
            masks = np.zeros((len(self.matchers), self.backend.words), dtype=np.int32)
            self.backend.fill_masks(self.matchers, masks)
        metrics.MASKED_ROWS.inc(len(self.matchers))
        return masks.tobytes()


# A sequence's matcher and its backend, None for a sequence without a format.
MatcherOf = Callable[[Sequence], "tuple[FormatMatcher, Backend] | None"]


def step_masks(work: list[Work], matcher_of: MatcherOf) -> StepMasks | None:
    """The step's masked rows (None when it has none): rows that sample, of outputs with a
    format that has not ended."""
    indices: list[int] = []
    matchers: list[FormatMatcher] = []
    backend: Backend | None = None
    for index, item in enumerate(work):
        if not item.do_sample:
            continue
        found = matcher_of(item.seq)
        if found is None:
            continue
        matcher, backend = found
        indices.append(index)
        matchers.append(matcher)
    if backend is None:
        return None
    return StepMasks(indices, matchers, backend)
