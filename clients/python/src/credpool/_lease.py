"""What a lease looks like from the executor's side, for both clients: the credential, the answer
to a release, and :class:`Lease`, the part of a lease that does not depend on asyncio or
threads."""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Dict, Optional

from ._protocol import DEFAULT_LEASE_SECONDS, Granted, LeaseRef, check_report
from .errors import CredpoolError, LeaseLost
from .outcomes import outcome_for

log = logging.getLogger("credpool")


class Credential(Dict[str, Any]):
    """The credential material of a lease: the JSON object the operator stored, such as
    ``{"api_key": "sk-..."}``. A plain ``dict`` in every way but one: its ``repr()`` and
    ``str()`` are ``Credential(<redacted>)``, so a log line or traceback that shows it shows no
    secret. Handle its values with care."""

    def __repr__(self) -> str:
        return "Credential(<redacted>)"

    __str__ = __repr__


@dataclass(frozen=True)
class Released:
    """The answer to a release. ``released`` is false when nothing was released, and ``reason``
    says why: ``"mismatch"`` (the ids, provider, pool or fence do not match), ``"expired"`` (the
    lease had already ended), ``"not_found"`` (already released, or force-released by an
    operator), or a reason this client does not know, as the server spelled it."""

    released: bool
    reason: Optional[str] = None


class _Report:
    """The outcome a release will send."""

    __slots__ = ("outcome", "retry_after", "usage_tokens")

    def __init__(
        self, outcome: str, retry_after: Optional[float], usage_tokens: Optional[int]
    ) -> None:
        self.outcome = outcome
        self.retry_after = retry_after
        self.usage_tokens = usage_tokens


class LeaseState:
    """What a lease and its renewal share. The renewal holds this, never the :class:`Lease`
    object itself, so that a lease nobody holds any more can be noticed (and released). It also
    writes the log lines both clients write about a lease (ids only, never the credential)."""

    def __init__(self, granted: Granted, requested_seconds: Optional[int]) -> None:
        self.ref: LeaseRef = granted.ref
        self.provider_model = granted.provider_model
        self.probe = granted.probe
        self.affinity = granted.affinity
        #: As requested; sent again with every renewal (``None``: the server extends by the length
        #: it granted).
        self.requested_seconds = requested_seconds
        #: The length the lease was granted for, in seconds: the server's word first (it may have
        #: granted its default, or less than 35 s), else as requested, else the default. Renewal
        #: and the loss deadline are scheduled by it.
        self.lease_seconds: int = (
            granted.lease_seconds or requested_seconds or DEFAULT_LEASE_SECONDS
        )
        self._lock = threading.Lock()
        self._lease_until = granted.lease_until
        self.lost_error: Optional[CredpoolError] = None
        self.lost_reason: Optional[str] = None
        #: Set once a release was made or started: renewals stop, loss is no longer reported.
        self.settled = False
        #: The answer of the release, once it came.
        self.released: Optional[Released] = None
        log.debug(
            "credpool leased key_id=%s lease_id=%s pool=%s fence=%d",
            self.ref.key_id,
            self.ref.lease_id,
            self.ref.pool,
            self.ref.fence,
        )

    @property
    def lease_until(self) -> datetime:
        with self._lock:
            return self._lease_until

    @lease_until.setter
    def lease_until(self, value: datetime) -> None:
        with self._lock:
            self._lease_until = value

    def settle(self) -> bool:
        """Marks the lease as being released. False when it already was."""
        with self._lock:
            if self.settled:
                return False
            self.settled = True
            return True

    def mark_lost(self, error: CredpoolError) -> bool:
        """Records why the lease is lost, and logs the warning. False when it was already lost
        or settled (then nothing changes)."""
        with self._lock:
            if self.settled or self.lost_error is not None:
                return False
            self.lost_error = error
            if isinstance(error, LeaseLost):
                self.lost_reason = (
                    "the server no longer holds the lease (410 lease_lost: it expired, was "
                    "released or force-released, or does not match)"
                )
            else:
                self.lost_reason = f"renewal failed and the lease would have ended by now: {error}"
        log.warning(
            "credpool lease lost: stop using the credential (key_id=%s lease_id=%s): %s",
            self.ref.key_id,
            self.ref.lease_id,
            self.lost_reason,
        )
        return True

    def warn_dropped(self) -> None:
        """Logs that the lease object was dropped unreleased (its renewal releases it)."""
        log.warning(
            "credpool lease key_id=%s lease_id=%s was dropped without a release: "
            "releasing it with outcome failure",
            self.ref.key_id,
            self.ref.lease_id,
        )

    def warn_release_failed(self, error: CredpoolError) -> None:
        """Logs a release that failed after its retries, which is not raised."""
        log.warning(
            "credpool release of key_id=%s lease_id=%s failed; the lease ends at lease_until: %s",
            self.ref.key_id,
            self.ref.lease_id,
            error,
        )


