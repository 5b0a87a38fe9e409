"""Token estimates, reported usage and the refusals they lead to, against the real service: a
credential's token window, a tenant's cap, an estimate no window can hold."""

from __future__ import annotations

import pytest

from credpool import Client, PoolExhausted, TenantLimit, TokensExceedBudget
from harness import Admin, Service, trail


def test_tokens_reserve_a_window_and_usage_at_release_gives_the_rest_back(
    service: Service, admin: Admin, provider: str
) -> None:
    key_id = f"{provider}-a"
    admin.put_key(key_id, provider, limit=4, rate_limits=[{"tokens": 1000, "seconds": 600}])
    with Client(service.base_url, internal_key=service.internal_key) as client:
        with client.lease(provider, "gpt-4o", tokens=600) as lease:
            # 600 of the window's 1000 reserved: 800 more do not fit, with a slot free
            with (
                pytest.raises(PoolExhausted) as refused,
                client.lease(provider, "gpt-4o", tokens=800),
            ):
                pass
            assert not isinstance(refused.value, TenantLimit)
            assert refused.value.retry_after > 1
            lease.report("success", usage_tokens=100)
        # the release reported 100 used: 500 came back, and 800 fit now
        with client.lease(provider, "gpt-4o", tokens=800):
            pass
    assert [event for event, _ in trail(service.database_url, key_id)] == [
        "granted",
        "released",
        "granted",
        "released",
    ]


def test_an_estimate_larger_than_every_window_is_tokens_exceed_budget(
    service: Service, admin: Admin, provider: str
) -> None:
    admin.put_key(f"{provider}-a", provider, limit=4, rate_limits=[{"tokens": 1000, "seconds": 60}])
    with Client(service.base_url, internal_key=service.internal_key) as client:
        with pytest.raises(TokensExceedBudget), client.lease(provider, "gpt-4o", tokens=1001):
            pass
        # nothing was reserved by the refusal: the whole window is still there
        with client.lease(provider, "gpt-4o", tokens=1000):
            pass


def test_a_tenant_at_its_cap_gets_tenant_limit_while_the_pool_has_room(
    service: Service, admin: Admin, provider: str
) -> None:
    admin.put_key(f"{provider}-a", provider, limit=4)
    tenant_key = admin.tenant_key(f"{provider}-team", {"max_concurrent_leases": 1})
    with Client(service.base_url, internal_key=tenant_key) as client:
        with client.lease(provider, "gpt-4o"):
            with pytest.raises(TenantLimit) as refused, client.lease(provider, "gpt-4o"):
                pass
            assert refused.value.retry_after >= 1
            # the pool has room: another tenant (the internal key's) is served meanwhile
            with Client(service.base_url, internal_key=service.internal_key) as other:
                with other.lease(provider, "gpt-4o"):
                    pass
        # its lease released, the tenant is under its cap again
        with client.lease(provider, "gpt-4o"):
            pass
