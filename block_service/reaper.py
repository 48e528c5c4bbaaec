"""The lease reaper: a daemon thread that expires overdue sessions."""

from __future__ import annotations

import logging
import threading

from block_service.core import BlockServiceCore

log = logging.getLogger(__name__)


class LeaseReaper:
    """Calls core.reap_expired() every `interval_s` until stopped."""

    def __init__(self, core: BlockServiceCore, interval_s: float) -> None:
        self._core = core
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lease-reaper", daemon=True)

    def start(self) -> LeaseReaper:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            expired = self._core.reap_expired()
            if expired:
                log.info("expired %d session(s)", expired)
