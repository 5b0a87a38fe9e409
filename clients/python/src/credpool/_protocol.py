"""What the async and the sync client share, with no I/O: the requests of the three calls
(:class:`Request`: URL, body, timeout, and how its answer is read), the error an answer stands
for, when to try again (:class:`Retries`, and :class:`Allocation` for an allocate's wait), the
renewal schedule, and the settings ``from_env`` reads. Time comes in as ``now`` (a
``time.monotonic()`` value), so the clients only send, sleep and keep time.

Answers are read as JSON and picked apart by hand, so that a parse error can name the field that
was wrong without quoting its value (the value may be a secret).
"""

from __future__ import annotations

import json
import math
import random
import re
import uuid
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import (
    Any,
    Callable,
    Dict,
    Generic,
    Iterator,
    Mapping,
    Optional,
    Protocol,
    Tuple,
    TypeVar,
)

import httpx

from .errors import (
    ERRORS_BY_CODE,
    ApiError,
    CredpoolError,
    MissingSetting,
    PoolExhausted,
    StoreUnavailable,
    TransportError,
    UnexpectedResponse,
)

#: The lease length, in seconds, the client schedules renewals by when neither the allocate
#: answer nor the ``lease_seconds`` argument gives one: the server's default. Servers that send
#: ``lease_seconds`` in the allocate answer are always taken at their word (their default is
#: 35 s, or their ``--max-lease-seconds`` if that is lower); with an older server whose maximum
#: is below 35, give ``lease_seconds`` explicitly.
DEFAULT_LEASE_SECONDS = 35

#: The longest lease length an allocate answer may state, in seconds: 2**32 - 1, as the Rust
#: client (the server's own limit is a day).
MAX_GRANTED_SECONDS = 2**32 - 1

#: The longest ``retry_after_seconds`` a release may carry: 31 days (the server's limit; longer
#: rests are cut to this).
MAX_RETRY_AFTER_SECONDS = 31 * 86_400

#: Renewals never come closer together than this, whatever the lease length and renew fraction.
MIN_RENEW_INTERVAL = 0.2

#: The renewal gives up this long before the lease's local end, at most: a tenth of the lease,
#: capped at 2 s, so that work is told to stop while the lease still holds.
MAX_RENEW_MARGIN = 2.0

#: The shortest timeout a renewal attempt gets, even when the lease's local end is nearer: the
#: local deadline is conservative and the lease may still be alive on the server.
MIN_ATTEMPT_TIMEOUT = 0.2

#: A 429 that came back sooner than this after the request was sent was not held by the server
#: (an older server, or one that knows nothing frees in time): the client pauses before asking
#: again instead of spinning.
HELD_AT_LEAST = 0.1

#: The longest ``wait`` a lease request may ask for; longer ones are cut to this (24 h).
MAX_WAIT = 86_400.0

#: The outcomes a release may report (docs/src/executor-api.md, "Release, with the outcome").
OUTCOMES = frozenset(
    {"success", "failure", "rate_limited", "auth_error", "auth_expired", "quota_exhausted"}
)

#: The outcomes that may carry a ``retry_after``.
OUTCOMES_WITH_RETRY_AFTER = frozenset({"rate_limited", "quota_exhausted"})

#: The environment variables ``from_env`` reads: the service's base URL (default
#: :data:`DEFAULT_BASE_URL`) and the executor key (no default).
URL_VARIABLE = "CREDPOOL_URL"
KEY_VARIABLE = "CREDPOOL_INTERNAL_KEY"

#: The service ``from_env`` talks to when ``CREDPOOL_URL`` is unset: ``credpool serve``'s default
#: listen address.
DEFAULT_BASE_URL = "http://127.0.0.1:8080"

ALLOCATE_ROUTE = "api/internal/allocate-key"
RENEW_ROUTE = "api/internal/renew-lease"
RELEASE_ROUTE = "api/internal/release-key"

T = TypeVar("T")


