"""The protocol against a fake credpool: request bodies (``tokens`` and ``usage`` for rate
windows; what the real server does with them is in test_tokens.py), retries with one request_id,
waiting, renewal and loss, release on every exit path; and the pure helpers."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import logging
import random
import sys
import threading
import time
from datetime import datetime, timedelta, timezone
from typing import Any, Dict, List, Optional, Tuple

import httpx
import pytest

from credpool import (
    DEFAULT_LEASE_SECONDS,
    AsyncClient,
    Client,
    Credential,
    InternalError,
    LeaseLost,
    PoolExhausted,
    Released,
    RetryPolicy,
    StoreUnavailable,
    UnexpectedResponse,
)
from credpool._protocol import (
    MAX_RETRY_AFTER_SECONDS,
    Allocation,
    Answer,
    Config,
    LeaseRequest,
    join_route,
    parse_granted,
    parse_rfc3339,
    renew_schedule,
    whole_seconds,
)
from harness import FakeCredpool, error_response

FAST = RetryPolicy(base_delay=0.01, max_delay=0.05, max_elapsed=5.0)
BASE = "http://credpool.test"


def async_client(fake: FakeCredpool, **kw: Any) -> AsyncClient:
    kw.setdefault("retry", FAST)
    return AsyncClient(BASE, internal_key="ik-secret", transport=fake.transport(), **kw)


def sync_client(fake: FakeCredpool, **kw: Any) -> Client:
    kw.setdefault("retry", FAST)
    return Client(BASE, internal_key="ik-secret", transport=fake.transport(), **kw)


# -- bodies --------------------------------------------------------------------------------


async def test_bodies_leave_out_unset_fields_so_todays_server_takes_them() -> None:
    fake = FakeCredpool()
    async with async_client(fake) as client, client.lease("openai", "gpt-4o"):
        pass
    (allocate,) = fake.bodies("allocate-key")
    assert set(allocate) == {"provider", "model", "pool", "request_id"}
    assert allocate["pool"] == "default"
    (release,) = fake.bodies("release-key")
    assert release == {
        "provider": "openai",
        "pool": "default",
        "key_id": "key-a",
        "lease_id": "0123456789abcdef0123456789abcdef",
        "fence": 4711,
        "outcome": "success",
    }


async def test_tokens_and_usage_are_sent_when_given() -> None:
    fake = FakeCredpool()
    async with (
        async_client(fake) as client,
        client.lease(
            "openai", "gpt-4o", pool="vip", holder="w-1", lease_seconds=20, tokens=1200
        ) as lease,
    ):
        lease.report("success", usage_tokens=987)
    (allocate,) = fake.bodies("allocate-key")
    assert allocate["tokens"] == 1200
    assert (allocate["pool"], allocate["holder"], allocate["lease_seconds"]) == ("vip", "w-1", 20)
    (release,) = fake.bodies("release-key")
    assert release["usage"] == {"tokens": 987}
    assert "retry_after_seconds" not in release


def test_tokens_and_usage_are_sent_when_given_sync() -> None:
    fake = FakeCredpool()
    with sync_client(fake) as client, client.lease("openai", "gpt-4o", tokens=0) as lease:
        lease.report("quota_exhausted", retry_after=12.001, usage_tokens=5)
    assert fake.bodies("allocate-key")[0]["tokens"] == 0
    release = fake.bodies("release-key")[0]
    assert release["usage"] == {"tokens": 5}
    assert (release["outcome"], release["retry_after_seconds"]) == ("quota_exhausted", 13)


async def test_affinity_is_sent_only_with_a_key_and_checked_first() -> None:
    fake = FakeCredpool()
    async with (
        async_client(fake) as client,
        client.lease(
            "openai", "gpt-4o", affinity_key="conv-1", affinity_ttl=1.2, affinity_mode="strict"
        ),
    ):
        pass
    (allocate,) = fake.bodies("allocate-key")
    assert allocate["affinity_key"] == "conv-1"
    assert allocate["affinity_ttl_seconds"] == 2  # whole seconds, rounded up
    assert allocate["affinity_mode"] == "strict"
    with sync_client(fake) as sync, sync.lease("openai", "gpt-4o", affinity_key="conv-2"):
        pass
    second = fake.bodies("allocate-key")[1]
    assert second["affinity_key"] == "conv-2"
    assert "affinity_ttl_seconds" not in second
    assert "affinity_mode" not in second
    for bad in (
        {"affinity_key": ""},
        {"affinity_key": "x" * 257},
        {"affinity_key": "line\nbreak"},
        {"affinity_key": "c", "affinity_ttl": 0},
        {"affinity_key": "c", "affinity_ttl": 86_401},
        {"affinity_key": "c", "affinity_mode": "sticky"},
        {"affinity_ttl": 60},
        {"affinity_mode": "strict"},
    ):
        with pytest.raises(ValueError, match="affinity"):
            sync.lease("openai", "gpt-4o", **bad)
    assert len(fake.bodies("allocate-key")) == 2


def test_retry_after_goes_in_whole_seconds_rounded_up_and_capped() -> None:
    assert whole_seconds(12) == 12
    assert whole_seconds(12.001) == 13
    assert whole_seconds(0.001) == 1
    assert whole_seconds(0) == 0
    assert whole_seconds(1e12) == MAX_RETRY_AFTER_SECONDS
    assert whole_seconds(float("inf")) == MAX_RETRY_AFTER_SECONDS


async def test_report_refuses_what_the_server_would() -> None:
    fake = FakeCredpool()
    async with async_client(fake) as client, client.lease("openai", "gpt-4o") as lease:
        bad: List[Tuple[str, Optional[float], Any]] = [
            ("great", None, None),
            ("success", 3, None),
            ("rate_limited", -1, None),
            ("success", None, -5),
            ("success", None, 1.5),
        ]
        for outcome, retry_after, usage_tokens in bad:
            with pytest.raises(ValueError):  # noqa: PT011 (each message differs)
                lease.report(outcome, retry_after, usage_tokens)
    with pytest.raises(ValueError, match="lease_seconds"):
        client.lease("openai", "gpt-4o", lease_seconds=0)
    with pytest.raises(ValueError, match="tokens"):
        client.lease("openai", "gpt-4o", tokens=-1)


# -- retries -------------------------------------------------------------------------------


async def test_503_and_transport_errors_are_retried_with_one_request_id() -> None:
    fake = FakeCredpool()
    fake.queue(
        "allocate-key",
        error_response(503, "store_unavailable"),
        httpx.ConnectError("refused"),
        httpx.ReadTimeout("slow"),
        httpx.RemoteProtocolError("closed without an answer"),
        httpx.Response(502, content=b"<html>bad gateway</html>"),
    )
    async with async_client(fake) as client, client.lease("openai", "gpt-4o") as lease:
        assert lease.fence == 4711
    allocates = fake.bodies("allocate-key")
    assert len(allocates) == 6
    assert len({body["request_id"] for body in allocates}) == 1
    # every lease draws its own
    async with async_client(fake) as client, client.lease("openai", "gpt-4o"):
        pass
    assert fake.bodies("allocate-key")[-1]["request_id"] != allocates[0]["request_id"]


def test_503_is_retried_with_one_request_id_sync() -> None:
    fake = FakeCredpool()
    fake.queue("allocate-key", error_response(503, "store_unavailable"), httpx.ConnectError("x"))
    with sync_client(fake) as client, client.lease("openai", "gpt-4o"):
        pass
    allocates = fake.bodies("allocate-key")
    assert len(allocates) == 3
    assert len({body["request_id"] for body in allocates}) == 1


async def test_retries_give_up_after_the_policy() -> None:
    fake = FakeCredpool()
    fake.queue("allocate-key", *[error_response(503, "store_unavailable")] * 10)
    policy = RetryPolicy(base_delay=0.01, max_delay=0.01, max_retries=3, max_elapsed=None)
    async with async_client(fake, retry=policy) as client:
        with pytest.raises(StoreUnavailable):
            async with client.lease("openai", "gpt-4o"):
                pass
    assert len(fake.bodies("allocate-key")) == 4


async def test_other_errors_are_not_retried() -> None:
    fake = FakeCredpool()
    fake.queue("allocate-key", error_response(500, "internal_error"))
    async with async_client(fake) as client:
        with pytest.raises(InternalError):
            async with client.lease("openai", "gpt-4o"):
                pass
    assert len(fake.bodies("allocate-key")) == 1


def test_backoff_is_capped_exponential_with_jitter() -> None:
    policy = RetryPolicy(base_delay=0.1, max_delay=1.0, max_retries=8, max_elapsed=None)
    delays = list(policy.delays(random.Random(7)))
    assert len(delays) == 8
    for n, delay in enumerate(delays):
        plain = min(0.1 * 2**n, 1.0)
        assert plain <= delay <= 2 * plain
    with pytest.raises(ValueError, match="max_retries or max_elapsed"):
        RetryPolicy(max_retries=None, max_elapsed=None)


# -- waiting -------------------------------------------------------------------------------


async def test_a_429_without_wait_raises_at_once() -> None:
    fake = FakeCredpool()
    fake.queue("allocate-key", error_response(429, "pool_exhausted", headers={"retry-after": "4"}))
    async with async_client(fake) as client:
        with pytest.raises(PoolExhausted) as raised:
            async with client.lease("openai", "gpt-4o"):
                pass
    assert raised.value.retry_after == 4.0
    assert len(fake.bodies("allocate-key")) == 1
    assert "wait_ms" not in fake.bodies("allocate-key")[0]


async def test_with_wait_a_429_is_asked_again_with_what_is_left() -> None:
    fake = FakeCredpool()
    busy = error_response(429, "pool_exhausted", headers={"retry-after": "1"})
    fake.queue("allocate-key", busy, busy)
    async with async_client(fake) as client, client.lease("openai", "gpt-4o", wait=30.0):
        pass
    waits = [body["wait_ms"] for body in fake.bodies("allocate-key")]
    assert len(waits) == 3
    assert 29_000 < waits[0] <= 30_000
    assert waits[0] >= waits[1] >= waits[2]
    assert len({body["request_id"] for body in fake.bodies("allocate-key")}) == 1


def test_with_wait_the_pool_exhausted_comes_when_the_wait_is_used_up() -> None:
    fake = FakeCredpool()
    fake.queue("allocate-key", *[error_response(429, "pool_exhausted")] * 1000)
    started = time.monotonic()
    with sync_client(fake) as client:
        with pytest.raises(PoolExhausted), client.lease("openai", "gpt-4o", wait=0.3):
            pass
    assert time.monotonic() - started >= 0.3
    # the fake answers at once, so the client paused between asks instead of spinning
    assert len(fake.bodies("allocate-key")) < 50


def test_a_429_with_under_a_millisecond_of_the_wait_left_pauses_for_it_instead_of_raising() -> None:
    config = Config("http://127.0.0.1:1", "key", 5.0, None, 0.5)
    request = LeaseRequest("openai", "gpt-4o", "default", None, None, 0.3, None, {})
    allocation = Allocation(config, request, 100.0)
    busy = PoolExhausted("busy", retry_after=1.0)
    # a 429 after the server held the request: asked again at once (a new run from 100.2)
    assert allocation.pause_after(busy, 100.2) == 0.0
    # answered at once 0.4 ms before the wait ends: pause for the rest...
    pause = allocation.pause_after(busy, 100.2996)
    assert pause is not None
    assert pause == pytest.approx(0.0004)
    # (an attempt with under a millisecond left carries no wait_ms), then raise at the end
    assert "wait_ms" not in allocation.attempt(100.2996).body
    assert allocation.pause_after(busy, 100.3) is None


# -- renewal and loss ----------------------------------------------------------------------


async def test_renewal_sends_the_fence_and_the_lease_length() -> None:
    fake = FakeCredpool()
    renewed_twice = asyncio.Event()
    fake.on_request = lambda *_: (
        renewed_twice.set() if len(fake.bodies("renew-lease")) >= 2 else None
    )
    async with async_client(fake, renew_fraction=0.1) as client:
        async with client.lease("openai", "gpt-4o", lease_seconds=3) as lease:
            await asyncio.wait_for(renewed_twice.wait(), 30)
            assert lease.lease_until == datetime(2030, 1, 1, 0, 1, 10, tzinfo=timezone.utc)
    renew = fake.bodies("renew-lease")[0]
    assert renew == {
        "provider": "openai",
        "pool": "default",
        "key_id": "key-a",
        "lease_id": "0123456789abcdef0123456789abcdef",
        "fence": 4711,
        "lease_seconds": 3,
    }


async def test_a_410_loses_the_lease_and_cancel_on_loss_ends_the_block() -> None:
    fake = FakeCredpool()
    fake.queue("renew-lease", error_response(410, "lease_lost", request_id="rid-410"))
    fake.queue("release-key", httpx.Response(200, json={"released": False, "reason": "not_found"}))
    async with async_client(fake, renew_fraction=0.1) as client:
        with pytest.raises(LeaseLost) as raised:
            async with client.lease("openai", "gpt-4o", lease_seconds=2, cancel_on_loss=True):
                await asyncio.sleep(30)
    assert raised.value.request_id == "rid-410"
    assert isinstance(raised.value.__cause__, asyncio.CancelledError)
    # released all the same, with failure: the report counts for the credential's health
    assert fake.bodies("release-key")[0]["outcome"] == "failure"


async def test_a_block_that_swallows_the_loss_cancellation_leaves_the_task_uncancelled() -> None:
    fake = FakeCredpool()
    fake.queue("renew-lease", error_response(410, "lease_lost"))
    async with async_client(fake, renew_fraction=0.1) as client:
        async with client.lease("openai", "gpt-4o", lease_seconds=2, cancel_on_loss=True) as lease:
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.sleep(30)
        assert lease.lost.is_set()
        task = asyncio.current_task()
        if sys.version_info >= (3, 11) and task is not None:
            assert task.cancelling() == 0
        await asyncio.sleep(0.01)  # not cancelled again


def wide_margin(monkeypatch: pytest.MonkeyPatch) -> None:
    """Makes the client count a lease as ending at a fifth of its length (renewing every twentieth):
    a loss scheduled by the margin then comes long before the lease's end, so that a test can
    tell it from one at the end on a loaded machine (the margin's own rule, a tenth capped at
    2 s, is ``renew_schedule``'s test)."""
    import credpool._protocol as protocol

    monkeypatch.setattr(
        protocol, "renew_schedule", lambda length, fraction: (length / 20.0, length * 0.8)
    )


async def test_renewal_that_keeps_failing_loses_the_lease_before_it_ends(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    wide_margin(monkeypatch)
    fake = FakeCredpool()
    fake.queue("renew-lease", *[error_response(503, "store_unavailable")] * 1000)
    async with async_client(fake) as client:
        async with client.lease("openai", "gpt-4o", lease_seconds=1) as lease:
            started = time.monotonic()
            await asyncio.wait_for(lease.lost.wait(), 30)
            # the lease would end 1 s after the grant; the client gives up at its margin (here
            # 0.2 s after the grant), not at the end: halfway is the line between the two
            assert time.monotonic() - started < 0.6
            assert isinstance(lease.lost_error, StoreUnavailable)
            with pytest.raises(LeaseLost):
                lease.raise_if_lost()


async def test_renewals_follow_the_granted_length_when_none_was_asked_for() -> None:
    fake = FakeCredpool()
    # A server whose maximum is 6 s grants its default, 6 s, and says so.
    fake.queue("allocate-key", httpx.Response(200, json=fake.granted(lease_seconds=6)))
    renewed_twice = asyncio.Event()
    fake.on_request = lambda *_: (
        renewed_twice.set() if len(fake.times("renew-lease")) >= 2 else None
    )
    async with async_client(fake) as client:
        started = time.monotonic()
        async with client.lease("openai", "gpt-4o") as lease:
            assert lease.lease_seconds == 6
            await asyncio.wait_for(renewed_twice.wait(), 30)
            assert not lease.lost.is_set()
    # every third of 6 s: 2 s after the allocate was sent, then 2 s after each renewal
    first, second = fake.times("renew-lease")[:2]
    gaps = [first - started, second - first]
    assert all(1.9 <= gap < 3.0 for gap in gaps), gaps
    # nothing asked for, nothing sent: the server renews by the length it granted
    assert "lease_seconds" not in fake.bodies("allocate-key")[0]
    assert all("lease_seconds" not in body for body in fake.bodies("renew-lease"))


def test_renewals_follow_the_granted_length_when_none_was_asked_for_sync() -> None:
    fake = FakeCredpool()
    fake.queue("allocate-key", httpx.Response(200, json=fake.granted(lease_seconds=6)))
    renewed = threading.Event()
    fake.on_request = lambda route, _: renewed.set() if route == "renew-lease" else None
    with sync_client(fake) as client:
        started = time.monotonic()
        with client.lease("openai", "gpt-4o") as lease:
            assert lease.lease_seconds == 6
            assert renewed.wait(30)
    first = fake.times("renew-lease")[0]
    assert 1.9 <= first - started < 3.0, first - started
    assert "lease_seconds" not in fake.bodies("renew-lease")[0]


async def test_the_lease_length_is_the_answers_else_the_requested_else_the_default() -> None:
    fake = FakeCredpool()
    fake.queue(
        "allocate-key",
        httpx.Response(200, json=fake.granted(lease_seconds=1)),
        httpx.Response(200, json=fake.granted_by_an_older_server()),
        httpx.Response(200, json=fake.granted_by_an_older_server()),
    )
    async with async_client(fake) as client:
        # the answer wins over the request
        async with client.lease("openai", "gpt-4o", lease_seconds=30) as lease:
            assert lease.lease_seconds == 1
            assert "lease_seconds=1" in repr(lease)
        # an older server does not say: the length asked for, renewed every third of a second
        async with client.lease("openai", "gpt-4o", lease_seconds=1) as lease:
            assert lease.lease_seconds == 1
            for _ in range(200):
                if len(fake.bodies("renew-lease")) >= 2:
                    break
                await asyncio.sleep(0.01)
            assert len(fake.bodies("renew-lease")) >= 2
        # and with nothing asked for either, the server's default: no renewal for 11 s
        renewals = len(fake.bodies("renew-lease"))
        async with client.lease("openai", "gpt-4o") as lease:
            assert lease.lease_seconds == DEFAULT_LEASE_SECONDS == 35
            await asyncio.sleep(1)
        assert len(fake.bodies("renew-lease")) == renewals


def test_the_lease_length_falls_back_to_the_requested_then_the_default_sync() -> None:
    fake = FakeCredpool()
    older = httpx.Response(200, json=fake.granted_by_an_older_server())
    fake.queue("allocate-key", older, older)
    with sync_client(fake) as client:
        with client.lease("openai", "gpt-4o", lease_seconds=7) as lease:
            assert lease.lease_seconds == 7
        with client.lease("openai", "gpt-4o") as lease:
            assert lease.lease_seconds == DEFAULT_LEASE_SECONDS


async def test_renewal_that_keeps_failing_loses_the_lease_before_the_granted_length_ends(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    wide_margin(monkeypatch)
    fake = FakeCredpool()
    fake.queue("allocate-key", httpx.Response(200, json=fake.granted(lease_seconds=1)))
    fake.queue("renew-lease", *[error_response(503, "store_unavailable")] * 1000)
    async with async_client(fake) as client:
        started = time.monotonic()
        async with client.lease("openai", "gpt-4o") as lease:
            await asyncio.wait_for(lease.lost.wait(), 5)
            # granted for 1 s, nothing asked for: given up at the granted length's margin (here
            # 0.2 s), not at its end (1 s) nor at the default's margin (7 s)
            assert time.monotonic() - started < 0.6
            assert isinstance(lease.lost_error, StoreUnavailable)


def test_a_410_loses_the_lease_sync() -> None:
    fake = FakeCredpool()
    fake.queue("renew-lease", error_response(410, "lease_lost"))
    with sync_client(fake, renew_fraction=0.1) as client:
        with client.lease("openai", "gpt-4o", lease_seconds=2) as lease:
            assert lease.lost.wait(30)
            assert isinstance(lease.lost_error, LeaseLost)
    assert fake.bodies("release-key")[0]["outcome"] == "success"


async def test_a_release_on_leaving_that_fails_is_logged_not_raised(
    caplog: pytest.LogCaptureFixture,
) -> None:
    fake = FakeCredpool()
    fake.queue("release-key", error_response(500, "internal_error"))
    async with async_client(fake) as client:
        async with client.lease("openai", "gpt-4o") as lease:
            pass
        assert lease.released is None
        assert any("release" in r.getMessage() for r in caplog.records if r.levelname == "WARNING")
        # an explicit release raises (the first time)
        fake.queue("release-key", error_response(500, "internal_error"))
        async with client.lease("openai", "gpt-4o") as second:
            with pytest.raises(InternalError):
                await second.release()
            assert await second.release() is None
    assert len(fake.bodies("release-key")) == 2


def test_leaving_twice_sends_one_release_sync() -> None:
    fake = FakeCredpool()
    with sync_client(fake) as client:
        context = client.lease("openai", "gpt-4o")
        lease = context.__enter__()
        context.__exit__(None, None, None)
        context.__exit__(None, None, None)
        assert lease.release() == Released(True, None)
    assert len(fake.bodies("release-key")) == 1


async def test_leaving_twice_sends_one_release() -> None:
    fake = FakeCredpool()
    async with async_client(fake) as client:
        context = client.lease("openai", "gpt-4o")
        lease = await context.__aenter__()
        await context.__aexit__(None, None, None)
        await context.__aexit__(None, None, None)
        assert await lease.release() == Released(True, None)
        assert lease.released == Released(True, None)
    assert len(fake.bodies("release-key")) == 1


def test_releasing_a_lost_lease_never_raises_sync() -> None:
    fake = FakeCredpool()
    fake.queue("renew-lease", error_response(410, "lease_lost"))
    fake.queue("release-key", error_response(500, "internal_error"))
    with sync_client(fake, renew_fraction=0.1) as client:
        context = client.lease("openai", "gpt-4o", lease_seconds=2)
        lease = context.__enter__()
        assert lease.lost.wait(30)
        # the release fails: logged, not raised, for a lost lease
        assert lease.release() is None
        context.__exit__(None, None, None)
        error = RuntimeError("upstream broke")
        context.__exit__(RuntimeError, error, error.__traceback__)
        assert lease.release() is None
    assert len(fake.bodies("release-key")) == 1


async def test_releasing_a_lost_lease_never_raises() -> None:
    fake = FakeCredpool()
    fake.queue("renew-lease", error_response(410, "lease_lost"))
    fake.queue("release-key", error_response(500, "internal_error"))
    async with async_client(fake, renew_fraction=0.1) as client:
        context = client.lease("openai", "gpt-4o", lease_seconds=2)
        lease = await context.__aenter__()
        await asyncio.wait_for(lease.lost.wait(), 30)
        # the release fails: logged, not raised, for a lost lease
        assert await lease.release() is None
        await context.__aexit__(None, None, None)
        error = RuntimeError("upstream broke")
        await context.__aexit__(RuntimeError, error, error.__traceback__)
        assert await lease.release() is None
    assert len(fake.bodies("release-key")) == 1


async def test_leaving_a_lease_lost_with_cancel_on_loss_twice_raises_lease_lost_once() -> None:
    fake = FakeCredpool()
    fake.queue("renew-lease", error_response(410, "lease_lost"))
    async with async_client(fake, renew_fraction=0.1) as client:
        context = client.lease("openai", "gpt-4o", lease_seconds=2, cancel_on_loss=True)
        lease = await context.__aenter__()
        with pytest.raises(asyncio.CancelledError) as cancelled:
            await asyncio.sleep(30)
        assert lease.lost.is_set()
        with pytest.raises(LeaseLost):
            await context.__aexit__(asyncio.CancelledError, cancelled.value, None)
        # the second time the cancellation is not ours to take back or turn into LeaseLost
        await context.__aexit__(asyncio.CancelledError, cancelled.value, None)
        task = asyncio.current_task()
        if sys.version_info >= (3, 11) and task is not None:
            assert task.cancelling() == 0
    assert len(fake.bodies("release-key")) == 1


async def test_closing_the_client_releases_what_is_still_held() -> None:
    fake = FakeCredpool()
    client = async_client(fake)
    context = client.lease("openai", "gpt-4o")
    await context.__aenter__()
    await client.aclose()
    assert fake.bodies("release-key")[0]["outcome"] == "failure"


async def test_a_lease_nobody_holds_any_more_is_released_with_failure() -> None:
    fake = FakeCredpool()
    async with async_client(fake, renew_fraction=0.1) as client:
        await client.lease("openai", "gpt-4o", lease_seconds=2).__aenter__()
        gc.collect()
        for _ in range(200):
            if fake.bodies("release-key"):
                break
            await asyncio.sleep(0.05)
        assert fake.bodies("release-key")[0]["outcome"] == "failure"


def test_a_lease_nobody_holds_any_more_is_released_with_failure_sync() -> None:
    fake = FakeCredpool()
    released = threading.Event()
    fake.on_request = lambda route, _: released.set() if route == "release-key" else None
    with sync_client(fake, renew_fraction=0.1) as client:
        client.lease("openai", "gpt-4o", lease_seconds=2).__enter__()
        gc.collect()
        assert released.wait(30)
    assert fake.bodies("release-key")[0]["outcome"] == "failure"


# -- secrets -------------------------------------------------------------------------------


async def test_no_secret_in_repr_str_or_logs(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    fake = FakeCredpool()
    fake.queue("allocate-key", error_response(503, "store_unavailable"))
    fake.queue("renew-lease", error_response(410, "lease_lost"))
    shown: List[str] = []
    async with async_client(fake, renew_fraction=0.1) as client:
        shown.append(repr(client))
        async with client.lease("openai", "gpt-4o", lease_seconds=1) as lease:
            assert lease.credential["api_key"] == fake.secret
            shown += [repr(lease), str(lease), repr(lease.credential), str(lease.credential)]
            shown.append(f"{lease.credential}")
            await asyncio.wait_for(lease.lost.wait(), 30)
            shown += [str(lease.lost_reason), repr(lease.lost_error)]
    shown += [record.getMessage() for record in caplog.records]
    for text in shown:
        assert fake.secret not in text
        assert "ik-secret" not in text
    assert isinstance(lease.credential, dict)
    assert isinstance(lease.credential, Credential)
    assert "key-a" in repr(lease)
    assert "4711" in repr(lease)


def test_a_malformed_grant_names_the_field_never_the_value() -> None:
    for field, bad in [
        ("fence", "sk-SECRET"),
        ("lease_id", "sk-SECRET"),
        ("credential", "sk-SECRET"),
        ("lease_until", "sk-SECRET"),
        ("probe", "sk-SECRET"),
        ("lease_seconds", "sk-SECRET"),
    ]:
        fake = FakeCredpool()
        grant: Dict[str, Any] = fake.granted(**{field: bad})
        fake.queue("allocate-key", httpx.Response(200, json=grant))
        with sync_client(fake) as client:
            with pytest.raises(Exception) as raised, client.lease("openai", "gpt-4o"):  # noqa: PT011
                pass
        assert field in str(raised.value)
        assert "SECRET" not in str(raised.value) + repr(raised.value)


def test_a_grant_whose_lease_seconds_is_not_a_positive_integer_is_unexpected() -> None:
    fake = FakeCredpool()

    def answer(**override: Any) -> Answer:
        return Answer(200, json.dumps(fake.granted(**override)).encode(), request_id="rid-7")

    for bad in (0, -6, 6.5, 6.0, "6", True, None, [6], 2**32):
        with pytest.raises(UnexpectedResponse) as raised:
            parse_granted(answer(lease_seconds=bad))
        assert "field `lease_seconds`" in str(raised.value), bad
        assert raised.value.request_id == "rid-7"
    assert parse_granted(answer(lease_seconds=2**32 - 1)).lease_seconds == 2**32 - 1
    assert parse_granted(answer(lease_seconds=6)).lease_seconds == 6
    older = Answer(200, json.dumps(fake.granted_by_an_older_server()).encode())
    assert parse_granted(older).lease_seconds is None
    # through a client: raised on entering the block, as any malformed grant
    fake.queue("allocate-key", httpx.Response(200, json=fake.granted(lease_seconds=0)))
    with sync_client(fake) as client:
        with pytest.raises(UnexpectedResponse, match="lease_seconds"):
            with client.lease("openai", "gpt-4o"):
                pass
    assert fake.bodies("release-key") == []


def test_the_private_answer_and_grant_reprs_hold_no_secret() -> None:
    fake = FakeCredpool()
    answer = Answer(200, json.dumps(fake.granted()).encode(), request_id="rid-7")
    granted = parse_granted(answer)
    assert granted.credential["api_key"] == fake.secret
    assert fake.secret.encode() in answer.body
    for text in (repr(answer), str(answer), repr(granted), str(granted)):
        assert fake.secret not in text, text
        assert "api_key" not in text, text
    assert "rid-7" in repr(answer)
    assert "key-a" in repr(granted)


# -- pure helpers --------------------------------------------------------------------------


def test_rfc3339_timestamps_parse_with_any_fraction_and_offset() -> None:
    utc = timezone.utc
    assert parse_rfc3339("2026-11-29T21:15:29.52241Z") == datetime(
        2026, 11, 29, 21, 15, 29, 522410, tzinfo=utc
    )
    assert parse_rfc3339("2026-11-29T21:15:29Z") == datetime(2026, 11, 29, 21, 15, 29, tzinfo=utc)
    assert parse_rfc3339("2026-11-29T21:15:29.123456789+02:00") == datetime(
        2026, 11, 29, 21, 15, 29, 123456, tzinfo=timezone(timedelta(hours=2))
    )
    with pytest.raises(ValueError):  # noqa: PT011
        parse_rfc3339("yesterday")


def test_routes_join_onto_the_base_and_keep_its_path() -> None:
    assert join_route("http://127.0.0.1:8080", "api/x") == "http://127.0.0.1:8080/api/x"
    assert join_route("https://proxy.local/credpool/?q=1", "api/x") == (
        "https://proxy.local/credpool/api/x"
    )
    with pytest.raises(ValueError, match="http"):
        join_route("ftp://example.com", "api/x")
    with pytest.raises(ValueError, match="empty"):
        Client(BASE, internal_key="")


def test_the_renewal_schedule_is_a_third_never_under_200ms() -> None:
    assert renew_schedule(30, 1 / 3) == pytest.approx((10.0, 2.0))
    assert renew_schedule(2, 1 / 3) == pytest.approx((2 / 3, 0.2))
    assert renew_schedule(0.3, 1 / 3)[0] == 0.2
