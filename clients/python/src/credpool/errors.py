"""Every error a call to credpool can raise: one class per error code of the executor API.

All of them derive from :class:`CredpoolError`. Errors that came from a credpool error body
(``{"error": {"code", "message"}}``) derive from :class:`ApiError` and carry the HTTP
``status``, the stable ``code``, the server's ``message`` and the response's ``request_id``
(its ``X-Request-Id`` header, which is on every server log line of that request). A code this
client does not know is raised as :class:`ApiError` itself.

Neither ``str()`` nor ``repr()`` of any of them holds the internal key or credential material:
server messages are kept with the internal key scrubbed out, and malformed answers are described
by their shape, never by their content.
"""

from __future__ import annotations

from typing import ClassVar, Dict, Optional, Type

__all__ = [
    "ApiError",
    "CredentialNotFound",
    "CredpoolError",
    "Forbidden",
    "InternalError",
    "InvalidRequest",
    "LeaseLost",
    "MethodNotAllowed",
    "ModelNotSupported",
    "NoUsableCredentials",
    "PayloadTooLarge",
    "PoolExhausted",
    "PoolNotFound",
    "RequestIdConflict",
    "RouteNotFound",
    "StoreUnavailable",
    "TenantLimit",
    "TokensExceedBudget",
    "TransportError",
    "Unauthorized",
    "UnexpectedResponse",
    "UnsupportedMediaType",
]


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


class InvalidRequest(ApiError):
    """400 ``invalid_request``: malformed JSON, wrong types, unknown or missing fields, values out
    of range (a name outside its character set, ``lease_seconds`` above the server's maximum).
    Fix the caller; retrying does not help."""

    code = "invalid_request"
    default_status = 400


class Unauthorized(ApiError):
    """401 ``unauthorized``: the internal key is missing or wrong. Fix the configuration."""

    code = "unauthorized"
    default_status = 401


class Forbidden(ApiError):
    """403 ``forbidden``: a valid key, but not for this route (the executor key on an operator
    route)."""

    code = "forbidden"
    default_status = 403


class PoolNotFound(ApiError):
    """404 ``pool_not_found``: no credentials at all for this provider and pool."""

    code = "pool_not_found"
    default_status = 404


class CredentialNotFound(ApiError):
    """404 ``credential_not_found``: no credential with this key id (operator routes)."""

    code = "credential_not_found"
    default_status = 404


class RouteNotFound(ApiError):
    """404 ``route_not_found``: the base URL does not point at a credpool (or has a wrong path
    prefix)."""

    code = "route_not_found"
    default_status = 404


class MethodNotAllowed(ApiError):
    """405 ``method_not_allowed``: the route exists but not for this method; check the base URL."""

    code = "method_not_allowed"
    default_status = 405


class ModelNotSupported(ApiError):
    """409 ``model_not_supported``: the pool has credentials but none serves the model. Switch
    pool or model, and alert."""

    code = "model_not_supported"
    default_status = 409


class NoUsableCredentials(ApiError):
    """409 ``no_usable_credentials``: every credential that serves the model waits for an
    operator (disabled, pending, exhausted without a retry-after). Alert an operator."""

    code = "no_usable_credentials"
    default_status = 409


class RequestIdConflict(ApiError):
    """409 ``request_id_conflict``: the allocate's ``request_id`` holds a live lease granted for
    other parameters. The client draws a new one per lease, so this means two callers shared one."""

    code = "request_id_conflict"
    default_status = 409


class TokensExceedBudget(ApiError):
    """409 ``tokens_exceed_budget``: the allocate's ``tokens`` estimate is larger than a token
    window of every credential that serves the model. No wait can make room: lower the estimate
    or split the call."""

    code = "tokens_exceed_budget"
    default_status = 409


class LeaseLost(ApiError):
    """410 ``lease_lost``: the lease expired, was released or force-released, or the ids or fence
    do not match. Stop using the credential: another executor may hold its slot.

    Also raised by :meth:`~credpool.Lease.raise_if_lost`, and out of a ``lease(...,
    cancel_on_loss=True)`` block whose task was cancelled because the lease was lost; then
    ``status`` is the 410 that told, or 0 when the loss was found otherwise (renewals gave up)."""

    code = "lease_lost"
    default_status = 410


class PayloadTooLarge(ApiError):
    """413 ``payload_too_large``: the request body is over the server's limit (256 KiB)."""

    code = "payload_too_large"
    default_status = 413