def base_url_from(environ: Mapping[str, str]) -> str:
    """``CREDPOOL_URL`` of ``environ`` (``os.environ``), else :data:`DEFAULT_BASE_URL` (also when
    it is empty)."""
    return environ.get(URL_VARIABLE) or DEFAULT_BASE_URL


def internal_key_from(environ: Mapping[str, str]) -> str:
    """``CREDPOOL_INTERNAL_KEY`` of ``environ`` (``os.environ``). Raises :class:`MissingSetting`
    naming the variable when it is unset or empty."""
    key = environ.get(KEY_VARIABLE)
    if not key:
        raise MissingSetting(
            KEY_VARIABLE,
            'export the executor key first (`eval "$(credpool env)"` exports it for the '
            "embedded default)",
        )
    return key


@dataclass(frozen=True)
class RetryPolicy:
    """How the client retries a 503 ``store_unavailable`` or a transport error: capped
    exponential backoff with jitter.

    The n-th sleep is ``base_delay * 2**(n-1)`` seconds, capped at ``max_delay``, plus a random
    jitter of up to the same amount again (so a sleep is at most ``2 * max_delay``). Retries stop
    at whichever comes first of ``max_retries`` and ``max_elapsed`` (seconds from the first
    attempt; no retry starts whose sleep would end past it); at least one must be set.
    """

    #: The first sleep, seconds.
    base_delay: float = 0.1
    #: The longest sleep before jitter, seconds.
    max_delay: float = 5.0
    #: The most retries after the first attempt; ``None`` for no limit by count.
    max_retries: Optional[int] = None
    #: Seconds from the first attempt after which no retry starts; ``None`` for no limit by time.
    max_elapsed: Optional[float] = 30.0

    def __post_init__(self) -> None:
        if not self.base_delay > 0:
            raise ValueError("retry base_delay must be positive")
        if not self.max_delay >= self.base_delay:
            raise ValueError("retry max_delay must be at least base_delay")
        if self.max_retries is None and self.max_elapsed is None:
            raise ValueError("a retry policy needs max_retries or max_elapsed")
        if self.max_retries is not None and self.max_retries < 0:
            raise ValueError("retry max_retries must not be negative")

    def delays(self, rng: Optional[random.Random] = None) -> Iterator[float]:
        """The sleeps before each retry, in seconds, ignoring ``max_elapsed`` (endless when
        ``max_retries`` is ``None``)."""
        uniform = (rng or random).uniform
        n = 0
        while self.max_retries is None or n < self.max_retries:
            delay = min(self.base_delay * 2.0 ** min(n, 64), self.max_delay)
            yield delay + uniform(0.0, delay)
            n += 1


class Schedule(Protocol):
    """What decides, after an attempt of a call failed, whether and when to make another."""

    def pause_after(self, error: CredpoolError, now: float) -> Optional[float]:
        """Seconds to pause before the next attempt after ``error`` at ``now`` (a
        ``time.monotonic()`` value); ``None`` to give up and raise ``error``."""


class Retries:
    """One call's retries by its :class:`RetryPolicy` (a :class:`Schedule`): the pause before
    each, until the policy gives up or the pause would end past the call's deadline."""

    def __init__(self, policy: RetryPolicy, now: float, deadline: Optional[float] = None) -> None:
        """``now`` and ``deadline`` are ``time.monotonic()`` values: the first attempt's start
        (``max_elapsed`` counts from it) and, if given, when the call must have ended."""
        if policy.max_elapsed is not None:
            give_up = now + policy.max_elapsed
            deadline = give_up if deadline is None else min(deadline, give_up)
        self._deadline = deadline
        self._delays = policy.delays()

    def pause_after(self, error: CredpoolError, now: float) -> Optional[float]:
        """Seconds to pause before the next attempt after ``error`` at ``now``; ``None`` to give
        up and raise it: an error the client does not retry (:func:`retried_by_client`), the
        retries used up, or a pause that would end at or past the deadline."""
        if not retried_by_client(error):
            return None
        delay = next(self._delays, None)
        if delay is None or (self._deadline is not None and now + delay >= self._deadline):
            return None
        return delay


