"""The synchronous client: :class:`Client`, its lease context manager and :class:`SyncLease`,
renewed from a background thread. The same protocol as :mod:`credpool._async`, step for step."""

from __future__ import annotations

import logging
import threading
import time
import uuid
import weakref
from datetime import datetime
from types import TracebackType
from typing import Any, Callable, Dict, Optional, Set, Tuple, Type, TypeVar

import httpx

from . import _protocol as p
from ._async import _pauses
from ._lease import Lease, LeaseState, Released, _Report
from ._version import USER_AGENT
from .errors import CredpoolError, PoolExhausted

__all__ = ["Client", "SyncLease"]

log = logging.getLogger("credpool")

T = TypeVar("T")


class _Stopped(Exception):
    """The lease was released while its renewal was sleeping between retries."""


class _SyncLeaseState(LeaseState):
    """A lease's state plus what threads need: the loss event, the event that stops the renewal
    thread, and the lock that makes the release happen once. Holds no reference to the
    :class:`SyncLease`."""

    def __init__(self, granted: p.Granted, requested_seconds: Optional[int]) -> None:
        super().__init__(granted, requested_seconds)
        self.lost = threading.Event()
        self.stop = threading.Event()
        self.release_lock = threading.Lock()
        self.release_done = False

    def lose(self, error: CredpoolError) -> None:
        if not self.mark_lost(error):
            return
        log.warning(
            "credpool lease lost: stop using the credential (key_id=%s lease_id=%s): %s",
            self.ref.key_id,
            self.ref.lease_id,
            self.lost_reason,
        )
        self.lost.set()


class SyncLease(Lease):
    """A leased credential from :meth:`Client.lease`, renewed by a background thread while the
    ``with`` block runs. See :class:`~credpool.Lease` for the fields and :meth:`report`."""

    _state: _SyncLeaseState

    def __init__(self, client: Client, state: _SyncLeaseState, credential: Dict[str, Any]):
        super().__init__(state, credential)
        self._client = client

    @property
    def lost(self) -> threading.Event:
        """Set when the lease is lost (410 ``lease_lost``: expired, force-released; or renewals
        failed until the lease would have ended). Stop using the credential at once: another
        executor may hold its slot. ``lost_reason`` says why."""
        return self._state.lost

    def release(
        self,
        outcome: Optional[str] = None,
        retry_after: Optional[float] = None,
        usage_tokens: Optional[int] = None,
    ) -> Optional[Released]:
        """As :meth:`credpool.AsyncLease.release`: stops renewing and releases now, once; never
        raises for a lost lease."""
        if outcome is not None:
            self.report(outcome, retry_after, usage_tokens)
        return self._client._release_lease(self._state, self._outcome_for_exit(False), False)


class _LeaseContext:
    """What :meth:`Client.lease` returns: ``with`` it to get a :class:`SyncLease`."""

    def __init__(self, client: Client, **request: Any) -> None:
        self._client = client
        self._request = request
        self._lease: Optional[SyncLease] = None

    def __enter__(self) -> SyncLease:
        if self._lease is not None:
            raise RuntimeError("this lease(...) was already entered; call lease() again")
        self._lease = self._client._acquire(**self._request)
        return self._lease

    def __exit__(
        self,
        exc_type: Optional[Type[BaseException]],
        exc: Optional[BaseException],
        tb: Optional[TracebackType],
    ) -> None:
        lease = self._lease
        if lease is None:
            return
        self._client._release_lease(
            lease._state, lease._outcome_for_exit(exc_type is not None), True
        )


