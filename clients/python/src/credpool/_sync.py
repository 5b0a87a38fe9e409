"""The synchronous client: :class:`Client`, its lease context manager and :class:`SyncLease`,
renewed from a background thread. The same protocol as :mod:`credpool._async`, step for step."""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from datetime import datetime
from types import TracebackType
from typing import Any, Callable, Dict, Optional, Set, Tuple, Type, TypeVar

import httpx

from . import _protocol as p
from ._lease import Lease, LeaseState, Released, _Report
from ._version import USER_AGENT
from .errors import CredpoolError

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
        if self.mark_lost(error):
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

    def __init__(self, client: Client, request: p.LeaseRequest) -> None:
        self._client = client
        self._request = request
        self._lease: Optional[SyncLease] = None

    def __enter__(self) -> SyncLease:
        if self._lease is not None:
            raise RuntimeError("this lease(...) was already entered; call lease() again")
        self._lease = self._client._acquire(self._request)
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

    @classmethod
    def from_env(cls, **options: Any) -> Client:
        """A client configured by the environment, as :meth:`credpool.AsyncClient.from_env`:
        ``CREDPOOL_URL`` (default ``http://127.0.0.1:8080``) and ``CREDPOOL_INTERNAL_KEY``;
        ``options`` are the constructor's other arguments. Raises
        :class:`~credpool.MissingSetting` (a ``ValueError``) naming ``CREDPOOL_INTERNAL_KEY`` when
        it is unset or empty."""
        return cls(
            p.base_url_from(os.environ), internal_key=p.internal_key_from(os.environ), **options
        )

    def __repr__(self) -> str:
        return f"Client(base_url={self._config.base_url!r})"

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
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
        affinity = p.affinity_fields(affinity_key, affinity_ttl, affinity_mode)
        request = p.LeaseRequest(
            provider, model, pool, holder, lease_seconds, wait, tokens, affinity
        )
        return _LeaseContext(self, request)

    # -- the three calls -------------------------------------------------------------------

    def _acquire(self, request: p.LeaseRequest) -> SyncLease:
        allocation = p.Allocation(self._config, request, time.monotonic())
        granted = self._call("allocate", allocation.attempt, allocation)
        state = _SyncLeaseState(granted, request.lease_seconds)
        lease = SyncLease(self, state, granted.credential)
        with self._held_lock:
            self._held.add(state)
        # As in the async client: the renewal clock counts from the start of the last run.
        threading.Thread(
            target=self._keep_renewed,
            args=(state, weakref.ref(lease), allocation.run_started),
            name=f"credpool-renew-{granted.ref.key_id}",
            daemon=True,
        ).start()
        return lease

    def _renew(self, state: _SyncLeaseState, deadline: float) -> Tuple[datetime, float]:
        ref, lease_seconds = state.ref, state.requested_seconds
        retries = p.Retries(self._config.retry, time.monotonic(), deadline)

        def sleep(seconds: float) -> None:
            if state.stop.wait(seconds):
                raise _Stopped

        return self._call(
            "renew",
            lambda now: self._config.renew(ref, lease_seconds, deadline, now),
            retries,
            sleep,
        )

    def _release(self, state: LeaseState, report: _Report) -> Released:
        request = self._config.release(
            state.ref, report.outcome, report.retry_after, report.usage_tokens
        )
        retries = p.Retries(self._config.retry, time.monotonic())
        return Released(*self._call("release", lambda _: request, retries))

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
                state.warn_dropped()
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
                    state.warn_release_failed(error)
                    return None
                raise
            state.released = released
            state.release_done = True
            return released

    # -- HTTP ------------------------------------------------------------------------------

    def _call(
        self,
        call: str,
        attempt: Callable[[float], p.Request[T]],
        schedule: p.Schedule,
        sleep: Callable[[float], None] = time.sleep,
    ) -> T:
        """As :meth:`credpool.AsyncClient._call`; ``sleep`` may raise to stop early."""
        while True:
            try:
                return self._send(attempt(time.monotonic()))
            except CredpoolError as error:
                delay = schedule.pause_after(error, time.monotonic())
                if delay is None:
                    raise
                log.debug("credpool %s: retrying in %.3f s after: %s", call, delay, error)
            sleep(delay)

    def _send(self, request: p.Request[T]) -> T:
        try:
            response = self._http.post(
                request.url,
                json=request.body,
                headers=self._config.headers,
                timeout=request.timeout,
            )
        except httpx.HTTPError as error:
            raise p.transport_error(error) from error
        return request.read(p.Answer.of(response))