def renew_schedule(lease_seconds: float, fraction: float) -> Tuple[float, float]:
    """``(interval, margin)`` in seconds for a lease of ``lease_seconds``: renew every
    ``lease_seconds * fraction`` (at least :data:`MIN_RENEW_INTERVAL`), and count the lease as
    ending ``margin`` (a tenth of the lease, at most :data:`MAX_RENEW_MARGIN`) before its local
    end."""
    interval = max(lease_seconds * fraction, MIN_RENEW_INTERVAL)
    margin = min(lease_seconds / 10.0, MAX_RENEW_MARGIN)
    return interval, margin


def whole_seconds(seconds: float) -> int:
    """``seconds`` as whole seconds for ``retry_after_seconds``: rounded up, at least 0, at most
    :data:`MAX_RETRY_AFTER_SECONDS`."""
    if math.isnan(seconds) or seconds <= 0:
        return 0
    if math.isinf(seconds) or seconds >= MAX_RETRY_AFTER_SECONDS:
        return MAX_RETRY_AFTER_SECONDS
    return min(math.ceil(seconds), MAX_RETRY_AFTER_SECONDS)


def check_report(outcome: str, retry_after: Optional[float], usage_tokens: Optional[int]) -> None:
    """Raises ``ValueError`` for an outcome the server does not know, a ``retry_after`` with an
    outcome that cannot carry one or below zero, or a ``usage_tokens`` that is not a count."""
    if outcome not in OUTCOMES:
        raise ValueError(f"outcome must be one of {sorted(OUTCOMES)}, not {outcome!r}")
    if retry_after is not None:
        if outcome not in OUTCOMES_WITH_RETRY_AFTER:
            raise ValueError("retry_after goes only with rate_limited or quota_exhausted")
        if isinstance(retry_after, bool) or not isinstance(retry_after, (int, float)):
            raise ValueError("retry_after must be a number of seconds")
        if math.isnan(retry_after) or retry_after < 0:
            raise ValueError("retry_after must be zero or more seconds")
    _check_count("usage_tokens", usage_tokens)


def _check_count(name: str, value: Optional[int]) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
        raise ValueError(f"{name} must be a whole number of tokens, zero or more")


@dataclass(frozen=True)
class LeaseRequest:
    """What one ``lease()`` asks for, checked when made (``ValueError`` for arguments no server
    can take): the allocate's fields, the ``wait`` in seconds, and the affinity fields of
    :func:`affinity_fields`."""

    provider: str
    model: str
    pool: str
    holder: Optional[str]
    lease_seconds: Optional[int]
    wait: Optional[float]
    tokens: Optional[int]
    affinity: Dict[str, Any]

    def __post_init__(self) -> None:
        lease_seconds, wait = self.lease_seconds, self.wait
        if lease_seconds is not None and (
            isinstance(lease_seconds, bool)
            or not isinstance(lease_seconds, int)
            or lease_seconds < 1
        ):
            raise ValueError("lease_seconds must be a whole number of seconds, at least 1")
        if wait is not None and (
            isinstance(wait, bool) or not isinstance(wait, (int, float)) or not wait >= 0
        ):
            raise ValueError("wait must be zero or more seconds")
        _check_count("tokens", self.tokens)

    def body(self, request_id: str, wait_ms: Optional[int]) -> Dict[str, Any]:
        """The ``POST /api/internal/allocate-key`` body of one attempt: ``request_id``, the same
        for every attempt, and ``wait_ms``, what is left of the wait (``None``: none). Optional
        fields are left out when unset: the server refuses unknown fields, so ``tokens`` (rate
        windows) is sent only when given, and the affinity fields only with an affinity key."""
        body: Dict[str, Any] = {"provider": self.provider, "model": self.model, "pool": self.pool}
        if self.lease_seconds is not None:
            body["lease_seconds"] = self.lease_seconds
        if self.holder is not None:
            body["holder"] = self.holder
        body["request_id"] = request_id
        if wait_ms is not None:
            body["wait_ms"] = wait_ms
        if self.tokens is not None:
            body["tokens"] = self.tokens
        body.update(self.affinity)
        return body


