"""Token masks of structured output (runner.proto ExecuteRequest.masks / SupplyMasks).

A caller that constrains a row's next token sends a packed bitmask row for it: with the batch,
or, when the mask depends on the token the batch before it is still sampling, in a later
SupplyMasks call (masks_follow). The runner starts the forward at once and waits for late
masks only before sampling (`MaskBoard.take`), so the caller fills them while the forward
runs. The runner keeps no grammar: a mask is bits, applied to the raw logits before anything
else (gpu_runner/sampler.py).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch

# How long the sampling of a batch waits for masks sent with masks_follow (runner.proto).
MASK_WAIT_S = 10.0
# Late masks kept for batches that have not taken them (a caller that went away, or masks
# that came before their batch), oldest dropped first.
MAX_WAITING_MASKS = 1024


class MissingMasks(Exception):
    """Masks announced with masks_follow did not come in time."""


def words_per_row(vocab_size: int) -> int:
    return -(-vocab_size // 32)


def check_masks(data: bytes, num_rows: int, vocab_size: int, what: str = "masks") -> None:
    """Raises ValueError unless `data` holds num_rows packed rows for the vocabulary."""
    expected = num_rows * words_per_row(vocab_size) * 4
    if len(data) != expected:
        raise ValueError(f"{what} has {len(data)} bytes; {num_rows} row(s) of "
                         f"{words_per_row(vocab_size)} 32-bit words take {expected}")


def unpack_masks(data: bytes, num_rows: int, vocab_size: int, device: torch.device
                 ) -> torch.Tensor:
    """Packed rows -> bool [num_rows, vocab_size], True where the token is allowed."""
    packed = np.frombuffer(data, dtype=np.uint8).reshape(num_rows, -1)
    bits = np.unpackbits(packed, axis=1, bitorder="little")[:, :vocab_size]
    return torch.from_numpy(bits.astype(np.bool_)).to(device)


@dataclass(frozen=True)
class MaskPart:
    """One client batch's masks within a merged forward: inline, or to be taken from the
    board under (client_id, step_id)."""

    num_rows: int
    inline: bytes
    client_id: str = ""
    step_id: int = 0
    follows: bool = False


class MaskBoard:
    """Late masks (SupplyMasks) until their batch's sampling takes them."""

    def __init__(self, wait_s: float = MASK_WAIT_S, capacity: int = MAX_WAITING_MASKS) -> None:
        self.wait_s = wait_s
        self.capacity = capacity
        self._masks: OrderedDict[tuple[str, int], bytes] = OrderedDict()
        self._changed = threading.Condition()

    def put(self, client_id: str, step_id: int, data: bytes) -> None:
        with self._changed:
            self._masks[(client_id, step_id)] = data
            while len(self._masks) > self.capacity:
                self._masks.popitem(last=False)
            self._changed.notify_all()

    def take(self, client_id: str, step_id: int) -> bytes:
        """The masks of (client_id, step_id), waiting up to wait_s (MissingMasks then)."""
        deadline = time.monotonic() + self.wait_s
        key = (client_id, step_id)
        with self._changed:
            while key not in self._masks:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise MissingMasks(f"the masks of step {step_id} of client {client_id!r} "
                                       f"did not come within {self.wait_s:g} s")
                self._changed.wait(left)
            return self._masks.pop(key)

    def gather(self, parts: list[MaskPart]) -> bytes:
        """Every part's masks in order, late ones taken from the board."""
        return b"".join(self.take(p.client_id, p.step_id) if p.follows else p.inline
                        for p in parts)