class Lease:
    """A leased credential: the part shared by :class:`~credpool.AsyncLease` (from
    :class:`~credpool.AsyncClient`) and :class:`~credpool.SyncLease` (from
    :class:`~credpool.Client`).

    ``repr()`` shows ids, fence and state, never the credential.
    """

    def __init__(self, state: LeaseState, credential: Dict[str, Any]) -> None:
        self._state = state
        #: The credential material: the object the operator stored
        #: (``lease.credential["api_key"]``).
        self.credential = Credential(credential)
        self._report: Optional[_Report] = None

    @property
    def key_id(self) -> str:
        """The credential's id."""
        return self._state.ref.key_id

    @property
    def lease_id(self) -> str:
        """The lease's id (32 hex digits)."""
        return self._state.ref.lease_id

    @property
    def fence(self) -> int:
        """The lease's fencing token: a positive integer, larger than that of every earlier lease
        of the same credential. It is sent with every renewal and the release; pass it to anything
        downstream that can refuse a stale holder (docs/executor-protocol.md)."""
        return self._state.ref.fence

    @property
    def provider(self) -> str:
        """The provider."""
        return self._state.ref.provider

    @property
    def pool(self) -> str:
        """The pool that served (``default`` after a ``vip`` fallback)."""
        return self._state.ref.pool

    @property
    def provider_model(self) -> str:
        """The model name as this credential serves it (an alias resolved)."""
        return self._state.provider_model

    @property
    def probe(self) -> bool:
        """True for the single trial lease of a credential coming back from a cooldown: report
        its outcome faithfully, it decides whether the credential returns to full capacity."""
        return self._state.probe

    @property
    def affinity(self) -> Optional[str]:
        """With an ``affinity_key``: ``"hit"`` (the credential bound to the conversation served
        this lease: its prompt cache is warm), ``"new"`` (no live binding; bound now) or
        ``"moved"`` (the bound credential could not serve now; the conversation moved here).
        ``None`` without a key, and when a retry of the allocate got the lease its first attempt
        was granted (the server does not repeat the result)."""
        return self._state.affinity

    @property
    def lease_until(self) -> datetime:
        """When the lease ends unless renewed (an aware ``datetime`` on the server's clock): the
        latest known value, updated by each renewal."""
        return self._state.lease_until

    @property
    def lease_seconds(self) -> int:
        """The lease's length in seconds, which each renewal extends it by: as the allocate
        answer says, else the ``lease_seconds`` asked for (from a server that does not say), else
        :data:`~credpool.DEFAULT_LEASE_SECONDS`. Renewals come every ``lease_seconds *
        renew_fraction``, and renewal failures lose the lease by the local end this length
        gives."""
        return self._state.lease_seconds

    @property
    def released(self) -> Optional[Released]:
        """The answer of the release, once the lease was released; ``None`` before, and when the
        release failed after its retries (then the lease ends at ``lease_until`` on its own)."""
        return self._state.released

    @property
    def lost_reason(self) -> Optional[str]:
        """Why the lease was lost, once it was; ``None`` while it holds."""
        return self._state.lost_reason

    @property
    def lost_error(self) -> Optional[CredpoolError]:
        """The error that lost the lease (:class:`~credpool.LeaseLost` for a 410), once it was."""
        return self._state.lost_error

    @property
    def is_lost(self) -> bool:
        """True once the lease is lost."""
        return self._state.lost_error is not None

    def raise_if_lost(self) -> None:
        """Raises :class:`~credpool.LeaseLost` if the lease is lost; for loops that check between
        steps."""
        error = self._state.lost_error
        if error is None:
            return
        if isinstance(error, LeaseLost):
            raise error
        raise LeaseLost(self._state.lost_reason or "the lease is lost", status=0) from error

    def report(
        self,
        outcome: str,
        retry_after: Optional[float] = None,
        usage_tokens: Optional[int] = None,
    ) -> None:
        """Sets what the release sends: ``outcome`` is one of ``"success"``, ``"failure"``,
        ``"rate_limited"``, ``"auth_error"``, ``"auth_expired"`` (an OAuth token the provider
        rejected), ``"quota_exhausted"``; ``retry_after`` (seconds, with
        ``rate_limited`` or ``quota_exhausted`` only) passes on the provider's ``Retry-After``
        (sent in whole seconds, rounded up, at most 31 days; 0 means "the server's default");
        ``usage_tokens`` is the tokens the call really used, for rate windows (sent as
        ``"usage": {"tokens": N}``, and only when given). A later report replaces an earlier one.
        Raises ``ValueError`` for values the server would refuse."""
        check_report(outcome, retry_after, usage_tokens)
        self._report = _Report(outcome, retry_after, usage_tokens)

    def report_error(self, error: BaseException) -> None:
        """Reports the outcome an upstream SDK's exception stands for (see
        :func:`credpool.outcome_for`): an openai or anthropic rate limit with its retry-after, an
        authentication error, an exhausted quota; anything else is ``"failure"``."""
        found = outcome_for(error)
        self.report(found.outcome, retry_after=found.retry_after)

    def _outcome_for_exit(self, raised: bool) -> _Report:
        if self._report is not None:
            return self._report
        return _Report("failure" if raised else "success", None, None)

    def __repr__(self) -> str:
        state = "released" if self._state.settled else ("lost" if self.is_lost else "held")
        return (
            f"<{type(self).__name__} key_id={self.key_id!r} lease_id={self.lease_id!r} "
            f"fence={self.fence} provider={self.provider!r} pool={self.pool!r} "
            f"provider_model={self.provider_model!r} lease_until={self.lease_until.isoformat()} "
            f"lease_seconds={self.lease_seconds} probe={self.probe} {state}>"
        )
