"""The synchronous client against the real service: the same basic cases as the async one."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from typing import Iterator

import pytest

from credpool import Client, LeaseLost, PoolExhausted, PoolNotFound, Released
from harness import (
    SCHEDULING_SLACK_SECONDS,
    Admin,
    DropFirstAllocateAnswer,
    Service,
    StoredCredential,
    loss_bound,
    peak_from_trail,
    trail,
)


@pytest.fixture
def client(service: Service) -> Iterator[Client]:
    with Client(service.base_url, internal_key=service.internal_key) as client:
        yield client


def test_a_lease_carries_the_grant_and_releases_with_success(
    service: Service, provider: str, credential: StoredCredential, client: Client
) -> None:
    with client.lease(provider, "gpt-4o", holder="w1") as lease:
        assert lease.credential["api_key"] == credential.secret
        assert lease.key_id == credential.key_id
        assert lease.fence > 0
        assert lease.provider_model == "gpt-4o"
        assert lease.lease_seconds == 35  # the server's default, nothing asked for
        assert not lease.lost.is_set()
    assert lease.released == Released(True, None)
    assert trail(service.database_url, lease.key_id)[-1] == ("released", "success")


def test_16_threads_share_a_limit_2_credential_never_more_than_2_at_once(
    service: Service, admin: Admin, provider: str, client: Client
) -> None:
    key_id = f"{provider}-shared"
    admin.put_key(key_id, provider, limit=2)
    lock = threading.Lock()
    held = [0, 0]  # now, most

    def executor() -> None:
        with client.lease(provider, "gpt-4o", wait=120.0):
            with lock:
                held[0] += 1
                held[1] = max(held)
            time.sleep(0.02)
            with lock:
                held[0] -= 1

    with ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda _: executor(), range(32)))
    assert held[1] <= 2
    events = trail(service.database_url, key_id)
    assert sum(1 for event, _ in events if event == "granted") == 32
    assert peak_from_trail(service.database_url, key_id) == 2


def test_renewal_keeps_a_2s_lease_alive_for_7s(
    service: Service, provider: str, credential: StoredCredential, client: Client
) -> None:
    with client.lease(provider, "gpt-4o", lease_seconds=2) as lease:
        time.sleep(7)
        assert not lease.lost.is_set(), lease.lost_reason
    assert lease.released == Released(True, None)
    events = [event for event, _ in trail(service.database_url, lease.key_id)]
    assert events.count("renewed") >= 3
    assert "expired" not in events


def test_a_force_release_sets_lost_within_one_renewal_interval(
    admin: Admin, provider: str, credential: StoredCredential, client: Client
) -> None:
    bound = loss_bound(lease_seconds=3)
    # Counted from before the allocate, as in the async test.
    started = time.monotonic()
    with client.lease(provider, "gpt-4o", lease_seconds=3) as lease:
        assert admin.force_release(lease.lease_id)["released"] is True
        assert lease.lost.wait(bound + SCHEDULING_SLACK_SECONDS)
        took = time.monotonic() - started
        assert took <= bound, f"lost {took:.2f} s after the allocate, bound {bound:.2f} s"
        assert isinstance(lease.lost_error, LeaseLost)
        with pytest.raises(LeaseLost):
            lease.raise_if_lost()
    assert lease.released == Released(False, "not_found")


def test_an_exception_in_the_block_releases_with_failure(
    service: Service, admin: Admin, provider: str, credential: StoredCredential, client: Client
) -> None:
    with pytest.raises(ValueError, match="bad answer"), client.lease(provider, "gpt-4o"):
        raise ValueError("bad answer")
    assert admin.key(credential.key_id)["health"]["failures"] > 0
    assert trail(service.database_url, credential.key_id)[-1] == ("released", "failure")


def test_report_rate_limited_with_retry_after_rests_the_credential(
    admin: Admin, provider: str, credential: StoredCredential, client: Client
) -> None:
    with client.lease(provider, "gpt-4o", lease_seconds=5) as lease:
        lease.report("rate_limited", retry_after=30)
    key = admin.key(credential.key_id)
    assert key["status"] == "rate_limited"
    cooldown_until = datetime.fromisoformat(key["cooldown_until"].replace("Z", "+00:00"))
    assert (cooldown_until - lease.lease_until).total_seconds() > 20
    with pytest.raises(PoolExhausted) as refused, client.lease(provider, "gpt-4o"):
        pass
    assert refused.value.retry_after > 20


def test_a_lost_allocate_answer_is_retried_and_gets_the_same_lease(
    service: Service, admin: Admin, provider: str
) -> None:
    key_id = f"{provider}-a"
    admin.put_key(key_id, provider, limit=2)
    with DropFirstAllocateAnswer(service.address) as proxy:
        with Client(proxy.base_url, internal_key=service.internal_key) as client:
            with client.lease(provider, "gpt-4o") as lease:
                assert lease.lease_id == proxy.dropped[0]["lease_id"]
                assert admin.key(key_id)["in_flight"] == 1
    assert [event for event, _ in trail(service.database_url, key_id)] == ["granted", "released"]


def test_errors_are_raised_on_entering_the_block(provider: str, client: Client) -> None:
    with pytest.raises(PoolNotFound) as error, client.lease(provider, "gpt-4o"):
        pass
    assert error.value.request_id


def test_a_conversation_keeps_its_credential_while_it_has_room(
    admin: Admin, provider: str, client: Client
) -> None:
    admin.put_key(f"{provider}-a", provider, limit=2)
    admin.put_key(f"{provider}-b", provider, limit=2)
    with client.lease(provider, "gpt-4o", affinity_key="conversation-py") as first:
        assert first.affinity == "new"
    with client.lease(provider, "gpt-4o", affinity_key="conversation-py") as second:
        assert second.affinity == "hit"
        assert second.key_id == first.key_id
        # the bound credential's other slot: still a hit
        with client.lease(provider, "gpt-4o", affinity_key="conversation-py") as third:
            assert (third.affinity, third.key_id) == ("hit", first.key_id)
            # both its slots held: moved, at once, to the other credential
            with client.lease(provider, "gpt-4o", affinity_key="conversation-py") as fourth:
                assert fourth.affinity == "moved"
                assert fourth.key_id != first.key_id
    with client.lease(provider, "gpt-4o") as plain:
        assert plain.affinity is None
