"""SDK exceptions into outcomes: with look-alike classes (the helpers import no SDK), and with the
real openai and anthropic exception classes when those SDKs are installed (CI installs both)."""

from __future__ import annotations

import importlib
import subprocess
import sys
from datetime import datetime, timedelta, timezone
from email.utils import format_datetime
from typing import Any, Dict, Optional

import pytest

from credpool import AsyncClient, Outcome, outcome_for, retry_after_of
from harness import FakeCredpool


class FakeResponse:
    def __init__(self, status_code: int, headers: Optional[Dict[str, str]] = None) -> None:
        self.status_code = status_code
        self.headers = headers or {}


class APIStatusError(Exception):
    """Shaped like the Stainless SDKs' APIStatusError."""

    def __init__(
        self,
        status: int,
        headers: Optional[Dict[str, str]] = None,
        body: Any = None,
        code: Optional[str] = None,
        message: str = "",
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status_code = status
        self.response = FakeResponse(status, headers)
        self.body = body
        self.code = code


class RateLimitError(Exception):
    """A rate-limit error without a status (some wrappers)."""


def test_the_helpers_work_without_either_sdk_installed() -> None:
    # A fresh interpreter in which importing openai or anthropic fails, as if not installed.
    script = """
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("openai", "anthropic"):
            raise ModuleNotFoundError(name)
sys.meta_path.insert(0, Block())
import credpool
from credpool import outcome_for
class RateLimitError(Exception):
    status_code = 429
assert outcome_for(RateLimitError()).outcome == "rate_limited"
assert "openai" not in sys.modules and "anthropic" not in sys.modules
"""
    subprocess.run([sys.executable, "-c", script], check=True)


async def test_report_error_reports_what_the_exception_stands_for() -> None:
    fake = FakeCredpool()
    async with (
        AsyncClient(
            "http://credpool.test", internal_key="ik", transport=fake.transport()
        ) as client,
        client.lease("openai", "gpt-4o") as lease,
    ):
        lease.report_error(APIStatusError(429, {"retry-after": "12.5"}))
    release = fake.bodies("release-key")[0]
    assert (release["outcome"], release["retry_after_seconds"]) == ("rate_limited", 13)


@pytest.mark.parametrize(
    ("error", "expected"),
    [
        (APIStatusError(429, {"retry-after": "20"}), Outcome("rate_limited", 20.0)),
        (
            APIStatusError(429, {"retry-after-ms": "1500", "retry-after": "9"}),
            Outcome("rate_limited", 1.5),
        ),
        (APIStatusError(429, {"Retry-After": "7"}), Outcome("rate_limited", 7.0)),
        (APIStatusError(429), Outcome("rate_limited", None)),
        (APIStatusError(429, {"retry-after": "soon"}), Outcome("rate_limited", None)),
        # openai: the body is the error object, with code and type also on the exception
        (
            APIStatusError(
                429,
                body={"code": "insufficient_quota", "type": "insufficient_quota"},
                code="insufficient_quota",
            ),
            Outcome("quota_exhausted", None),
        ),
        # anthropic: the whole body
        (
            APIStatusError(400, body={"type": "error", "error": {"type": "billing_error"}}),
            Outcome("quota_exhausted", None),
        ),
        (
            APIStatusError(400, message="Your credit balance is too low to access the API"),
            Outcome("quota_exhausted", None),
        ),
        (APIStatusError(402), Outcome("quota_exhausted", None)),
        (
            APIStatusError(429, body={"type": "error", "error": {"type": "rate_limit_error"}}),
            Outcome("rate_limited", None),
        ),
        (APIStatusError(401), Outcome("auth_expired")),
        (APIStatusError(403), Outcome("failure")),
        (APIStatusError(500), Outcome("failure")),
        (
            APIStatusError(529, body={"type": "error", "error": {"type": "overloaded_error"}}),
            Outcome("failure"),
        ),
        (RateLimitError("slow down"), Outcome("rate_limited", None)),
        (TimeoutError(), Outcome("failure")),
        (ValueError("yours"), Outcome("failure")),
    ],
)
def test_look_alike_exceptions(error: BaseException, expected: Outcome) -> None:
    assert outcome_for(error) == expected


def test_an_http_date_retry_after_counts_from_now() -> None:
    now = datetime(2030, 1, 1, tzinfo=timezone.utc)
    header = format_datetime(now + timedelta(seconds=42), usegmt=True)
    error = APIStatusError(429, {"retry-after": header})
    assert retry_after_of(error, now=now.timestamp()) == pytest.approx(42.0)


def _response(module: Any, status: int, headers: Dict[str, str]) -> Any:
    """An httpx (or httpx2, for newer SDKs) response of the kind ``module`` raises with."""
    exceptions = importlib.import_module(module.__name__ + "._exceptions")
    http = getattr(exceptions, "httpx2", None) or exceptions.httpx
    request = http.Request("POST", "https://upstream.test/v1/x")
    return http.Response(status, headers=headers, request=request)


def test_real_openai_exceptions() -> None:
    openai = pytest.importorskip("openai")
    limited = openai.RateLimitError(
        "Error code: 429",
        response=_response(openai, 429, {"retry-after-ms": "2500", "x-request-id": "r"}),
        body={"message": "Rate limit reached", "type": "requests", "code": "rate_limit_exceeded"},
    )
    assert outcome_for(limited) == Outcome("rate_limited", 2.5)
    quota = openai.RateLimitError(
        "Error code: 429 - insufficient_quota",
        response=_response(openai, 429, {}),
        body={
            "message": "You exceeded your current quota",
            "type": "insufficient_quota",
            "code": "insufficient_quota",
        },
    )
    assert outcome_for(quota) == Outcome("quota_exhausted", None)
    auth = openai.AuthenticationError(
        "Error code: 401",
        response=_response(openai, 401, {}),
        body={
            "message": "Incorrect API key provided",
            "type": "invalid_request_error",
            "code": "invalid_api_key",
        },
    )
    assert outcome_for(auth) == Outcome("auth_expired")
    server = openai.InternalServerError(
        "Error code: 500", response=_response(openai, 500, {}), body=None
    )
    assert outcome_for(server) == Outcome("failure")


def test_real_anthropic_exceptions() -> None:
    anthropic = pytest.importorskip("anthropic")

    def body(kind: str) -> Dict[str, Any]:
        return {"type": "error", "error": {"type": kind, "message": "m"}}

    limited = anthropic.RateLimitError(
        "Error code: 429",
        response=_response(anthropic, 429, {"retry-after": "30"}),
        body=body("rate_limit_error"),
    )
    assert outcome_for(limited) == Outcome("rate_limited", 30.0)
    auth = anthropic.AuthenticationError(
        "Error code: 401",
        response=_response(anthropic, 401, {}),
        body=body("authentication_error"),
    )
    assert outcome_for(auth) == Outcome("auth_expired")
    billing = anthropic.BadRequestError(
        "Error code: 400", response=_response(anthropic, 400, {}), body=body("billing_error")
    )
    assert outcome_for(billing) == Outcome("quota_exhausted", None)
    overloaded_cls = getattr(anthropic, "OverloadedError", anthropic.InternalServerError)
    overloaded = overloaded_cls(
        "Error code: 529", response=_response(anthropic, 529, {}), body=body("overloaded_error")
    )
    assert outcome_for(overloaded) == Outcome("failure")
