"""The async client against the real service."""

from __future__ import annotations

import asyncio
import logging
import re
import time
from datetime import datetime, timezone
from typing import AsyncIterator

import pytest

from credpool import AsyncClient, LeaseLost, PoolExhausted, Released
from harness import (
    SCHEDULING_SLACK_SECONDS,
    Admin,
    DropFirstAllocateAnswer,
    Service,
    StoredCredential,
    audit_verify,
    loss_bound,
    peak_from_trail,
    trail,
)


@pytest.fixture
async def client(service: Service) -> AsyncIterator[AsyncClient]:
    async with AsyncClient(service.base_url, internal_key=service.internal_key) as client:
        yield client


async def test_a_lease_carries_the_grant_and_releases_with_success(
    service: Service, admin: Admin, provider: str, client: AsyncClient
) -> None:
    admin.put_key(
        f"{provider}-a", provider, models=("gpt-4o-2024-08-06",), secret={"api_key": "sk-one"}
    )
    # an alias resolves to the provider's model name
    admin._http.patch(
        f"/keys/{provider}-a", json={"aliases": {"gpt-4o": "gpt-4o-2024-08-06"}}
    ).raise_for_status()
    async with client.lease(provider, "gpt-4o", holder="worker-7", lease_seconds=30) as lease:
        assert lease.credential["api_key"] == "sk-one"
        assert lease.key_id == f"{provider}-a"
        assert re.fullmatch(r"[0-9a-f]{32}", lease.lease_id)
        assert lease.fence > 0
        assert (lease.provider, lease.pool) == (provider, "default")
        assert lease.provider_model == "gpt-4o-2024-08-06"
        assert lease.probe is False
        assert lease.lease_seconds == 30
        assert lease.lease_until > datetime.now(timezone.utc)
        assert not lease.lost.is_set()
        assert admin.key(lease.key_id)["leases"][0]["holder"] == "worker-7"
    assert lease.released == Released(True, None)
    key = admin.key(f"{provider}-a")
    assert key["in_flight"] == 0
    assert key["health"]["successes"] > 0
    assert trail(service.database_url, lease.key_id)[-1] == ("released", "success")


async def test_64_tasks_share_a_limit_2_credential_never_more_than_2_at_once(
    service: Service, admin: Admin, provider: str, client: AsyncClient
) -> None:
    key_id = f"{provider}-shared"
    admin.put_key(key_id, provider, limit=2)
    held = 0
    most_held = 0
    served = 0

    async def executor(n: int) -> None:
        nonlocal held, most_held, served
        async with client.lease(provider, "gpt-4o", holder=f"task-{n}", wait=120.0) as lease:
            held += 1
            most_held = max(most_held, held)
            await asyncio.sleep(0.02)
            held -= 1
            assert not lease.lost.is_set()
        served += 1

    await asyncio.gather(*(executor(n) for n in range(64)))
    assert served == 64
    assert most_held <= 2
    # The trail is the proof: it counts what the server granted, not what the client saw.
    events = trail(service.database_url, key_id)
    assert sum(1 for event, _ in events if event == "granted") == 64
    assert sum(1 for event, _ in events if event == "released") == 64
    assert peak_from_trail(service.database_url, key_id) == 2
    verified = {row["key_id"]: row for row in audit_verify(service)["credentials"]}
    assert verified[key_id]["peak"] == 2
    assert verified[key_id]["grants_over_limit"] == 0


async def test_renewal_keeps_a_2s_lease_alive_for_7s(
    service: Service, admin: Admin, provider: str, credential: StoredCredential, client: AsyncClient
) -> None:
    async with client.lease(provider, "gpt-4o", lease_seconds=2) as lease:
        first_until = lease.lease_until
        await asyncio.sleep(7)
        assert not lease.lost.is_set(), lease.lost_reason
        assert lease.lease_until > first_until
        assert admin.key(lease.key_id)["in_flight"] == 1
    # The server still held it: released, not expired.
    assert lease.released == Released(True, None)
    events = [event for event, _ in trail(service.database_url, lease.key_id)]
    # every 2/3 s for 7 s is ten renewals; three leave a wide margin for a slow machine
    assert events.count("renewed") >= 3
    assert "expired" not in events


async def test_a_force_release_sets_lost_within_one_renewal_interval(
    admin: Admin, provider: str, credential: StoredCredential, client: AsyncClient
) -> None:
    bound = loss_bound(lease_seconds=3)
    # Counted from before the allocate, as the client's renewal clock is: the first renewal
    # after the force release (at most one interval after the grant) reports the loss.
    started = time.monotonic()
    async with client.lease(provider, "gpt-4o", lease_seconds=3) as lease:
        assert admin.force_release(lease.lease_id)["released"] is True
        await asyncio.wait_for(lease.lost.wait(), bound + SCHEDULING_SLACK_SECONDS)
        took = time.monotonic() - started
        assert took <= bound, f"lost {took:.2f} s after the allocate, bound {bound:.2f} s"
        assert isinstance(lease.lost_error, LeaseLost)
        assert lease.lost_error.status == 410
        assert lease.lost_reason is not None
        assert "410" in lease.lost_reason
        with pytest.raises(LeaseLost):
            lease.raise_if_lost()
    # leaving the block of a lost lease does not raise; the server says why nothing freed
    assert lease.released == Released(False, "not_found")
    assert await lease.release() == Released(False, "not_found")