class UnsupportedMediaType(ApiError):
    """415 ``unsupported_media_type``: the body was not sent as ``application/json``."""

    code = "unsupported_media_type"
    default_status = 415


class PoolExhausted(ApiError):
    """429 ``pool_exhausted``: candidates exist but none is free now (all slots held, or cooling
    down), and the ``wait``, if any, is used up. Back off and retry.

    ``retry_after`` is the server's ``Retry-After`` in seconds (at least 1; 1 when the header is
    missing or not a number of seconds)."""

    code = "pool_exhausted"
    default_status = 429
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
            f"PoolExhausted(retry_after={self.retry_after!r}, message={self.message!r}, "
            f"request_id={self.request_id!r})"
        )


class TenantLimit(PoolExhausted):
    """429 ``tenant_limit``: the tenant whose key this client presents holds as many live leases as
    its cap allows, or a window of its ``rate_limits`` has no room (over every credential and
    every replica), and the ``wait``, if any, is used up. A different fact from
    :class:`PoolExhausted` (the pool is full), though handled alike, so it is a subclass: back off
    ``retry_after`` seconds (the earliest end of the tenant's own leases, or when its window has
    room), or lease with ``wait``."""

    code = "tenant_limit"

    def __repr__(self) -> str:
        return (
            f"TenantLimit(retry_after={self.retry_after!r}, message={self.message!r}, "
            f"request_id={self.request_id!r})"
        )


class InternalError(ApiError):
    """500 ``internal_error``: a bug in credpool (logged on the server). Not retried."""

    code = "internal_error"
    default_status = 500


class StoreUnavailable(ApiError):
    """503 ``store_unavailable``: credpool's database is unreachable or slow. The client retries
    these with backoff; this error means the retries gave up."""

    code = "store_unavailable"
    default_status = 503
    retryable = True


class PoolNotAllowed(ApiError):
    """403 ``pool_not_allowed``: the tenant of the key this client presents may not lease from
    this provider and pool (its ``pools``); an operator adds the pool to the tenant. Retrying
    does not help."""

    code = "pool_not_allowed"
    default_status = 403


class TokenUrlNotAllowed(ApiError):
    """400 ``token_url_not_allowed``: an OAuth credential's ``token_url`` is neither https nor
    http on a loopback address, or reaches a private address the operator does not allow
    (operator routes)."""

    code = "token_url_not_allowed"
    default_status = 400


class TenantNotFound(ApiError):
    """404 ``tenant_not_found``: no tenant with this tenant id (operator routes)."""

    code = "tenant_not_found"
    default_status = 404


class TenantKeyNotFound(ApiError):
    """404 ``tenant_key_not_found``: the tenant has no live key with this id (operator routes)."""

    code = "tenant_key_not_found"
    default_status = 404


class TenantInUse(ApiError):
    """409 ``tenant_in_use``: the tenant cannot be deleted: it is ``default``, or it holds live
    leases (operator routes)."""

    code = "tenant_in_use"
    default_status = 409


class GenerationMoved(ApiError):
    """412 ``generation_moved``: a PUT with ``If-Match`` found the credential's OAuth token at
    another generation (refreshed since); read it again (operator routes)."""

    code = "generation_moved"
    default_status = 412


class NotReady(ApiError):
    """503 ``not_ready`` (``/readyz``): a background task is restarting, or the database is
    unreachable, slow or not current for this version."""

    code = "not_ready"
    default_status = 503


class ShuttingDown(ApiError):
    """503 ``shutting_down`` (``/readyz``): the service received SIGTERM and is about to stop;
    send requests to another replica."""

    code = "shutting_down"
    default_status = 503


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


#: Every known error code and its class.
ERRORS_BY_CODE: Dict[str, Type[ApiError]] = {
    str(cls.code): cls
    for cls in (
        InvalidRequest,
        Unauthorized,
        Forbidden,
        PoolNotFound,
        CredentialNotFound,
        RouteNotFound,
        MethodNotAllowed,
        ModelNotSupported,
        NoUsableCredentials,
        RequestIdConflict,
        TokensExceedBudget,
        LeaseLost,
        PayloadTooLarge,
        UnsupportedMediaType,
        PoolExhausted,
        TenantLimit,
        InternalError,
        StoreUnavailable,
        PoolNotAllowed,
        TokenUrlNotAllowed,
        TenantNotFound,
        TenantKeyNotFound,
        TenantInUse,
        GenerationMoved,
        NotReady,
        ShuttingDown,
    )
}