class Client:
    """A synchronous client of credpool's executor API, with the shape of
    :class:`~credpool.AsyncClient` (``with client.lease(...) as lease:``). Use it as a context
    manager (or call :meth:`close`). Safe to share between threads; each lease is renewed by a
    daemon thread of its own.

    Arguments as for :class:`~credpool.AsyncClient`; ``transport`` is an
    ``httpx.BaseTransport``.
    """

    def __init__(
        self,
        base_url: str,
        *,
        internal_key: str,
        timeout: float = 10.0,
        retry: Optional[p.RetryPolicy] = None,
        renew_fraction: float = 1.0 / 3.0,
        transport: Optional[httpx.BaseTransport] = None,
    ) -> None:
        self._config = p.Config(base_url, internal_key, timeout, retry, renew_fraction)
        self._http = httpx.Client(
            transport=transport, follow_redirects=False, headers={"user-agent": USER_AGENT}
        )
        self._held: Set[_SyncLeaseState] = set()
        self._held_lock = threading.Lock()

    def __repr__(self) -> str:
        return f"Client(base_url={self._config.base_url!r})"

    def __enter__(self) -> Client:
        return self

    def __exit__(
        self,
        exc_type: Optional[Type[BaseException]],
        exc: Optional[BaseException],
        tb: Optional[TracebackType],
    ) -> None:
        self.close()

    def close(self) -> None:
        """Releases every lease still held with ``"failure"``, then closes the connection pool."""
        with self._held_lock:
            held = list(self._held)
        for state in held:
            self._release_lease(state, _Report("failure", None, None), True)
        self._http.close()

    def lease(
        self,
        provider: str,
        model: str,
        pool: str = "default",
        holder: Optional[str] = None,
        lease_seconds: Optional[int] = None,
        wait: Optional[float] = None,
        tokens: Optional[int] = None,
        *,
        affinity_key: Optional[str] = None,
        affinity_ttl: Optional[float] = None,
        affinity_mode: Optional[str] = None,
    ) -> _LeaseContext:
        """Leases a credential for a ``with`` block; as :meth:`credpool.AsyncClient.lease`, but
        without ``cancel_on_loss`` (a thread cannot be cancelled): check ``lease.lost.is_set()``
        or call ``lease.raise_if_lost()`` between steps. ``affinity_key``, ``affinity_ttl`` and
        ``affinity_mode``: conversation affinity, as there."""
        p.check_lease_args(lease_seconds, wait, tokens)
        affinity = p.affinity_fields(affinity_key, affinity_ttl, affinity_mode)
        return _LeaseContext(
            self,
            provider=provider,
            model=model,
            pool=pool,
            holder=holder,
            lease_seconds=lease_seconds,
            wait=wait,
            tokens=tokens,
            affinity=affinity,
        )

    # -- the three calls -------------------------------------------------------------------

    def _acquire(
        self,
        *,
        provider: str,
        model: str,
        pool: str,
        holder: Optional[str],
        lease_seconds: Optional[int],
        wait: Optional[float],
        tokens: Optional[int],
        affinity: Dict[str, Any],
    ) -> SyncLease:
        config = self._config
        request_id = str(uuid.uuid4())
        wait_until = time.monotonic() + min(wait, p.MAX_WAIT) if wait else None
        pauses = _pauses(config.retry)
        while True:
            # As in the async client: the renewal clock counts from the start of this run.
            run_started = time.monotonic()

            def attempt() -> p.Granted:
                left = None if wait_until is None else wait_until - time.monotonic()
                wait_ms = int(left * 1000) if left is not None and left >= 0.001 else None
                body = p.allocate_body(
                    provider=provider,
                    model=model,
                    pool=pool,
                    lease_seconds=lease_seconds,
                    holder=holder,
                    request_id=request_id,
                    wait_ms=wait_ms,
                    tokens=tokens,
                    affinity=affinity,
                )
                timeout = config.timeout + (wait_ms or 0) / 1000.0
                answer = self._post(config.allocate_url, body, timeout)
                if answer.status != 200:
                    raise p.error_of(answer, config.scrub)
                return p.parse_granted(answer)

            try:
                granted = self._with_retries("allocate", attempt)
            except PoolExhausted as exhausted:
                now = time.monotonic()
                left = 0.0 if wait_until is None else wait_until - now
                if left < 0.001:
                    raise
                if now - run_started < p.HELD_AT_LEAST:
                    pause = min(next(pauses), exhausted.retry_after, left)
                    log.debug("credpool pool exhausted; pausing %.3f s", pause)
                    time.sleep(pause)
                continue
            log.debug(
                "credpool leased key_id=%s lease_id=%s pool=%s fence=%d",
                granted.ref.key_id,
                granted.ref.lease_id,
                granted.ref.pool,
                granted.ref.fence,
            )
            state = _SyncLeaseState(granted, lease_seconds)
            lease = SyncLease(self, state, granted.credential)
            with self._held_lock:
                self._held.add(state)
            threading.Thread(
                target=self._keep_renewed,
                args=(state, weakref.ref(lease), run_started),
                name=f"credpool-renew-{granted.ref.key_id}",
                daemon=True,
            ).start()
            return lease

    def _renew(self, state: _SyncLeaseState, deadline: float) -> Tuple[datetime, float]:
        config = self._config
        body = p.renew_body(state.ref, state.requested_seconds)

        def attempt() -> Tuple[datetime, float]:
            sent_at = time.monotonic()
            timeout = max(min(config.timeout, deadline - sent_at), p.MIN_ATTEMPT_TIMEOUT)
            answer = self._post(config.renew_url, body, timeout)
            if answer.status != 200:
                raise p.error_of(answer, config.scrub)
            return p.parse_renewed(answer), sent_at

        def sleep(seconds: float) -> None:
            if state.stop.wait(seconds):
                raise _Stopped

        return self._with_retries("renew", attempt, deadline, sleep)

    def _release(self, state: LeaseState, report: _Report) -> Released:
        config = self._config
        body = p.release_body(state.ref, report.outcome, report.retry_after, report.usage_tokens)

        def attempt() -> Released:
            answer = self._post(config.release_url, body, config.timeout)
            if answer.status != 200:
                raise p.error_of(answer, config.scrub)
            released, reason = p.parse_released(answer)
            return Released(released, reason)

        return self._with_retries("release", attempt)

    # -- lease bookkeeping -----------------------------------------------------------------

    def _keep_renewed(
        self, state: _SyncLeaseState, lease: Callable[[], Optional[SyncLease]], started: float
    ) -> None:
        """The renewal thread: as :meth:`credpool.AsyncClient._keep_renewed`. ``state.stop`` ends
        it; a renewal in flight when the lease is released has its answer ignored."""
        length = float(state.lease_seconds)
        interval, margin = p.renew_schedule(length, self._config.renew_fraction)
        renewed_at = started
        while True:
            if state.stop.wait(max(0.0, renewed_at + interval - time.monotonic())):
                return
            if lease() is None:
                log.warning(
                    "credpool lease key_id=%s lease_id=%s was dropped without a release: "
                    "releasing it with outcome failure",
                    state.ref.key_id,
                    state.ref.lease_id,
                )
                self._release_lease(state, _Report("failure", None, None), True)
                return
            try:
                lease_until, sent_at = self._renew(state, renewed_at + length - margin)
            except _Stopped:
                return
            except CredpoolError as error:
                if not state.stop.is_set():
                    state.lose(error)
                    with self._held_lock:
                        self._held.discard(state)
                return
            if state.stop.is_set():
                return
            state.lease_until = lease_until
            renewed_at = sent_at

    def _release_lease(
        self, state: _SyncLeaseState, report: _Report, quiet: bool
    ) -> Optional[Released]:
        """Releases once; callers that come while it runs wait for it and get its answer. A
        failure is raised to the first caller only, and never when ``quiet`` or the lease is
        lost: then it is logged and the lease ends at ``lease_until``."""
        with state.release_lock:
            if state.release_done:
                return state.released
            state.settle()
            state.stop.set()
            with self._held_lock:
                self._held.discard(state)
            try:
                released = self._release(state, report)
            except CredpoolError as error:
                state.release_done = True
                if quiet or state.lost_error is not None:
                    log.warning(
                        "credpool release of key_id=%s lease_id=%s failed; the lease ends at "
                        "lease_until: %s",
                        state.ref.key_id,
                        state.ref.lease_id,
                        error,
                    )
                    return None
                raise
            state.released = released
            state.release_done = True
            return released

    # -- HTTP ------------------------------------------------------------------------------

    def _with_retries(
        self,
        call: str,
        attempt: Callable[[], T],
        deadline: Optional[float] = None,
        sleep: Callable[[float], None] = time.sleep,
    ) -> T:
        """As :meth:`credpool.AsyncClient._with_retries`; ``sleep`` may raise to stop early."""
        retry = self._config.retry
        if retry.max_elapsed is not None:
            give_up = time.monotonic() + retry.max_elapsed
            deadline = give_up if deadline is None else min(deadline, give_up)
        delays = retry.delays()
        while True:
            try:
                return attempt()
            except CredpoolError as error:
                if not p.retried_by_client(error):
                    raise
                delay = next(delays, None)
                if delay is None or (deadline is not None and time.monotonic() + delay >= deadline):
                    raise
                log.debug("credpool %s: retrying in %.3f s after: %s", call, delay, error)
            sleep(delay)

    def _post(self, url: str, body: Dict[str, Any], timeout: float) -> p.Answer:
        try:
            response = self._http.post(
                url, json=body, headers=self._config.headers, timeout=timeout
            )
        except httpx.HTTPError as error:
            raise p.transport_error(error) from error
        return p.Answer.of(response)
