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


def _anthropic_body(kind: str) -> Dict[str, Any]:
    return {"type": "error", "error": {"type": kind, "message": "m"}}


@pytest.mark.parametrize(
    ("sdk", "name", "status", "headers", "body", "expected"),
    [
        (
            "openai",
            "RateLimitError",
            429,
            {"retry-after-ms": "2500", "x-request-id": "r"},
            {"message": "Rate limit reached", "type": "requests", "code": "rate_limit_exceeded"},
            Outcome("rate_limited", 2.5),
        ),
        (
            "openai",
            "RateLimitError",
            429,
            {},
            {
                "message": "You exceeded your current quota",
                "type": "insufficient_quota",
                "code": "insufficient_quota",
            },
            Outcome("quota_exhausted", None),
        ),
        (
            "openai",
            "AuthenticationError",
            401,
            {},
            {
                "message": "Incorrect API key provided",
                "type": "invalid_request_error",
                "code": "invalid_api_key",
            },
            Outcome("auth_expired"),
        ),
        ("openai", "InternalServerError", 500, {}, None, Outcome("failure")),
        (
            "anthropic",
            "RateLimitError",
            429,
            {"retry-after": "30"},
            _anthropic_body("rate_limit_error"),
            Outcome("rate_limited", 30.0),
        ),
        (
            "anthropic",
            "AuthenticationError",
            401,
            {},
            _anthropic_body("authentication_error"),
            Outcome("auth_expired"),
        ),
        (
            "anthropic",
            "BadRequestError",
            400,
            {},
            _anthropic_body("billing_error"),
            Outcome("quota_exhausted", None),
        ),
        (
            "anthropic",
            "OverloadedError",
            529,
            {},
            _anthropic_body("overloaded_error"),
            Outcome("failure"),
        ),
    ],
)
def test_real_sdk_exceptions(
    sdk: str,
    name: str,
    status: int,
    headers: Dict[str, str],
    body: Any,
    expected: Outcome,
) -> None:
    module = pytest.importorskip(sdk)
    # anthropic's OverloadedError is newer than some versions the dev extra allows
    cls = getattr(module, name, None) or module.InternalServerError
    error = cls(f"Error code: {status}", response=_response(module, status, headers), body=body)
    assert outcome_for(error) == expected
