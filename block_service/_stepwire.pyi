# Type stub of block_service/_stepwire.c (see its header comment and block_service/step_wire.py).
from collections.abc import Callable
from typing import Any

from block_service.ops import OpResult

def parse(data: bytes) -> tuple[str, str, int, int, int,
                                tuple[int, int, int, int, int, int, int],
                                int, dict[int, str], Any] | None: ...
def run(parsed: Any, seqs: dict[int, Any], refs: list[int], take: Callable[[], int],
        num_free: Callable[[], int], set_computed: Callable[[Any, int], None], shift: int,
        capacity: int, slow: Callable[[int, int, int, list[int], int, int, int], OpResult],
        step_id: int, epoch: int) -> tuple[bytes, int, int]: ...