#: The longest binding TTL the server takes, in seconds (one day).
MAX_AFFINITY_TTL = 86_400

#: What ``affinity_mode`` can say.
AFFINITY_MODES = ("preferred", "strict")


def affinity_fields(
    affinity_key: Optional[str], affinity_ttl: Optional[float], affinity_mode: Optional[str]
) -> Dict[str, Any]:
    """The allocate body's affinity fields for ``lease()``'s arguments (empty without a key):
    ``affinity_key``, ``affinity_ttl_seconds`` (whole seconds, rounded up) and ``affinity_mode``,
    each only when given. Raises ``ValueError`` for values no server takes: a key that is not 1 to
    256 printable characters, a TTL outside (0, 1 day], a mode other than ``preferred`` or
    ``strict``, or a TTL or mode without a key."""
    if affinity_key is None:
        if affinity_ttl is not None or affinity_mode is not None:
            raise ValueError("affinity_ttl and affinity_mode need an affinity_key")
        return {}
    if (
        not isinstance(affinity_key, str)
        or not 1 <= len(affinity_key) <= 256
        or not affinity_key.isprintable()
    ):
        raise ValueError("affinity_key must be 1 to 256 printable characters")
    fields: Dict[str, Any] = {"affinity_key": affinity_key}
    if affinity_ttl is not None:
        if (
            isinstance(affinity_ttl, bool)
            or not isinstance(affinity_ttl, (int, float))
            or not 0 < affinity_ttl <= MAX_AFFINITY_TTL
        ):
            raise ValueError("affinity_ttl must be more than 0 and at most 86400 seconds")
        fields["affinity_ttl_seconds"] = math.ceil(affinity_ttl)
    if affinity_mode is not None:
        if affinity_mode not in AFFINITY_MODES:
            raise ValueError("affinity_mode must be 'preferred' or 'strict'")
        fields["affinity_mode"] = affinity_mode
    return fields


@dataclass(frozen=True)
class LeaseRef:
    """What names a lease in renew and release: all four values the grant returned, and its
    fence."""

    provider: str
    pool: str
    key_id: str
    lease_id: str
    fence: int

    def body(self) -> Dict[str, Any]:
        return {
            "provider": self.provider,
            "pool": self.pool,
            "key_id": self.key_id,
            "lease_id": self.lease_id,
            "fence": self.fence,
        }


def renew_body(ref: LeaseRef, lease_seconds: Optional[int]) -> Dict[str, Any]:
    """The ``POST /api/internal/renew-lease`` body: the lease, its fence, and the same
    ``lease_seconds`` the allocate asked for (left out when it asked for none: the server then
    extends by the length it granted)."""
    body = ref.body()
    if lease_seconds is not None:
        body["lease_seconds"] = lease_seconds
    return body


def release_body(
    ref: LeaseRef, outcome: str, retry_after: Optional[float], usage_tokens: Optional[int]
) -> Dict[str, Any]:
    """The ``POST /api/internal/release-key`` body: the lease, its fence, the outcome, and
    ``retry_after_seconds`` (whole seconds, rounded up) when given with ``rate_limited`` or
    ``quota_exhausted``; ``"usage": {"tokens": N}`` (rate windows) only when ``usage_tokens`` is
    given."""
    body = ref.body()
    body["outcome"] = outcome
    if retry_after is not None and outcome in OUTCOMES_WITH_RETRY_AFTER:
        body["retry_after_seconds"] = whole_seconds(retry_after)
    if usage_tokens is not None:
        body["usage"] = {"tokens": usage_tokens}
    return body