async def test_cancel_on_loss_ends_the_block_with_lease_lost(
    admin: Admin, provider: str, credential: StoredCredential, client: AsyncClient
) -> None:
    reached_the_end = False
    with pytest.raises(LeaseLost):
        async with client.lease(provider, "gpt-4o", lease_seconds=3, cancel_on_loss=True) as lease:
            admin.force_release(lease.lease_id)
            await asyncio.sleep(1 + SCHEDULING_SLACK_SECONDS)
            reached_the_end = True
    assert not reached_the_end
    assert lease.lost.is_set()
    # the task is not left cancelled: it goes on
    await asyncio.sleep(0)


async def test_an_exception_in_the_block_releases_with_failure(
    service: Service, admin: Admin, provider: str, credential: StoredCredential, client: AsyncClient
) -> None:
    with pytest.raises(RuntimeError, match="upstream broke"):
        async with client.lease(provider, "gpt-4o"):
            raise RuntimeError("upstream broke")
    key = admin.key(credential.key_id)
    assert key["health"]["failures"] > 0
    assert key["in_flight"] == 0
    assert trail(service.database_url, credential.key_id)[-1] == ("released", "failure")


async def test_report_rate_limited_with_retry_after_rests_the_credential(
    service: Service, admin: Admin, provider: str, credential: StoredCredential, client: AsyncClient
) -> None:
    async with client.lease(provider, "gpt-4o", lease_seconds=5) as lease:
        lease.report("rate_limited", retry_after=30)
    key = admin.key(credential.key_id)
    assert key["status"] == "rate_limited"
    cooldown_until = datetime.fromisoformat(key["cooldown_until"].replace("Z", "+00:00"))
    # the lease ran to grant + 5 s; the rest runs to release + 30 s (both on the DB clock)
    assert (cooldown_until - lease.lease_until).total_seconds() > 20
    assert trail(service.database_url, credential.key_id)[-1] == ("released", "rate_limited")
    with pytest.raises(PoolExhausted) as refused:
        async with client.lease(provider, "gpt-4o"):
            pass
    assert refused.value.retry_after > 20


async def test_a_lost_allocate_answer_is_retried_and_gets_the_same_lease(
    service: Service, admin: Admin, provider: str
) -> None:
    key_id = f"{provider}-a"
    admin.put_key(key_id, provider, limit=2)
    with DropFirstAllocateAnswer(service.address) as proxy:
        async with AsyncClient(proxy.base_url, internal_key=service.internal_key) as client:
            async with client.lease(provider, "gpt-4o") as lease:
                assert len(proxy.dropped) == 1
                assert proxy.allocates == 2
                lost_answer = proxy.dropped[0]
                assert (lease.lease_id, lease.fence) == (
                    lost_answer["lease_id"],
                    lost_answer["fence"],
                )
                assert admin.key(key_id)["in_flight"] == 1
    events = [event for event, _ in trail(service.database_url, key_id)]
    assert events == ["granted", "released"]


async def test_an_early_release_is_the_only_one(
    service: Service, admin: Admin, provider: str, credential: StoredCredential, client: AsyncClient
) -> None:
    async with client.lease(provider, "gpt-4o") as lease:
        assert await lease.release() == Released(True, None)
        assert admin.key(credential.key_id)["in_flight"] == 0
        assert await lease.release("failure") == Released(True, None)
    assert lease.released == Released(True, None)
    assert trail(service.database_url, credential.key_id) == [
        ("granted", None),
        ("released", "success"),
    ]


async def test_no_secret_or_key_in_logs_or_reprs_against_the_real_service(
    service: Service,
    admin: Admin,
    provider: str,
    client: AsyncClient,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)  # httpx and httpcore log every request at DEBUG
    # importing litellm (tests/test_litellm.py, in the same session) sets httpx's logger to
    # WARNING; this test needs httpx's request lines
    caplog.set_level(logging.DEBUG, logger="httpx")
    secret = "sk-REAL-SECRET-" + provider
    admin.put_key(f"{provider}-a", provider, secret={"api_key": secret, "org": "o-1"})
    shown = [repr(client)]
    async with client.lease(provider, "gpt-4o", lease_seconds=2) as lease:
        assert lease.credential["api_key"] == secret
        shown += [repr(lease), str(lease.credential), repr(lease.credential)]
        await asyncio.sleep(1)  # a renewal
        admin.force_release(lease.lease_id)
        await asyncio.wait_for(lease.lost.wait(), 1 + SCHEDULING_SLACK_SECONDS)
        shown += [str(lease.lost_reason), repr(lease.lost_error), str(lease.lost_error)]
    shown += [record.getMessage() for record in caplog.records]
    assert any("renew-lease" in text for text in shown), "httpx logged no renewal"
    for text in shown:
        assert secret not in text
        assert service.internal_key not in text
