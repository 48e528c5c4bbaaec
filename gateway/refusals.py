"""Refused requests: one log line each with the reason and the client, rate-limited, and a
counter by reason.

A refusal is a request the gateway answers with a client error (HTTP 4xx, or gRPC's
INVALID_ARGUMENT / RESOURCE_EXHAUSTED / UNAUTHENTICATED ...) before generating anything. The
log must show them (a load generator whose every request got a 400 left no trace before), yet
a client that floods bad requests must not fill the disk: at most LOG_BURST lines per
LOG_WINDOW_S: the first refusal over it says so, and the next window starts with a line
saying how many were left out.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable

from gateway import metrics

log = logging.getLogger(__name__)

LOG_WINDOW_S = 10.0
LOG_BURST = 20
# Longest message and client text in a log line: both come from the client.
_MAX_TEXT = 300
# A reason is a metric label: only these characters, and short (never the client's text).
_REASON = re.compile(r"[a-z0-9_]{1,48}")
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


class Refusals:
    """Logs and counts refusals; thread-safe (gRPC threads and the HTTP loop share it)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic,
                 window_s: float = LOG_WINDOW_S, burst: int = LOG_BURST) -> None:
        self._clock = clock
        self._window_s = window_s
        self._burst = burst
        self._lock = threading.Lock()
        self._window_start = -window_s
        self._logged = 0
        self._left_out = 0

    def record(self, api: str, status: str, reason: str, client: str, message: str) -> None:
        """One refusal: `api` "http" or "grpc", `status` the HTTP status or gRPC code,
        `reason` a short label (see `reason_label`), `message` what the client was told."""
        label = reason_label(reason)
        metrics.REFUSED_REQUESTS.labels(api=api, status=status, reason=label).inc()
        with self._lock:
            now = self._clock()
            left_out = 0
            if now - self._window_start >= self._window_s:
                left_out, self._left_out = self._left_out, 0
                self._window_start, self._logged = now, 0
            allowed = self._logged < self._burst
            first_left_out = not allowed and self._left_out == 0
            if allowed:
                self._logged += 1
            else:
                self._left_out += 1
            resumes_in = self._window_start + self._window_s - now
        if left_out:
            log.warning("%d more refused requests were not logged (at most %d per %g s)",
                        left_out, self._burst, self._window_s)
        if allowed:
            log.warning("refused %s request from %s: %s %s: %s", api, _printable(client),
                        status, label, _printable(message))
        elif first_left_out:  # said when it starts, so a flood that stops still shows
            log.warning("more refused requests than %d in %g s: the next are counted "
                        "(pagewire_gateway_refused_requests_total) but not logged for %.1f s",
                        self._burst, self._window_s, resumes_in)


def reason_label(reason: str) -> str:
    """`reason` as a metric label: a field name like `messages[2].role` becomes `messages`;
    anything else that is not a short snake_case word becomes `other`."""
    base = reason.split("[", 1)[0].split(".", 1)[0].lower()
    return base if _REASON.fullmatch(base) else "other"


def _printable(text: str) -> str:
    """Client text for a log line: control characters escaped (no forged lines, no terminal
    escapes), cut at _MAX_TEXT."""
    text = _CONTROL.sub(lambda match: f"\\x{ord(match.group()):02x}", text)
    return text if len(text) <= _MAX_TEXT else text[:_MAX_TEXT] + "…"


# The gateway's one log budget, shared by its APIs (tests swap it for a fresh one).
REFUSALS = Refusals()


def record(api: str, status: str, reason: str, client: str, message: str) -> None:
    """Refusals.record on the gateway's REFUSALS."""
    REFUSALS.record(api, status, reason, client, message)
