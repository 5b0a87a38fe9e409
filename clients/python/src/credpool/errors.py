"""Every error a call to credpool can raise: one class per error code of the executor API.

All of them derive from :class:`CredpoolError`. Errors that came from a credpool error body
(``{"error": {"code", "message"}}``) derive from :class:`ApiError` and carry the HTTP
``status``, the stable ``code``, the server's ``message`` and the response's ``request_id``
(its ``X-Request-Id`` header, which is on every server log line of that request). A code this
client does not know is raised as :class:`ApiError` itself. Each subclass names its code and
status where it is defined (``class PoolNotFound(ApiError, code="pool_not_found", status=404)``),
which also enters it in :data:`ERRORS_BY_CODE`, the table the client maps answers by.

:class:`MissingSetting` is apart: a ``ValueError`` raised before anything is sent, by
:meth:`credpool.Client.from_env` and :meth:`credpool.AsyncClient.from_env`.

Neither ``str()`` nor ``repr()`` of any of them holds the internal key or credential material:
server messages are kept with the internal key scrubbed out, and malformed answers are described
by their shape, never by their content.
"""

from __future__ import annotations

from typing import Any, ClassVar, Dict, Optional, Type

__all__ = [
    "ApiError",
    "CredentialNotFound",
    "CredentialNotRelayable",
    "CredpoolError",
    "Forbidden",
    "GenerationMoved",
    "InternalError",
    "InvalidRequest",
    "LeaseLost",
    "MethodNotAllowed",
    "MissingSetting",
    "ModelNotSupported",
    "NoUsableCredentials",
    "NotReady",
    "PayloadTooLarge",
    "PoolExhausted",
    "PoolNotAllowed",
    "PoolNotFound",
    "ProviderChanged",
    "RequestIdConflict",
    "RouteNotFound",
    "ShuttingDown",
    "StoreUnavailable",
    "TenantInUse",
    "TenantKeyNotFound",
    "TenantLimit",
    "TenantNotFound",
    "TokenUrlNotAllowed",
    "TokensExceedBudget",
    "TransportError",
    "Unauthorized",
    "UnexpectedResponse",
    "UnsupportedMediaType",
    "UpstreamNotConfigured",
    "UpstreamTimeout",
    "UpstreamUnreachable",
]

#: Every known error code and its class, filled by the classes below as they are defined (the
#: ``code=`` of :class:`ApiError`'s subclasses).
ERRORS_BY_CODE: Dict[str, Type[ApiError]] = {}


class CredpoolError(Exception):
    """The base of every error this package raises for a call to credpool."""

    #: The API's stable error code (``"pool_exhausted"``, ...), or ``None`` for errors that did
    #: not come from a credpool error body (transport errors, malformed answers).
    code: Optional[str] = None
    #: True when the same call may succeed if made again later. The client has already retried
    #: 503s and transport errors for as long as its :class:`~credpool.RetryPolicy` allows.
    retryable: ClassVar[bool] = False

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:
        return self.message

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.message!r})"


class ApiError(CredpoolError):
    """An answer in credpool's error shape. Raised as is for a code this client does not know;
    every known code has its own subclass (the class attribute ``code``)."""

    #: The HTTP status the class stands for (the instance's ``status`` is what was received).
    default_status: ClassVar[int] = 0

    def __init_subclass__(
        cls, *, code: Optional[str] = None, status: Optional[int] = None, **kwargs: Any
    ) -> None:
        """``class X(ApiError, code="...", status=N)``: ``X`` is what an answer with ``code``
        is raised as (entered in :data:`ERRORS_BY_CODE`; a code can have one class only), and
        ``N`` its ``default_status``. Without them a subclass keeps its parent's."""
        super().__init_subclass__(**kwargs)
        if status is not None:
            cls.default_status = status
        if code is not None:
            if code in ERRORS_BY_CODE:
                raise TypeError(f"error code {code!r} is already {ERRORS_BY_CODE[code].__name__}")
            cls.code = code
            ERRORS_BY_CODE[code] = cls

    def __init__(
        self,
        message: str,
        *,
        status: Optional[int] = None,
        code: Optional[str] = None,
        request_id: Optional[str] = None,
    ) -> None:
        super().__init__(message)
        #: The HTTP status of the answer.
        self.status: int = status if status is not None else self.default_status
        if code is not None:
            self.code = code
        #: The answer's ``X-Request-Id``: quote it when you report a problem, it is on every
        #: server log line of the request. (Not the allocate's idempotency ``request_id``.)
        self.request_id = request_id

    def __str__(self) -> str:
        request = f", request id {self.request_id}" if self.request_id else ""
        status = f"{self.status} " if self.status else ""
        return f"{self.message} ({status}{self.code}{request})"

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(status={self.status}, code={self.code!r}, "
            f"message={self.message!r}, request_id={self.request_id!r})"
        )


