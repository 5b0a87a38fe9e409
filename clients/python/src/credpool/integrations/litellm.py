"""credpool under LiteLLM: :class:`CredpoolLeases`, a LiteLLM ``CustomLogger`` that leases a
credential for each call, hands LiteLLM the lease's key for that call, and releases the lease
with the call's outcome.

With the SDK or a Router::

    import litellm
    from credpool.integrations.litellm import CredpoolLeases

    litellm.callbacks = [CredpoolLeases("http://127.0.0.1:8080", internal_key=KEY)]
    await litellm.acompletion(model="openai/gpt-4o", messages=[...])

With the Proxy (``config.yaml``, the key and URL from ``CREDPOOL_INTERNAL_KEY`` and
``CREDPOOL_URL``)::

    litellm_settings:
      callbacks: credpool.integrations.litellm.proxy_handler_instance

Which LiteLLM hooks it uses, and why (LiteLLM 1.110; ``litellm/utils.py``'s async client
wrapper, ``litellm/litellm_core_utils/streaming_handler.py``):

- ``async_pre_call_deployment_hook``: runs in the caller's task for every async call
  (``litellm.acompletion``, each attempt of ``Router.acompletion``, every Proxy request), after
  the Router picked a deployment and before the provider is called, and may return new keyword
  arguments. The lease is taken here and its key is returned as the call's ``api_key``.
- ``async_post_call_success_deployment_hook`` and ``async_post_call_failure_deployment_hook``:
  run in the caller's task after each attempt, once per attempt (a Router retry is a new
  attempt with a new lease). An unstreamed call is released here: success with the response's
  token usage, or the outcome of the exception (:func:`credpool.outcome_for`).
- ``async_log_success_event`` and ``async_log_failure_event``: a streamed call is released when
  LiteLLM logs the stream's end (with its usage) or its failure.
- A finalizer on the call's LiteLLM logging object, which the stream object holds: a stream
  that is abandoned (its consumer stopped reading, or was cancelled, and dropped it) logs
  nothing, and is released when it is collected, with ``success`` and no usage (the provider
  did its part).
- ``async_post_call_streaming_iterator_hook`` (Proxy only): wraps the stream the Proxy sends,
  so that a client that disconnects mid-stream (LiteLLM logs nothing then) is released at once.

Every release runs in a task of its own and the hooks wait for it shielded, so a cancelled
caller never cuts one short. Where LiteLLM gives no signal at all (a process that dies, a stream
object kept alive and never read), the lease's expiry is the backstop: renewal stops with the
process, and the slot frees ``lease_seconds`` later.

LiteLLM's synchronous entry points (``litellm.completion``, ``Router.completion``) run no hook
that can set a call's key, so they are not leased: the first such call logs a warning.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import threading
import weakref
from dataclasses import dataclass
from typing import (
    TYPE_CHECKING,
    Any,
    AsyncGenerator,
    Coroutine,
    Dict,
    FrozenSet,
    Mapping,
    Optional,
    Set,
)

try:
    import litellm
    from litellm.integrations.custom_logger import CustomLogger
    from litellm.types.utils import CallTypes
except ImportError as missing:  # pragma: no cover - depends on the environment
    raise ImportError(
        "credpool.integrations.litellm needs LiteLLM (Python 3.10+): "
        "pip install 'credpool-client[litellm]'"
    ) from missing

import httpx

from .. import _protocol as p
from .._async import AsyncClient, AsyncLease
from ..errors import CredpoolError
from ..outcomes import outcome_for

if TYPE_CHECKING:
    from litellm.proxy._types import UserAPIKeyAuth

__all__ = ["CredpoolLeases"]

log = logging.getLogger("credpool")

#: The call types leased by default: chat and text completions.
DEFAULT_CALL_TYPES: FrozenSet[str] = frozenset(
    {CallTypes.acompletion.value, CallTypes.atext_completion.value}
)

#: What a call that the caller abandoned (a stream dropped, a cancelled request) reports: the
#: provider was not at fault, so the credential's health must not suffer for it.
ABANDONED_OUTCOME = "success"

#: The most tokens a release may report (the server's bound).
_MAX_USAGE_TOKENS = 10**9

#: The synchronous call types, whose calls LiteLLM cannot hand a key to from a callback.
_SYNC_CALL_TYPES = frozenset({"completion", "text_completion", "embedding"})


@dataclass
class _Call:
    """One leased attempt: its lease, the event loop it was leased on (its client's loop), and
    whether its answer is a stream (released by LiteLLM's log events, not the deployment
    hooks)."""

    call_id: str
    lease: AsyncLease
    loop: asyncio.AbstractEventLoop
    streamed: bool
    finalizer: Optional[weakref.finalize[[_Call], object]] = None
    #: Set (under the integration's lock) by the first release of this call.
    settled: bool = False


@dataclass(frozen=True)
class _Ask:
    """What one call asks credpool for."""

    provider: str
    model: str
    pool: str
    internal_key: str
    affinity_key: Optional[str]
    tokens: Optional[int]


class CredpoolLeases(CustomLogger):
    """A LiteLLM callback that leases a credpool credential for each async call.

    - ``base_url``: the credpool service (default ``CREDPOOL_URL``, else
      ``http://127.0.0.1:8080``); ``internal_key``: the executor key (default
      ``CREDPOOL_INTERNAL_KEY``; :class:`~credpool.MissingSetting`, a ``ValueError``, when
      neither is given), never logged or shown by ``repr()``.
    - ``provider``, ``pool``, ``model``: what to lease. ``None`` (the default for ``provider`` and
      ``model``) takes them from the call: the provider LiteLLM resolved (``openai`` for
      ``openai/gpt-4o``) and the model without its provider prefix (``gpt-4o``); a Router call
      uses its deployment's model.
    - ``holder``: the name kept on each lease and in the audit trail (default ``litellm``).
    - ``lease_seconds``: the lease's length (default: the server's, 35 s); renewed in the
      background while the call runs, so a long call keeps its lease.
    - ``wait``: seconds to wait for a free slot before the call fails with
      :class:`~credpool.PoolExhausted` (default 30; 0 fails at once).
    - ``tenant_keys``: tenant name -> executor key, for calls whose metadata names a
      ``credpool_tenant``.
    - ``call_types``: the LiteLLM call types to lease (default ``acompletion`` and
      ``atext_completion``); other calls use the deployment's own key, unleased.
    - ``timeout``: seconds for one request to credpool; ``transport``: an
      ``httpx.AsyncBaseTransport`` for the client (tests).

    A call's metadata (``metadata=`` of the SDK, the Proxy request's ``metadata``) may name
    ``credpool_provider``, ``credpool_pool``, ``credpool_model`` (overriding the settings),
    ``credpool_tenant`` (a name of ``tenant_keys``: the key itself never travels in metadata,
    which LiteLLM hands to every logger), ``credpool_affinity_key`` (a conversation id:
    conversation affinity) and ``credpool_tokens`` (the tokens the call is estimated to use,
    reserved in the credential's token windows).

    A call that cannot be leased raises the credpool error (:class:`~credpool.PoolExhausted`
    after ``wait``, :class:`~credpool.PoolNotFound`, ...) out of the LiteLLM call; ``ValueError``
    for a tenant not in ``tenant_keys`` or metadata of the wrong type, or a credential with
    neither ``api_key`` nor ``access_token``.
    """

    def __init__(
        self,
        base_url: Optional[str] = None,
        *,
        internal_key: Optional[str] = None,
        provider: Optional[str] = None,
        pool: str = "default",
        model: Optional[str] = None,
        holder: str = "litellm",
        lease_seconds: Optional[int] = None,
        wait: float = 30.0,
        tenant_keys: Optional[Mapping[str, str]] = None,
        call_types: FrozenSet[str] = DEFAULT_CALL_TYPES,
        timeout: float = 10.0,
        transport: Optional[httpx.AsyncBaseTransport] = None,
    ) -> None:
        super().__init__()
        self.base_url = base_url or p.base_url_from(os.environ)
        if internal_key is None:
            internal_key = p.internal_key_from(os.environ)
        if not internal_key:
            raise ValueError("CredpoolLeases needs a non-empty internal_key")
        self._internal_key = internal_key
        self.provider = provider
        self.pool = pool
        self.model = model
        self.holder = holder
        self.lease_seconds = lease_seconds
        self.wait = wait
        self._tenant_keys = dict(tenant_keys or {})
        self.call_types = frozenset(call_types)
        self._timeout = timeout
        self._transport = transport
        self._lock = threading.Lock()
        #: Leased attempts not yet released, by LiteLLM's call id.
        self._calls: Dict[str, _Call] = {}
        #: One client per event loop and executor key: an httpx client belongs to one loop.
        self._clients: weakref.WeakKeyDictionary[
            asyncio.AbstractEventLoop, Dict[str, AsyncClient]
        ] = weakref.WeakKeyDictionary()
        #: Releases under way (asyncio keeps only weak references to tasks).
        self._releasing: Set[asyncio.Task[None]] = set()
        self._warned_sync: Set[str] = set()

    def __repr__(self) -> str:
        return f"CredpoolLeases(base_url={self.base_url!r}, pool={self.pool!r})"

    async def aclose(self) -> None:
        """Waits for the releases under way on this event loop, then closes its clients (which
        release any lease still held with ``failure``). Call it before the loop ends
        (``asyncio.run`` cancels tasks still running when its coroutine returns)."""
        loop = asyncio.get_running_loop()
        pending = [task for task in self._releasing if task.get_loop() is loop]
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
        for client in self._clients.pop(loop, {}).values():
            await client.aclose()

    # -- the hooks -------------------------------------------------------------------------

    async def async_pre_call_deployment_hook(
        self, kwargs: Dict[str, object], call_type: Optional[CallTypes]
    ) -> Optional[Dict[str, Any]]:
        """Leases a credential for this attempt and returns the call's keyword arguments with
        the lease's key as ``api_key``. Raises what leasing raises (see the class)."""
        if call_type is None or call_type.value not in self.call_types:
            return None
        ask = self._ask(kwargs)
        loop = asyncio.get_running_loop()
        lease = (
            await self._client(loop, ask.internal_key)
            .lease(
                ask.provider,
                ask.model,
                pool=ask.pool,
                holder=self.holder,
                lease_seconds=self.lease_seconds,
                wait=self.wait or None,
                tokens=ask.tokens,
                affinity_key=ask.affinity_key,
            )
            .__aenter__()
        )
        call_id = kwargs.get("litellm_call_id")
        call = _Call(
            call_id=call_id if isinstance(call_id, str) else f"credpool-{lease.lease_id}",
            lease=lease,
            loop=loop,
            streamed=kwargs.get("stream") is True,
        )
        secret = lease.credential.get("api_key") or lease.credential.get("access_token")
        if not isinstance(secret, str):
            await self._finish(call, "failure")
            raise ValueError(
                f"credpool credential {lease.key_id} has neither api_key nor access_token"
            )
        with self._lock:
            self._calls[call.call_id] = call
        logging_obj = kwargs.get("litellm_logging_obj")
        if logging_obj is not None:
            # The logging object lives as long as the call's answer (a stream holds it): when it
            # is collected without a release, the call was abandoned.
            call.finalizer = weakref.finalize(logging_obj, self._collected, call)
            call.finalizer.atexit = False
        log.debug(
            "credpool leased key_id=%s lease_id=%s for LiteLLM call %s",
            lease.key_id,
            lease.lease_id,
            call.call_id,
        )
        return {**kwargs, "api_key": secret}

    async def async_post_call_success_deployment_hook(
        self, request_data: Dict[str, Any], response: Any, call_type: Optional[CallTypes]
    ) -> Any:
        """Releases an unstreamed call with ``success`` and the response's token usage."""
        call = self._call_of(request_data)
        if call is not None and not call.streamed:
            await self._finish(call, "success", usage_tokens=_usage_tokens(response))
        return None

    async def async_post_call_failure_deployment_hook(
        self,
        request_data: Mapping[str, object],
        exception: Exception,
        call_type: Optional[CallTypes],
        fallback_depth: Optional[int] = None,
    ) -> None:
        """Releases a failed attempt, streamed or not, with the outcome its exception stands
        for: ``rate_limited`` with the provider's Retry-After on a 429, ``auth_expired`` on a
        401, ``quota_exhausted``, else ``failure``."""
        call = self._call_of(request_data)
        if call is not None:
            await self._fail(call, exception)

    async def async_log_success_event(
        self, kwargs: Any, response_obj: Any, start_time: Any, end_time: Any
    ) -> None:
        """Releases a streamed call when LiteLLM logs its end, with its token usage."""
        call = self._call_of(kwargs)
        if call is not None and call.streamed:
            await self._finish(call, "success", usage_tokens=_usage_tokens(response_obj))

    async def async_log_failure_event(
        self, kwargs: Any, response_obj: Any, start_time: Any, end_time: Any
    ) -> None:
        """Releases a streamed call that failed mid-stream, with its exception's outcome."""
        call = self._call_of(kwargs)
        if call is not None and call.streamed:
            error = kwargs.get("exception") if isinstance(kwargs, Mapping) else None
            if isinstance(error, BaseException):
                await self._fail(call, error)
            else:
                await self._finish(call, "failure")

    async def async_post_call_streaming_iterator_hook(
        self, user_api_key_dict: UserAPIKeyAuth, response: Any, request_data: Dict[str, Any]
    ) -> AsyncGenerator[Any, None]:
        """(Proxy) Passes the stream on; when the client goes away mid-stream (the Proxy closes
        this generator or cancels its task, and LiteLLM logs nothing), releases at once with
        ``success`` and no usage. A stream that ends is released by its log event."""
        call = self._call_of({"litellm_call_id": _call_id_of_stream(response)})
        try:
            async for item in response:
                yield item
        except Exception as error:
            if call is not None:
                await self._fail(call, error)
            raise
        except BaseException:
            # GeneratorExit or CancelledError: the client disconnected.
            if call is not None:
                await self._finish(call, ABANDONED_OUTCOME)
            raise

    def log_pre_api_call(self, model: Any, messages: Any, kwargs: Any) -> None:
        """Warns, once per call type, about a synchronous call, which cannot be leased."""
        if not isinstance(kwargs, Mapping):
            return
        call_type = kwargs.get("call_type")
        if call_type not in _SYNC_CALL_TYPES or call_type in self._warned_sync:
            return
        self._warned_sync.add(str(call_type))
        log.warning(
            "credpool: LiteLLM's synchronous %s calls are not leased (LiteLLM runs no hook on "
            "its synchronous path that can hand a call its key): they use the key LiteLLM was "
            "given, outside credpool's limits. Use the async call (litellm.acompletion, "
            "Router.acompletion), or lease around the call with credpool.Client.",
            call_type,
        )

    # -- leasing and releasing ---------------------------------------------------------------

    def _ask(self, kwargs: Mapping[str, object]) -> _Ask:
        metadata = _metadata(kwargs)
        provider = _text(metadata, "credpool_provider") or self.provider
        model = _text(metadata, "credpool_model") or self.model
        if provider is None or model is None:
            custom = kwargs.get("custom_llm_provider")
            api_base = kwargs.get("api_base")
            resolved_model, resolved_provider, _, _ = litellm.get_llm_provider(
                model=str(kwargs.get("model")),
                custom_llm_provider=custom if isinstance(custom, str) else None,
                api_base=api_base if isinstance(api_base, str) else None,
            )
            provider = provider or resolved_provider
            model = model or resolved_model
        tenant = _text(metadata, "credpool_tenant")
        internal_key = self._internal_key
        if tenant is not None:
            if tenant not in self._tenant_keys:
                raise ValueError(f"credpool tenant {tenant!r} is not in tenant_keys")
            internal_key = self._tenant_keys[tenant]
        tokens = metadata.get("credpool_tokens")
        if tokens is not None and (isinstance(tokens, bool) or not isinstance(tokens, int)):
            raise ValueError("metadata credpool_tokens must be a whole number of tokens")
        return _Ask(
            provider=provider,
            model=model,
            pool=_text(metadata, "credpool_pool") or self.pool,
            internal_key=internal_key,
            affinity_key=_text(metadata, "credpool_affinity_key"),
            tokens=tokens,
        )

    def _client(self, loop: asyncio.AbstractEventLoop, internal_key: str) -> AsyncClient:
        clients = self._clients.setdefault(loop, {})
        client = clients.get(internal_key)
        if client is None:
            client = AsyncClient(
                self.base_url,
                internal_key=internal_key,
                timeout=self._timeout,
                transport=self._transport,
            )
            clients[internal_key] = client
        return client

    def _call_of(self, kwargs: Any) -> Optional[_Call]:
        """The unreleased call that LiteLLM's keyword arguments (or logged details) name."""
        if not isinstance(kwargs, Mapping):
            return None
        call_id = kwargs.get("litellm_call_id")
        if not isinstance(call_id, str):
            return None
        with self._lock:
            return self._calls.get(call_id)

    def _claim(self, call: _Call) -> bool:
        """True for the first caller that settles ``call``, which leaves the registry."""
        with self._lock:
            if call.settled:
                return False
            call.settled = True
            if self._calls.get(call.call_id) is call:
                del self._calls[call.call_id]
        if call.finalizer is not None:
            call.finalizer.detach()
        return True

    async def _finish(
        self,
        call: _Call,
        outcome: str,
        retry_after: Optional[float] = None,
        usage_tokens: Optional[int] = None,
    ) -> None:
        """Releases ``call`` once, in a task of its own; waits for it shielded, so that a
        cancelled caller (a timeout, a client that went away) never cuts the release short."""
        if not self._claim(call):
            return
        release = self._start(call, self._release(call, outcome, retry_after, usage_tokens))
        if release is not None:
            await asyncio.shield(release)

    async def _fail(self, call: _Call, error: BaseException) -> None:
        """Releases ``call`` with the outcome ``error`` stands for (:func:`credpool.outcome_for`):
        ``rate_limited`` with its Retry-After, ``auth_expired``, ``quota_exhausted``, else
        ``failure``."""
        found = outcome_for(error)
        await self._finish(call, found.outcome, retry_after=found.retry_after)

    def _collected(self, call: _Call) -> None:
        """The finalizer: the call's LiteLLM logging object was collected (its stream or answer
        is gone) before anything released it. May run in any thread, outside any loop."""
        if not self._claim(call):
            return
        log.debug(
            "credpool: LiteLLM call %s was abandoned; releasing key_id=%s lease_id=%s",
            call.call_id,
            call.lease.key_id,
            call.lease.lease_id,
        )
        self._start(call, self._release(call, ABANDONED_OUTCOME, None, None))

    def _start(
        self, call: _Call, release: Coroutine[Any, Any, None]
    ) -> Optional[asyncio.Future[None]]:
        """Runs ``release`` as a task on the lease's event loop (from any thread); returns a
        future this loop can await, or ``None`` when that loop is gone (then the lease ends at
        ``lease_until``)."""
        try:
            running: Optional[asyncio.AbstractEventLoop] = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is call.loop:
            task = call.loop.create_task(release)
            self._releasing.add(task)
            task.add_done_callback(self._releasing.discard)
            return task
        if call.loop.is_closed():
            release.close()
            log.warning(
                "credpool: the event loop of key_id=%s lease_id=%s is closed; the lease ends "
                "at lease_until",
                call.lease.key_id,
                call.lease.lease_id,
            )
            return None
        future = asyncio.run_coroutine_threadsafe(release, call.loop)
        return asyncio.wrap_future(future) if running is not None else None

    async def _release(
        self,
        call: _Call,
        outcome: str,
        retry_after: Optional[float],
        usage_tokens: Optional[int],
    ) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._releasing.add(task)
            task.add_done_callback(self._releasing.discard)
        try:
            await call.lease.release(outcome, retry_after=retry_after, usage_tokens=usage_tokens)
        except (CredpoolError, ValueError) as error:
            log.warning(
                "credpool: the release of key_id=%s lease_id=%s failed; the lease ends at "
                "lease_until: %s",
                call.lease.key_id,
                call.lease.lease_id,
                error,
            )


def _metadata(kwargs: Mapping[str, object]) -> Dict[str, object]:
    """The call's metadata: the SDK's ``metadata``, and the Proxy's ``litellm_metadata``."""
    merged: Dict[str, object] = {}
    for name in ("litellm_metadata", "metadata"):
        part = kwargs.get(name)
        if isinstance(part, Mapping):
            merged.update(part)
    return merged


def _text(metadata: Mapping[str, object], name: str) -> Optional[str]:
    value = metadata.get(name)
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise ValueError(f"metadata {name} must be a non-empty string")
    return value


def _usage_tokens(response: Any) -> Optional[int]:
    """The tokens a response used (prompt and completion), as LiteLLM reports them; ``None``
    when it says nothing."""
    usage = response.get("usage") if isinstance(response, Mapping) else None
    if usage is None:
        usage = getattr(response, "usage", None)
    if usage is None:
        return None
    total = getattr(usage, "total_tokens", None)
    if total is None and isinstance(usage, Mapping):
        total = usage.get("total_tokens")
    if isinstance(total, bool) or not isinstance(total, int) or total < 0:
        return None
    return min(total, _MAX_USAGE_TOKENS)


def _call_id_of_stream(stream: Any) -> Optional[str]:
    """The LiteLLM call id of a stream object (its logging object's)."""
    call_id = getattr(getattr(stream, "logging_obj", None), "litellm_call_id", None)
    return call_id if isinstance(call_id, str) else None


@functools.cache
def _proxy_handler() -> CredpoolLeases:
    return CredpoolLeases(
        pool=os.environ.get("CREDPOOL_POOL", "default"),
        wait=float(os.environ.get("CREDPOOL_WAIT_SECONDS", "30")),
    )


def __getattr__(name: str) -> Any:
    """``proxy_handler_instance``: the Proxy's callback (``callbacks:
    credpool.integrations.litellm.proxy_handler_instance``), built from the environment when the
    Proxy first reads it: ``CREDPOOL_URL``, ``CREDPOOL_INTERNAL_KEY``, ``CREDPOOL_POOL``
    (default ``default``), ``CREDPOOL_WAIT_SECONDS`` (default 30)."""
    if name == "proxy_handler_instance":
        return _proxy_handler()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