@dataclass(frozen=True)
class Answer:
    """An HTTP answer, read whole. ``repr()`` leaves out the body, which may hold a credential."""

    status: int
    body: bytes = field(repr=False)
    retry_after: Optional[str] = None
    request_id: Optional[str] = None

    @classmethod
    def of(cls, response: httpx.Response) -> Answer:
        return cls(
            status=response.status_code,
            body=response.content,
            retry_after=response.headers.get("retry-after"),
            request_id=response.headers.get("x-request-id"),
        )


@dataclass(frozen=True)
class Granted:
    """A 200 answer to allocate, checked. ``repr()`` leaves out the credential."""

    ref: LeaseRef
    provider_model: str
    lease_until: datetime
    probe: bool
    #: The length, in seconds, the server granted the lease for (and extends it by on each
    #: renewal that names none); ``None`` from servers that do not send it.
    lease_seconds: Optional[int]
    #: Always a JSON object.
    credential: Dict[str, Any] = field(repr=False)
    #: With an affinity key: ``"hit"``, ``"new"`` or ``"moved"``; ``None`` when absent.
    affinity: Optional[str] = None


_RFC3339 = re.compile(
    r"(\d{4})-(\d{2})-(\d{2})[Tt ](\d{2}):(\d{2}):(\d{2})(?:\.(\d+))?"
    r"(?:([Zz])|([+-])(\d{2}):(\d{2}))$"
)


def parse_rfc3339(text: str) -> datetime:
    """An RFC 3339 timestamp (``2026-11-29T21:15:29.52241Z``) as an aware ``datetime``.
    ``datetime.fromisoformat`` takes neither ``Z`` nor 1-5 or 7-9 fraction digits before
    Python 3.11. Raises ``ValueError``."""
    match = _RFC3339.match(text)
    if match is None:
        raise ValueError("not an RFC 3339 timestamp")
    year, month, day, hour, minute, second = (int(match.group(i)) for i in range(1, 7))
    fraction = match.group(7) or "0"
    microsecond = int((fraction + "000000")[:6])
    if match.group(8):
        tz = timezone.utc
    else:
        offset = timedelta(hours=int(match.group(10)), minutes=int(match.group(11)))
        tz = timezone(offset if match.group(9) == "+" else -offset)
    return datetime(year, month, day, hour, minute, min(second, 59), microsecond, tzinfo=tz)


def _object_of(answer: Answer) -> Dict[str, Any]:
    try:
        value = json.loads(answer.body)
    except ValueError:
        # json's messages quote a little of the input: say only that it was not JSON.
        raise _unexpected(answer, "the body is not JSON") from None
    if not isinstance(value, dict):
        raise _unexpected(answer, "the body is JSON but not an object")
    return value


def _unexpected(answer: Answer, detail: str) -> UnexpectedResponse:
    return UnexpectedResponse(answer.status, detail, request_id=answer.request_id)


def _text(answer: Answer, obj: Mapping[str, Any], field: str) -> str:
    value = obj.get(field)
    if not isinstance(value, str):
        raise _unexpected(answer, f"field `{field}` is missing or not a string")
    return value


def _instant(answer: Answer, obj: Mapping[str, Any], field: str) -> datetime:
    try:
        return parse_rfc3339(_text(answer, obj, field))
    except ValueError:
        raise _unexpected(answer, f"field `{field}` is not an RFC 3339 timestamp") from None


_HEX32 = re.compile(r"[0-9A-Fa-f]{32}")


