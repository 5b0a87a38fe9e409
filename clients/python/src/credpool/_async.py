"""The asyncio client: :class:`AsyncClient`, its lease context manager and :class:`AsyncLease`,
renewed by an asyncio task."""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import time
import weakref
from datetime import datetime
from types import TracebackType
from typing import Any, Callable, Dict, Optional, Set, Tuple, Type, TypeVar

import httpx

from . import _protocol as p
from ._lease import Lease, LeaseState, Released, _Report
from ._version import USER_AGENT
from .errors import CredpoolError, LeaseLost

__all__ = ["AsyncClient", "AsyncLease"]

log = logging.getLogger("credpool")

T = TypeVar("T")


class _AsyncLeaseState(LeaseState):
    """A lease's state plus what asyncio needs: the loss event, the renewal task, the release
    task, and the task to cancel on loss. Holds no reference to the :class:`AsyncLease`."""

    def __init__(self, granted: p.Granted, requested_seconds: Optional[int]) -> None:
        super().__init__(granted, requested_seconds)
        self.lost = asyncio.Event()
        self.renewal: Optional[asyncio.Task[None]] = None
        self.release_task: Optional[asyncio.Task[Released]] = None
        self.release_failed_once = False
        #: The task running the ``async with`` block, while it runs, when ``cancel_on_loss``.
        self.cancel_on_loss: Optional[asyncio.Task[Any]] = None
        self.cancelled_for_loss = False

    def lose(self, error: CredpoolError) -> None:
        if not self.mark_lost(error):
            return
        self.lost.set()
        task = self.cancel_on_loss
        if task is not None and not task.done():
            self.cancelled_for_loss = True
            task.cancel()


class AsyncLease(Lease):
    """A leased credential from :meth:`AsyncClient.lease`, renewed by an asyncio task while the
    ``async with`` block runs. See :class:`~credpool.Lease` for the fields and :meth:`report`."""

    _state: _AsyncLeaseState

    def __init__(self, client: AsyncClient, state: _AsyncLeaseState, credential: Dict[str, Any]):
        super().__init__(state, credential)
        self._client = client

    @property
    def lost(self) -> asyncio.Event:
        """Set when the lease is lost (410 ``lease_lost``: expired, force-released; or renewals
        failed until the lease would have ended). Stop using the credential at once: another
        executor may hold its slot. ``lost_reason`` says why."""
        return self._state.lost

    async def release(
        self,
        outcome: Optional[str] = None,
        retry_after: Optional[float] = None,
        usage_tokens: Optional[int] = None,
    ) -> Optional[Released]:
        """Stops renewing and releases the lease now, with ``outcome`` if given (as
        :meth:`report`), else the reported outcome, else ``"success"``; 503s and transport errors
        are retried. Returns the server's answer (``released=False`` with a reason when nothing
        was released, for example after a force release).

        A second call (and leaving the block afterwards) sends nothing and returns the first
        answer. Raises :class:`~credpool.CredpoolError` when the release failed after its retries,
        except for a lease that is lost, whose release never raises (it returns ``None``)."""
        if outcome is not None:
            self.report(outcome, retry_after, usage_tokens)
        return await self._client._release_lease(self._state, self._outcome_for_exit(False), False)

    async def _exit(self, raised: bool) -> None:
        await self._client._release_lease(self._state, self._outcome_for_exit(raised), True)