class InvalidRequest(ApiError, code="invalid_request", status=400):
    """400 ``invalid_request``: malformed JSON, wrong types, unknown or missing fields, values out
    of range (a name outside its character set, ``lease_seconds`` above the server's maximum).
    Fix the caller; retrying does not help."""


class Unauthorized(ApiError, code="unauthorized", status=401):
    """401 ``unauthorized``: the internal key is missing or wrong. Fix the configuration."""


class Forbidden(ApiError, code="forbidden", status=403):
    """403 ``forbidden``: a valid key, but not for this route (the executor key on an operator
    route)."""


class PoolNotFound(ApiError, code="pool_not_found", status=404):
    """404 ``pool_not_found``: no credentials at all for this provider and pool."""


class CredentialNotFound(ApiError, code="credential_not_found", status=404):
    """404 ``credential_not_found``: no credential with this key id (operator routes)."""


class RouteNotFound(ApiError, code="route_not_found", status=404):
    """404 ``route_not_found``: the base URL does not point at a credpool (or has a wrong path
    prefix)."""


class MethodNotAllowed(ApiError, code="method_not_allowed", status=405):
    """405 ``method_not_allowed``: the route exists but not for this method; check the base URL."""


class ModelNotSupported(ApiError, code="model_not_supported", status=409):
    """409 ``model_not_supported``: the pool has credentials but none serves the model. Switch
    pool or model, and alert."""


class NoUsableCredentials(ApiError, code="no_usable_credentials", status=409):
    """409 ``no_usable_credentials``: every credential that serves the model waits for an
    operator (disabled, pending, exhausted without a retry-after). Alert an operator."""


class RequestIdConflict(ApiError, code="request_id_conflict", status=409):
    """409 ``request_id_conflict``: the allocate's ``request_id`` holds a live lease granted for
    other parameters. The client draws a new one per lease, so this means two callers shared one."""


class TokensExceedBudget(ApiError, code="tokens_exceed_budget", status=409):
    """409 ``tokens_exceed_budget``: the allocate's ``tokens`` estimate is larger than a token
    window of every credential that serves the model. No wait can make room: lower the estimate
    or split the call."""


class LeaseLost(ApiError, code="lease_lost", status=410):
    """410 ``lease_lost``: the lease expired, was released or force-released, or the ids or fence
    do not match. Stop using the credential: another executor may hold its slot.

    Also raised by :meth:`~credpool.Lease.raise_if_lost`, and out of a ``lease(...,
    cancel_on_loss=True)`` block whose task was cancelled because the lease was lost; then
    ``status`` is the 410 that told, or 0 when the loss was found otherwise (renewals gave up)."""


class PayloadTooLarge(ApiError, code="payload_too_large", status=413):
    """413 ``payload_too_large``: the request body is over the server's limit (256 KiB)."""


class UnsupportedMediaType(ApiError, code="unsupported_media_type", status=415):
    """415 ``unsupported_media_type``: the body was not sent as ``application/json``."""


class PoolExhausted(ApiError, code="pool_exhausted", status=429):
    """429 ``pool_exhausted``: candidates exist but none is free now (all slots held, or cooling
    down), and the ``wait``, if any, is used up. Back off and retry.

    ``retry_after`` is the server's ``Retry-After`` in seconds (at least 1; 1 when the header is
    missing or not a number of seconds)."""

    retryable = True

    def __init__(
        self,
        message: str,
        *,
        retry_after: float = 1.0,
        status: Optional[int] = None,
        code: Optional[str] = None,
        request_id: Optional[str] = None,
    ) -> None:
        super().__init__(message, status=status, code=code, request_id=request_id)
        #: Seconds until a slot or cooldown may free, from the server's ``Retry-After``.
        self.retry_after = retry_after

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(retry_after={self.retry_after!r}, "
            f"message={self.message!r}, request_id={self.request_id!r})"
        )


class TenantLimit(PoolExhausted, code="tenant_limit"):
    """429 ``tenant_limit``: the tenant whose key this client presents holds as many live leases as
    its cap allows, or a window of its ``rate_limits`` has no room (over every credential and
    every replica), and the ``wait``, if any, is used up. A different fact from
    :class:`PoolExhausted` (the pool is full), though handled alike, so it is a subclass: back off
    ``retry_after`` seconds (the earliest end of the tenant's own leases, or when its window has
    room), or lease with ``wait``."""


class InternalError(ApiError, code="internal_error", status=500):
    """500 ``internal_error``: a bug in credpool (logged on the server). Not retried."""