def parse_granted(answer: Answer) -> Granted:
    """Parses a 200 answer to allocate. The error names the field that was wrong, never its
    value. Raises :class:`UnexpectedResponse`."""
    obj = _object_of(answer)
    credential = obj.get("credential")
    if not isinstance(credential, dict):
        raise _unexpected(answer, "field `credential` is missing or not a JSON object")
    lease_id = _text(answer, obj, "lease_id")
    if _HEX32.fullmatch(lease_id) is None:
        raise _unexpected(answer, "field `lease_id` is not 32 hex digits")
    fence = obj.get("fence")
    if isinstance(fence, bool) or not isinstance(fence, int) or fence <= 0:
        raise _unexpected(answer, "field `fence` is missing or not a positive integer")
    key_id = _text(answer, obj, "key_id")
    if not key_id:
        raise _unexpected(answer, "field `key_id` is empty")
    probe = obj.get("probe")
    if not isinstance(probe, bool):
        raise _unexpected(answer, "field `probe` is missing or not a boolean")
    # Absent from servers older than the field; when present, a positive integer.
    lease_seconds = obj.get("lease_seconds")
    if "lease_seconds" in obj and (
        isinstance(lease_seconds, bool)
        or not isinstance(lease_seconds, int)
        or not 0 < lease_seconds <= MAX_GRANTED_SECONDS
    ):
        raise _unexpected(answer, "field `lease_seconds` is not a positive integer below 2^32")
    affinity = obj.get("affinity")
    if affinity is not None and not isinstance(affinity, str):
        raise _unexpected(answer, "field `affinity` is not a string")
    return Granted(
        ref=LeaseRef(
            provider=_text(answer, obj, "provider"),
            pool=_text(answer, obj, "pool"),
            key_id=key_id,
            lease_id=lease_id,
            fence=fence,
        ),
        provider_model=_text(answer, obj, "provider_model"),
        lease_until=_instant(answer, obj, "lease_until"),
        probe=probe,
        lease_seconds=lease_seconds,
        credential=credential,
        affinity=affinity,
    )


def parse_renewed(answer: Answer) -> datetime:
    """Parses a 200 answer to renew: the lease's new end. Raises :class:`UnexpectedResponse`."""
    return _instant(answer, _object_of(answer), "lease_until")


def parse_released(answer: Answer) -> Tuple[bool, Optional[str]]:
    """Parses a 200 answer to release: ``(released, reason)``. Raises
    :class:`UnexpectedResponse`."""
    obj = _object_of(answer)
    released = obj.get("released")
    if not isinstance(released, bool):
        raise _unexpected(answer, "field `released` is missing or not a boolean")
    reason = obj.get("reason")
    if reason is not None and not isinstance(reason, str):
        raise _unexpected(answer, "field `reason` is not a string")
    return released, reason


def parse_retry_after(header: Optional[str]) -> float:
    """A 429's ``Retry-After`` in whole seconds, at least 1. A missing header, an HTTP date or
    anything else that is not a number of seconds counts as 1 s: credpool always sends seconds."""
    try:
        seconds = int((header or "").strip())
    except ValueError:
        return 1.0
    return float(max(seconds, 1))


def error_of(answer: Answer, scrub: Callable[[str], str]) -> CredpoolError:
    """The error an answer other than 200 stands for. Server messages go through ``scrub``
    (which removes the internal key) before they are kept."""
    code, message = None, ""
    try:
        value = json.loads(answer.body)
    except ValueError:
        value = None
    if isinstance(value, dict) and isinstance(value.get("error"), dict):
        raw_code = value["error"].get("code")
        raw_message = value["error"].get("message")
        if isinstance(raw_code, str) and raw_code:
            code = raw_code
            message = raw_message if isinstance(raw_message, str) else ""
    if code is None:
        if answer.status in (502, 503, 504):
            return TransportError(
                f"HTTP {answer.status} from a proxy (no credpool error body)",
                kind="gateway",
                status=answer.status,
            )
        return _unexpected(answer, 'the body is not a credpool error (`{"error":{"code",...}}`)')
    message = scrub(message)
    cls = ERRORS_BY_CODE.get(code)
    if cls is not None and issubclass(cls, PoolExhausted):
        return cls(
            message,
            retry_after=parse_retry_after(answer.retry_after),
            status=answer.status,
            request_id=answer.request_id,
        )
    if cls is None:
        return ApiError(
            message, status=answer.status, code=scrub(code), request_id=answer.request_id
        )
    return cls(message, status=answer.status, request_id=answer.request_id)


