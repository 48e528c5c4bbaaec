"""Sessions: the leases under which clients own sequences."""

from __future__ import annotations

import secrets
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from block_service.ops import BlockServiceError, ErrorCode, StepResult, shown


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
    last_step: StepResult | bytes | None = None  # bytes: a StepResponse (step_wire)


class SessionTable:
    """Open sessions plus a bounded memory of expired ones (to tell expired from unknown)."""

    def __init__(self, policy: LeasePolicy, clock: Callable[[], float],
                 remembered_expired: int = 65536) -> None:
        self.policy = policy
        self.clock = clock
        self.open: dict[str, Session] = {}
        self._expired: OrderedDict[str, None] = OrderedDict()
        self._remembered_expired = remembered_expired

    @staticmethod
    def new_id() -> str:
        """A fresh, unguessable session id (the one random decision: journaled by the core)."""
        return secrets.token_hex(16)

    def start(self, session_id: str, client_name: str, ttl_s: float) -> Session:
        """Opens a session with an id and a TTL already chosen (see `new_id`, policy.grant)."""
        session = Session(session_id, client_name, ttl_s, self.clock() + ttl_s)
        self.open[session_id] = session
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
                                        f"session {shown(session_id)} expired; open a new one")
            raise BlockServiceError(ErrorCode.NOT_FOUND, f"session {shown(session_id)} not found")
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

    def renew_all(self) -> None:
        """A fresh full lease for every session (after a restart: clients need to reconnect)."""
        for session in self.open.values():
            self.renew(session)

    def expired_ids(self) -> list[str]:
        """The remembered expired ids, oldest first (for snapshots)."""
        return list(self._expired)

    def restore(self, open_sessions: dict[str, Session], expired_ids: list[str]) -> None:
        """Replaces every session by a snapshot's (leases are renewed by the caller)."""
        self.open = open_sessions
        self._expired = OrderedDict.fromkeys(expired_ids)

    def overdue_ids(self) -> list[str]:
        """Sessions whose lease has run out."""
        now = self.clock()
        return [sid for sid, session in self.open.items() if session.expires_at <= now]
