"""Token masks of structured output (runner.proto ExecuteRequest.masks / SupplyMasks).

A caller that constrains a row's next token sends a packed bitmask row for it: with the batch,
or, when the mask depends on the token the batch before it is still sampling, in a later
SupplyMasks call (masks_follow). The runner starts the forward at once and waits for late
masks only before sampling (`MaskBoard.gather`), so the caller fills them while the forward
runs. The runner keeps no grammar: a mask is bits, applied to the raw logits before anything
else (gpu_runner/sampler.py `unpack_masks`, `masked`). No torch here: the simulated runner
(bench/sim_runner.py) uses the board too.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict

from gpu_runner.merging import PendingStepError
from protos import runner_pb2

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

    def gather(self, parts: list[runner_pb2.ExecuteRequest], vocab_size: int,
               failed: dict[int, BaseException]) -> bytes:
        """The masks of a merged forward's batches, in order: inline ones as sent, late ones
        taken from the board. A batch whose masks do not come in time (or do not fit its
        rows) is sampled unmasked (every bit set) and named in `failed` (its index in
        `parts`), so that it alone fails."""
        chunks = []
        for index, part in enumerate(parts):
            rows = len(part.mask_seq_indices)
            if not rows:
                continue
            if not part.masks_follow:
                chunks.append(bytes(part.masks))
                continue
            try:
                data = self.take(part.client_id, part.step_id)
                check_masks(data, rows, vocab_size, f"the masks of step {part.step_id}")
            except (MissingMasks, ValueError) as error:
                failed[index] = PendingStepError(str(error))
                data = b"\xff" * (rows * words_per_row(vocab_size) * 4)
            chunks.append(data)
        return b"".join(chunks)