def transport_error(error: httpx.HTTPError) -> TransportError:
    """A transport error for an exception of httpx, which is kept as the ``__cause__``; the
    message is httpx's own, which never holds request headers (so never the internal key)."""
    detail = str(error) or type(error).__name__
    if isinstance(error, httpx.TimeoutException):
        return TransportError(f"timed out ({detail})", kind="timeout")
    if isinstance(error, httpx.ConnectError):
        return TransportError(f"could not connect ({detail})", kind="connect")
    if isinstance(error, (httpx.NetworkError, httpx.RemoteProtocolError)):
        return TransportError(f"the connection failed mid-request ({detail})", kind="connection")
    return TransportError(f"the request failed ({detail})", kind="other")


def retried_by_client(error: CredpoolError) -> bool:
    """True for the failures the client itself retries with backoff: a 503 and a transport error
    may not have reached the store, and every request is safe to repeat (allocate carries a
    ``request_id``; renew and release are idempotent)."""
    if isinstance(error, StoreUnavailable):
        return True
    return isinstance(error, TransportError) and error.kind != "other"


def scrubber(secret: str) -> Callable[[str], str]:
    """A function that replaces ``secret`` in a text with ``<redacted>``."""

    def scrub(text: str) -> str:
        return text.replace(secret, "<redacted>") if secret and secret in text else text

    return scrub


def join_route(base_url: str, route: str) -> str:
    """``route`` joined onto ``base_url``, keeping the base's path prefix
    (``http://host/credpool`` + ``api/...``); the base's query and fragment are dropped."""
    url = httpx.URL(base_url)
    if url.scheme not in ("http", "https"):
        raise ValueError(
            f"the base URL must be http:// or https://, not {url.scheme or 'no scheme'}"
        )
    if not url.host:
        raise ValueError("the base URL has no host")
    path = url.path if url.path.endswith("/") else url.path + "/"
    return str(url.copy_with(path=path + route, query=None, fragment=None))


@dataclass(frozen=True)
class Request(Generic[T]):
    """One attempt of a call, ready to send: the URL, the JSON body, the seconds to wait for the
    answer, and how to read a 200 answer. ``repr()`` shows the URL and timeout only."""

    url: str
    body: Dict[str, Any] = field(repr=False)
    timeout: float
    parse: Callable[[Answer], T] = field(repr=False)
    scrub: Callable[[str], str] = field(repr=False)

    def read(self, answer: Answer) -> T:
        """The call's result from ``answer``; raises the error an answer other than 200 stands
        for (:func:`error_of`), or :class:`UnexpectedResponse`."""
        if answer.status != 200:
            raise error_of(answer, self.scrub)
        return self.parse(answer)