class _LeaseContext:
    """What :meth:`AsyncClient.lease` returns: ``async with`` it to get an :class:`AsyncLease`."""

    def __init__(self, client: AsyncClient, request: p.LeaseRequest, cancel_on_loss: bool) -> None:
        self._client = client
        self._request = request
        self._cancel_on_loss = cancel_on_loss
        self._lease: Optional[AsyncLease] = None

    async def __aenter__(self) -> AsyncLease:
        if self._lease is not None:
            raise RuntimeError("this lease(...) was already entered; call lease() again")
        lease = await self._client._acquire(self._request)
        self._lease = lease
        if self._cancel_on_loss:
            lease._state.cancel_on_loss = asyncio.current_task()
        return lease

    async def __aexit__(
        self,
        exc_type: Optional[Type[BaseException]],
        exc: Optional[BaseException],
        tb: Optional[TracebackType],
    ) -> None:
        lease = self._lease
        if lease is None:
            return
        state = lease._state
        state.cancel_on_loss = None
        if exc_type is GeneratorExit:
            # The coroutine is being closed unfinished (garbage collected): no await is possible
            # here, so the release runs in the background, if a loop still runs.
            try:
                asyncio.get_running_loop()
            except RuntimeError:
                if state.renewal is not None:
                    state.renewal.cancel()
                log.warning(
                    "credpool lease key_id=%s lease_id=%s abandoned with no event loop running: "
                    "it ends at lease_until",
                    state.ref.key_id,
                    state.ref.lease_id,
                )
                return
            self._client._start_release(state, lease._outcome_for_exit(True))
            return
        await lease._exit(exc_type is not None)
        if not state.cancelled_for_loss:
            return
        # Taken back once: leaving again must neither raise nor uncancel another's request.
        state.cancelled_for_loss = False
        # Like asyncio.timeout(): the cancellation was ours, so it becomes the error that says
        # why, unless someone else also asked to cancel the task. 3.11+ counts cancel requests,
        # and ours is taken back here even if the block swallowed it. Before 3.11 nothing counts
        # them reliably (a backported uncancel() is also bumped by libraries such as anyio that
        # cannot take theirs back there), so it is not asked.
        others = 0
        if sys.version_info >= (3, 11):
            task = asyncio.current_task()
            if task is not None:
                others = task.uncancel()
        if exc_type is asyncio.CancelledError and others == 0:
            error = state.lost_error
            if isinstance(error, LeaseLost):
                raise error from exc
            raise LeaseLost(state.lost_reason or "the lease is lost", status=0) from exc