class StoreUnavailable(ApiError, code="store_unavailable", status=503):
    """503 ``store_unavailable``: credpool's database is unreachable or slow. The client retries
    these with backoff; this error means the retries gave up."""

    retryable = True


class PoolNotAllowed(ApiError, code="pool_not_allowed", status=403):
    """403 ``pool_not_allowed``: the tenant of the key this client presents may not lease from
    this provider and pool (its ``pools``); an operator adds the pool to the tenant. Retrying
    does not help."""


class TokenUrlNotAllowed(ApiError, code="token_url_not_allowed", status=400):
    """400 ``token_url_not_allowed``: an OAuth credential's ``token_url`` is neither https nor
    http on a loopback address, or reaches a private address the operator does not allow
    (operator routes)."""


class TenantNotFound(ApiError, code="tenant_not_found", status=404):
    """404 ``tenant_not_found``: no tenant with this tenant id (operator routes)."""


class TenantKeyNotFound(ApiError, code="tenant_key_not_found", status=404):
    """404 ``tenant_key_not_found``: the tenant has no live key with this id (operator routes)."""


class TenantInUse(ApiError, code="tenant_in_use", status=409):
    """409 ``tenant_in_use``: the tenant cannot be deleted: it is ``default``, or it holds live
    leases (operator routes)."""


class ProviderChanged(ApiError, code="provider_changed", status=409):
    """409 ``provider_changed``: a PUT names a credential that exists under another provider; a
    credential keeps its provider (delete it and add it again to move it) (operator routes)."""


class GenerationMoved(ApiError, code="generation_moved", status=412):
    """412 ``generation_moved``: a PUT with ``If-Match`` found the credential's OAuth token at
    another generation (refreshed since); read it again (operator routes)."""


class NotReady(ApiError, code="not_ready", status=503):
    """503 ``not_ready`` (``/readyz``): a background task is restarting, or the database is
    unreachable, slow or not current for this version."""


class ShuttingDown(ApiError, code="shutting_down", status=503):
    """503 ``shutting_down`` (``/readyz``): the service received SIGTERM and is about to stop;
    send requests to another replica."""


class UpstreamNotConfigured(ApiError, code="upstream_not_configured", status=404):
    """404 ``upstream_not_configured`` (the relay, ``/relay/{provider}/{pool}/...``): no upstream
    is set for the provider; nothing was leased or sent."""


class UpstreamUnreachable(ApiError, code="upstream_unreachable", status=502):
    """502 ``upstream_unreachable`` (the relay): the upstream could not be reached, or its answer
    broke off before it started."""


class CredentialNotRelayable(ApiError, code="credential_not_relayable", status=502):
    """502 ``credential_not_relayable`` (the relay): the leased credential's secret has neither
    an ``api_key`` nor an ``access_token`` to send upstream."""


class UpstreamTimeout(ApiError, code="upstream_timeout", status=504):
    """504 ``upstream_timeout`` (the relay): the upstream did not start its answer within its
    ``timeout_seconds``."""


class TransportError(CredpoolError):
    """The request got no answer from credpool: connect error, timeout, connection reset, or a
    502/503/504 from a proxy without a credpool error body. The client retries these with backoff;
    this error means the retries gave up (or, for ``kind == "other"``, that the request could not
    be made at all, which is not retried).

    ``kind`` is one of ``"connect"``, ``"timeout"``, ``"connection"``, ``"gateway"``, ``"other"``;
    ``status`` is the gateway's HTTP status for ``"gateway"``, else ``None``."""

    retryable = True

    def __init__(self, message: str, *, kind: str, status: Optional[int] = None) -> None:
        super().__init__(message)
        self.kind = kind
        self.status = status

    def __repr__(self) -> str:
        return f"TransportError(kind={self.kind!r}, message={self.message!r})"


class UnexpectedResponse(CredpoolError):
    """An answer that does not follow the protocol: a success body that is not JSON or lacks a
    field, an error body without a code. ``detail`` says what was wrong, never what the body held
    (it may hold a secret)."""

    def __init__(self, status: int, detail: str, *, request_id: Optional[str] = None) -> None:
        super().__init__(
            f"credpool answered {status} with a body that does not follow the protocol: {detail}"
        )
        self.status = status
        self.detail = detail
        self.request_id = request_id


class MissingSetting(ValueError):
    """A setting the client takes from the environment is not set (or empty), such as
    ``CREDPOOL_INTERNAL_KEY`` for :meth:`credpool.AsyncClient.from_env`. ``variable`` names it;
    the message says so and how to set it. A ``ValueError``, not a :class:`CredpoolError`:
    nothing was sent."""

    def __init__(self, variable: str, hint: str) -> None:
        super().__init__(f"{variable} is not set: {hint}")
        #: The environment variable that is missing.
        self.variable = variable