class Config:
    """Checked settings, shared by both clients, and the requests they send."""

    def __init__(
        self,
        base_url: str,
        internal_key: str,
        timeout: float,
        retry: Optional[RetryPolicy],
        renew_fraction: float,
    ) -> None:
        if not isinstance(internal_key, str) or not internal_key:
            raise ValueError("the internal key is empty")
        if any(c in internal_key for c in "\r\n\0"):
            raise ValueError("the internal key has characters an HTTP header cannot carry")
        if not timeout > 0:
            raise ValueError("the timeout must be positive seconds")
        if not 0.0 < renew_fraction < 1.0:
            raise ValueError("renew_fraction must be in (0, 1)")
        self.base_url = base_url
        self.allocate_url = join_route(base_url, ALLOCATE_ROUTE)
        self.renew_url = join_route(base_url, RENEW_ROUTE)
        self.release_url = join_route(base_url, RELEASE_ROUTE)
        self.headers = {"x-internal-key": internal_key}
        self.scrub = scrubber(internal_key)
        self.timeout = float(timeout)
        self.retry = retry if retry is not None else RetryPolicy()
        self.renew_fraction = renew_fraction

    def __repr__(self) -> str:
        return f"Config(base_url={self.base_url!r})"

    def renew(
        self, ref: LeaseRef, lease_seconds: Optional[int], deadline: float, now: float
    ) -> Request[Tuple[datetime, float]]:
        """The renewal of ``ref`` sent at ``now``, read as ``(lease_until, now)``. Its timeout
        ends at ``deadline`` (the lease's local end; both ``time.monotonic()`` values), but is
        never shorter than :data:`MIN_ATTEMPT_TIMEOUT`."""
        timeout = max(min(self.timeout, deadline - now), MIN_ATTEMPT_TIMEOUT)
        body = renew_body(ref, lease_seconds)
        return Request(
            self.renew_url, body, timeout, lambda answer: (parse_renewed(answer), now), self.scrub
        )

    def release(
        self,
        ref: LeaseRef,
        outcome: str,
        retry_after: Optional[float],
        usage_tokens: Optional[int],
    ) -> Request[Tuple[bool, Optional[str]]]:
        """The release of ``ref`` with its outcome (:func:`release_body`), read as
        ``(released, reason)``."""
        body = release_body(ref, outcome, retry_after, usage_tokens)
        return Request(self.release_url, body, self.timeout, parse_released, self.scrub)


class Allocation:
    """The allocate of one ``lease()`` over all its attempts, and their :class:`Schedule`: the one
    random ``request_id`` that every attempt carries (so a retry after a lost answer gets the
    same lease back and never takes a second slot), and the ``wait``: a 429 while some of it is
    left is asked again, at once when the server held the request, else after a backoff pause.

    Attempts come in runs: a run starts with the lease asked for or asked again after a 429, and
    retries 503s and transport errors by the client's :class:`RetryPolicy`. ``run_started`` is
    when the current run started; a lease granted to any attempt of the run was granted no
    earlier, so its renewal clock may count from there."""

    def __init__(self, config: Config, request: LeaseRequest, now: float) -> None:
        """``now``: ``time.monotonic()`` when the lease was asked for; the wait counts from it."""
        self._config = config
        self._request = request
        self.request_id = str(uuid.uuid4())
        wait = request.wait
        self._wait_until = now + min(wait, MAX_WAIT) if wait else None
        retry = config.retry
        # the policy's backoff, endless: it paces 429s for as long as the wait lasts
        self._pauses = RetryPolicy(retry.base_delay, retry.max_delay, None, 1.0).delays()
        self.run_started = now
        self._retries = Retries(retry, now)

    def attempt(self, now: float) -> Request[Granted]:
        """The attempt sent at ``now``: its ``wait_ms`` is what is left of the wait, which its
        timeout gets on top of the client's."""
        left = None if self._wait_until is None else self._wait_until - now
        wait_ms = int(left * 1000) if left is not None and left >= 0.001 else None
        body = self._request.body(self.request_id, wait_ms)
        timeout = self._config.timeout + (wait_ms or 0) / 1000.0
        return Request(self._config.allocate_url, body, timeout, parse_granted, self._config.scrub)

    def pause_after(self, error: CredpoolError, now: float) -> Optional[float]:
        """As :meth:`Retries.pause_after` within a run. After a 429: ``None`` when the wait is
        used up, else a new run, after no pause when the server held the request (it waited for
        a slot already), else after the next backoff pause, cut to the 429's ``retry_after`` and
        to what is left of the wait."""
        if not isinstance(error, PoolExhausted):
            return self._retries.pause_after(error, now)
        left = 0.0 if self._wait_until is None else self._wait_until - now
        # under a millisecond left is still left: raising then would end the wait early
        if left <= 0.0:
            return None
        pause = 0.0
        if now - self.run_started < HELD_AT_LEAST:
            pause = min(next(self._pauses), error.retry_after, left)
        # the next attempt is sent no earlier than this
        self.run_started = now + pause
        self._retries = Retries(self._config.retry, self.run_started)
        return pause