class AsyncClient:
    """A client of credpool's executor API for asyncio. Use it as an async context manager (or
    call :meth:`aclose`); one client shares one connection pool between all its leases.

    - ``base_url``: the service, such as ``http://127.0.0.1:8080`` (a path prefix is kept).
    - ``internal_key``: sent as ``X-Internal-Key``; never shown by ``repr()`` or logged.
    - ``timeout``: seconds for one HTTP request, connect included (default 10); an allocate that
      waits for a slot gets its wait on top.
    - ``retry``: how 503s and transport errors are retried (:class:`~credpool.RetryPolicy`).
    - ``renew_fraction``: the share of the lease length between renewals, in (0, 1); default 1/3
      (a 30 s lease is renewed every 10 s; never more often than every 0.2 s).
    - ``transport``: an ``httpx.AsyncBaseTransport`` to send requests through (tests pass
      ``httpx.MockTransport``).
    """

    def __init__(
        self,
        base_url: str,
        *,
        internal_key: str,
        timeout: float = 10.0,
        retry: Optional[p.RetryPolicy] = None,
        renew_fraction: float = 1.0 / 3.0,
        transport: Optional[httpx.AsyncBaseTransport] = None,
    ) -> None:
        self._config = p.Config(base_url, internal_key, timeout, retry, renew_fraction)
        # The key goes on each request, not on the client's default headers: httpx's repr of
        # headers hides only Authorization.
        self._http = httpx.AsyncClient(
            transport=transport, follow_redirects=False, headers={"user-agent": USER_AGENT}
        )
        self._held: Set[_AsyncLeaseState] = set()

    @classmethod
    def from_env(cls, **options: Any) -> AsyncClient:
        """A client configured by the environment, as a script or a worker is: the service in
        ``CREDPOOL_URL`` (default ``http://127.0.0.1:8080``), the executor key in
        ``CREDPOOL_INTERNAL_KEY``; ``options`` are the constructor's other arguments
        (``timeout``, ``retry``, ...)::

            async with AsyncClient.from_env() as client:
                ...

        Raises :class:`~credpool.MissingSetting` (a ``ValueError``) naming
        ``CREDPOOL_INTERNAL_KEY`` when it is unset or empty."""
        return cls(
            p.base_url_from(os.environ), internal_key=p.internal_key_from(os.environ), **options
        )

    def __repr__(self) -> str:
        return f"AsyncClient(base_url={self._config.base_url!r})"

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Releases every lease still held with ``"failure"`` (a lease should not outlive its
        client), then closes the connection pool."""
        for state in list(self._held):
            await self._release_lease(state, _Report("failure", None, None), True)
        await self._http.aclose()

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
        cancel_on_loss: bool = False,
        affinity_key: Optional[str] = None,
        affinity_ttl: Optional[float] = None,
        affinity_mode: Optional[str] = None,
    ) -> _LeaseContext:
        """Leases a credential (``POST /api/internal/allocate-key``) for an ``async with`` block::

            async with client.lease("openai", "gpt-4o", holder="worker-7", wait=5.0) as lease:
                ...

        - ``provider``, ``model`` (or an alias the operator mapped), ``pool`` (``vip`` falls back
          to ``default``), ``holder`` (your executor's name, 1..=200 printable characters, kept in
          the audit trail), ``lease_seconds`` (1..=the server's maximum; default the server's:
          35, or its maximum if lower), ``tokens`` (the tokens this call is estimated to use, for
          rate windows; sent only when given): the allocate's fields. ``lease.lease_seconds`` is
          the length the server granted, which renewal is scheduled by.
        - ``wait``: seconds to wait for a slot when every candidate is busy (the server holds the
          request up to its cap, and the client asks again with what is left); ``None`` or 0:
          raise :class:`~credpool.PoolExhausted` at once. Cut to 24 h.
        - ``cancel_on_loss``: when the lease is lost, cancel the task running the block; the
          block then ends with :class:`~credpool.LeaseLost` instead of ``CancelledError``.
        - ``affinity_key`` (a conversation id, 1..=256 printable characters): the server tries the
          credential that served the conversation's last call first while it can serve now
          (providers cache prompts per account), else another serves at once and the
          conversation moves; ``lease.affinity`` says ``"hit"``, ``"new"`` or ``"moved"``.
          ``affinity_ttl``: seconds the binding lives after this call (sent rounded up to whole
          seconds, at most a day; default the server's, one hour). ``affinity_mode``:
          ``"preferred"`` (default) or ``"strict"`` (wait, within ``wait``, for the bound
          credential only, while it could serve but for its slots).

        One random ``request_id`` is drawn per call and sent with every attempt, so a retry after
        a lost answer (503, reset connection, timeout; retried with capped, jittered backoff)
        gets the same lease back and never takes a second slot.

        Inside the block the lease is renewed in the background every ``renew_fraction`` of its
        granted length, with its fence. Leaving the block releases it with the reported outcome,
        else ``"success"``, else ``"failure"`` if the block raised; a release that fails after its
        retries is logged, not raised (the lease then ends at ``lease_until``).

        Raises (on entering the block) any :class:`~credpool.CredpoolError`: ``PoolExhausted``
        (with ``retry_after``), ``PoolNotFound``, ``ModelNotSupported``, ... and ``ValueError``
        for arguments no server takes.
        """
        affinity = p.affinity_fields(affinity_key, affinity_ttl, affinity_mode)
        request = p.LeaseRequest(
            provider, model, pool, holder, lease_seconds, wait, tokens, affinity
        )
        return _LeaseContext(self, request, cancel_on_loss)

    # -- the three calls -------------------------------------------------------------------

    async def _acquire(self, request: p.LeaseRequest) -> AsyncLease:
        allocation = p.Allocation(self._config, request, time.monotonic())
        granted = await self._call("allocate", allocation.attempt, allocation)
        state = _AsyncLeaseState(granted, request.lease_seconds)
        lease = AsyncLease(self, state, granted.credential)
        self._held.add(state)
        # Any attempt of the last run may be the one the server granted (a lost answer is
        # retried and gets the same lease back): the renewal clock counts from the run's start.
        state.renewal = asyncio.ensure_future(
            self._keep_renewed(state, weakref.ref(lease), allocation.run_started)
        )
        return lease

    async def _renew(self, state: LeaseState, deadline: float) -> Tuple[datetime, float]:
        """Renews the lease, retrying 503s and transport errors until ``deadline`` (the local,
        monotonic estimate of its end). Returns the new ``lease_until`` and when the request that
        got it was sent."""
        ref, lease_seconds = state.ref, state.requested_seconds
        retries = p.Retries(self._config.retry, time.monotonic(), deadline)
        return await self._call(
            "renew", lambda now: self._config.renew(ref, lease_seconds, deadline, now), retries
        )

    async def _release(self, state: LeaseState, report: _Report) -> Released:
        request = self._config.release(
            state.ref, report.outcome, report.retry_after, report.usage_tokens
        )
        retries = p.Retries(self._config.retry, time.monotonic())
        return Released(*await self._call("release", lambda _: request, retries))

    # -- lease bookkeeping -----------------------------------------------------------------

    async def _keep_renewed(
        self, state: _AsyncLeaseState, lease: Callable[[], Optional[AsyncLease]], started: float
    ) -> None:
        """Renews ``state`` every interval, counted from the send time of the last successful
        renewal (first: the allocation's start), until it is released (this task is cancelled)
        or lost. ``lease`` is a weak reference: a lease object nobody holds any more, never
        released, is released here with ``"failure"``."""
        length = float(state.lease_seconds)
        interval, margin = p.renew_schedule(length, self._config.renew_fraction)
        renewed_at = started
        while True:
            await asyncio.sleep(max(0.0, renewed_at + interval - time.monotonic()))
            if lease() is None:
                state.warn_dropped()
                self._start_release(state, _Report("failure", None, None))
                return
            try:
                lease_until, sent_at = await self._renew(state, renewed_at + length - margin)
            except CredpoolError as error:
                state.lose(error)
                self._held.discard(state)
                return
            state.lease_until = lease_until
            renewed_at = sent_at

    def _start_release(self, state: _AsyncLeaseState, report: _Report) -> asyncio.Task[Released]:
        """Stops the renewal and starts the release once; later calls return the same task."""
        if state.settle():
            if state.renewal is not None and state.renewal is not asyncio.current_task():
                state.renewal.cancel()
            self._held.discard(state)
            task = asyncio.ensure_future(self._release(state, report))
            task.add_done_callback(_retrieve)
            state.release_task = task
        assert state.release_task is not None
        return state.release_task

    async def _release_lease(
        self, state: _AsyncLeaseState, report: _Report, quiet: bool
    ) -> Optional[Released]:
        """Releases once (later calls wait for the first and return its answer). A failure is
        raised to the first caller only, and never when ``quiet`` or the lease is lost: then it
        is logged and the lease ends at ``lease_until``."""
        task = self._start_release(state, report)
        try:
            # Shielded: a cancelled caller (cancel_on_loss, a timeout) still gets its lease
            # released in the background.
            released = await asyncio.shield(task)
        except CredpoolError as error:
            first = not state.release_failed_once
            state.release_failed_once = True
            if quiet or state.lost_error is not None or not first:
                if first:
                    state.warn_release_failed(error)
                return None
            raise
        state.released = released
        return released

    # -- HTTP ------------------------------------------------------------------------------

    async def _call(
        self, call: str, attempt: Callable[[float], p.Request[T]], schedule: p.Schedule
    ) -> T:
        """Sends ``attempt(now)`` (a request made anew for each attempt) until it succeeds or
        ``schedule`` gives up after an error; then raises that error. ``call`` names the call in
        the log."""
        while True:
            try:
                return await self._send(attempt(time.monotonic()))
            except CredpoolError as error:
                delay = schedule.pause_after(error, time.monotonic())
                if delay is None:
                    raise
                log.debug("credpool %s: retrying in %.3f s after: %s", call, delay, error)
            await asyncio.sleep(delay)

    async def _send(self, request: p.Request[T]) -> T:
        try:
            response = await self._http.post(
                request.url,
                json=request.body,
                headers=self._config.headers,
                timeout=request.timeout,
            )
        except httpx.HTTPError as error:
            raise p.transport_error(error) from error
        return request.read(p.Answer.of(response))


def _retrieve(task: asyncio.Task[Any]) -> None:
    """Marks a background task's exception as seen (it was logged or handed on)."""
    if not task.cancelled():
        task.exception()
