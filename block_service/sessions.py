"""Sessions: the leases under which clients own sequences."""

from __future__ import annotations

import secrets
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from block_service.ops import BlockServiceError, ErrorCode, StepResult


@dataclass(frozen=True)
class LeasePolicy:
    """Lease times the server grants, in seconds."""

    default_ttl_s: float = 10.0
    min_ttl_s: float = 1.0
    max_ttl_s: float = 300.0

    def grant(self, requested_ms: int) -> float:
        """The TTL for a request (0: the default), clamped to [min, max]."""
        wanted = requested_ms / 1000.0 if requested_ms else self.default_ttl_s
        return min(max(wanted, self.min_ttl_s), self.max_ttl_s)


@dataclass
class Session:
    """One client's lease, and its last Step for idempotent retries."""

    session_id: str
    client_name: str
    ttl_s: float
    expires_at: float
    last_step_id: int = -1
    last_step: StepResult | None = None


class SessionTable:
    """Open sessions plus a bounded memory of expired ones (to tell expired from unknown)."""

    def __init__(self, policy: LeasePolicy, clock: Callable[[], float],
                 remembered_expired: int = 65536) -> None:
        self.policy = policy
        self.clock = clock
        self.open: dict[str, Session] = {}
        self._expired: OrderedDict[str, None] = OrderedDict()
        self._remembered_expired = remembered_expired

    def start(self, client_name: str, requested_ttl_ms: int) -> Session:
        """Opens a session with a granted TTL."""
        ttl_s = self.policy.grant(requested_ttl_ms)
        session = Session(secrets.token_hex(16), client_name, ttl_s, self.clock() + ttl_s)
        self.open[session.session_id] = session
        return session

    def find(self, session_id: str) -> Session:
        """The open session; NOT_FOUND if unknown, FAILED_PRECONDITION if it expired.

        A session past its expiry time is *not* removed here: the caller expires it (frees
        its sequences) when this raises for that reason. See `overdue`.
        """
        session = self.open.get(session_id)
        if session is None:
            if session_id in self._expired:
                raise BlockServiceError(ErrorCode.FAILED_PRECONDITION,
                                        f"session {session_id!r} expired; open a new one")
            raise BlockServiceError(ErrorCode.NOT_FOUND, f"session {session_id!r} not found")
        return session

    def overdue(self, session: Session) -> bool:
        """Whether the session's lease has run out."""
        return session.expires_at <= self.clock()

    def renew(self, session: Session) -> None:
        """Extends the lease by its TTL from now."""
        session.expires_at = self.clock() + session.ttl_s

    def end(self, session_id: str, expired: bool) -> Session | None:
        """Removes a session (remembering it when it expired)."""
        session = self.open.pop(session_id, None)
        if session is not None and expired:
            self._expired[session_id] = None
            if len(self._expired) > self._remembered_expired:
                self._expired.popitem(last=False)
        return session

    def overdue_ids(self) -> list[str]:
        """Sessions whose lease has run out."""
        now = self.clock()
        return [sid for sid, session in self.open.items() if session.expires_at <= now]
