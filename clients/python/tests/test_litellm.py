"""The LiteLLM integration (:mod:`credpool.integrations.litellm`) with the real litellm package,
against the real service and a mock provider of the test's own on 127.0.0.1
(:mod:`mock_upstream`), which counts the requests it serves at once per key."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import subprocess
import sys
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any, AsyncIterator, Callable, Iterator, List

import httpx
import pytest

litellm = pytest.importorskip("litellm")

from credpool import AsyncClient, PoolExhausted  # noqa: E402
from credpool.integrations.litellm import CredpoolLeases  # noqa: E402
from harness import (  # noqa: E402
    SCHEDULING_SLACK_SECONDS,
    Admin,
    Service,
    StoredCredential,
    peak_from_trail,
    psql,
    trail,
)
from mock_upstream import MockUpstream  # noqa: E402

MESSAGES = [{"role": "user", "content": "hi"}]
#: The mock's usage figures for every answer: 10 prompt and 6 completion tokens.
TOKENS_PER_ANSWER = 16


@pytest.fixture
def upstream() -> Iterator[MockUpstream]:
    with MockUpstream(delay=0.2) as mock:
        yield mock


@contextlib.asynccontextmanager
async def installed(callback: CredpoolLeases) -> AsyncIterator[CredpoolLeases]:
    """``callback`` as LiteLLM's only one for the block; closed (its releases awaited) after."""
    saved = litellm.callbacks
    litellm.callbacks = [callback]
    try:
        yield callback
    finally:
        await callback.aclose()
        litellm.callbacks = saved


@pytest.fixture
async def leases(service: Service, provider: str) -> AsyncIterator[CredpoolLeases]:
    """The callback for the test's provider, installed."""
    callback = CredpoolLeases(
        service.base_url, internal_key=service.internal_key, provider=provider, wait=60.0
    )
    async with installed(callback):
        yield callback


async def completion(upstream: MockUpstream, **kwargs: Any) -> Any:
    """``litellm.acompletion`` of openai/gpt-4o at the mock. ``max_retries=0``: the OpenAI SDK
    would otherwise retry a 429 on the same key, inside one lease."""
    return await litellm.acompletion(
        model="openai/gpt-4o",
        messages=MESSAGES,
        api_base=upstream.base_url + "/v1",
        max_retries=0,
        **kwargs,
    )


async def until(what: str, check: Callable[[], bool], seconds: float = 10.0) -> None:
    """Waits (bounded) for ``check``; fails naming ``what``."""
    deadline = time.monotonic() + seconds + SCHEDULING_SLACK_SECONDS
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


def nothing_leased(admin: Admin, *key_ids: str) -> bool:
    return all(admin.key(key_id)["in_flight"] == 0 for key_id in key_ids)


def released_tokens(service: Service, key_id: str) -> List[int]:
    """``lease_events.tokens`` of each release of ``key_id``, oldest first."""
    out = psql(
        service.database_url,
        f"SELECT coalesce(tokens, -1) FROM lease_events WHERE key_id = '{key_id}' "
        "AND event = 'released' ORDER BY event_id",
    )
    return [int(line) for line in out.splitlines()]


def test_two_litellm_processes_never_put_more_calls_on_a_credential_than_its_limit(
    service: Service, admin: Admin, provider: str, upstream: MockUpstream
) -> None:
    keys = {f"{provider}-a": f"sk-a-{provider}", f"{provider}-b": f"sk-b-{provider}"}
    for key_id, secret in keys.items():
        admin.put_key(key_id, provider, limit=2, secret={"api_key": secret})
    calls = 12
    env = dict(
        os.environ,
        CREDPOOL_URL=service.base_url,
        CREDPOOL_INTERNAL_KEY=service.internal_key,
        UPSTREAM=upstream.base_url,
        PROVIDER=provider,
        CALLS=str(calls),
    )
    worker = Path(__file__).with_name("litellm_worker.py")
    processes = [
        subprocess.Popen(
            [sys.executable, str(worker)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        for _ in range(2)
    ]
    results = []
    for process in processes:
        out, err = process.communicate(timeout=300)
        assert process.returncode == 0, err.decode(errors="replace")[-3000:]
        results.append(json.loads(out.decode().strip().splitlines()[-1]))
    # every call was answered, each with the mock's usage, streamed (every other) or not
    assert results == [{"answered": calls, "tokens": calls * TOKENS_PER_ANSWER}] * 2
    # only leased keys reached the provider, each never more often at once than its limit:
    # 24 callers on 4 slots keep both credentials at their limit
    assert set(upstream.served) == set(keys.values())
    assert {upstream.peak[secret] for secret in keys.values()} == {2}
    for key_id in keys:
        assert peak_from_trail(service.database_url, key_id) == 2
        events = [event for event, _ in trail(service.database_url, key_id)]
        assert "expired" not in events
    granted = sum(
        [event for event, _ in trail(service.database_url, k)].count("granted") for k in keys
    )
    assert granted == 2 * calls
    assert nothing_leased(admin, *keys)


async def test_streamed_and_unstreamed_calls_report_their_usage_at_release(
    service: Service,
    admin: Admin,
    provider: str,
    upstream: MockUpstream,
    leases: CredpoolLeases,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG, logger="credpool")
    key_id, secret = f"{provider}-a", f"sk-SECRET-{provider}"
    admin.put_key(key_id, provider, limit=1, secret={"api_key": secret})
    answer = await completion(upstream)
    assert answer.choices[0].message.content == "Hello from the mock upstream."
    stream = await completion(upstream, stream=True, stream_options={"include_usage": True})
    text = "".join(
        [chunk.choices[0].delta.content or "" async for chunk in stream if chunk.choices]
    )
    assert text == "Hello from the mock upstream."
    # the leased key made both calls, and each release carried the answer's usage
    assert upstream.served[secret] == 2
    await until("both releases", lambda: nothing_leased(admin, key_id))
    assert released_tokens(service, key_id) == [TOKENS_PER_ANSWER, TOKENS_PER_ANSWER]
    assert trail(service.database_url, key_id)[-1] == ("released", "success")
    shown = [repr(leases)] + [record.getMessage() for record in caplog.records]
    assert any("leased key_id" in line for line in shown)
    for line in shown:
        assert secret not in line
        assert service.internal_key not in line


@pytest.mark.usefixtures("leases")
async def test_a_429_with_retry_after_rests_the_credential(
    service: Service, admin: Admin, credential: StoredCredential, upstream: MockUpstream
) -> None:
    key_id, secret = credential
    upstream.rate_limit(secret, retry_after="30")
    with pytest.raises(litellm.RateLimitError):
        await completion(upstream)
    key = admin.key(key_id)
    assert key["status"] == "rate_limited"
    cooldown_until = datetime.fromisoformat(key["cooldown_until"].replace("Z", "+00:00"))
    # the rest runs the provider's 30 s from the release (the DB clock is this machine's)
    assert cooldown_until - datetime.now(timezone.utc) > timedelta(seconds=20)
    assert trail(service.database_url, key_id)[-1] == ("released", "rate_limited")
    assert nothing_leased(admin, key_id)


@pytest.mark.usefixtures("leases")
async def test_a_401_on_an_oauth_credential_reports_auth_expired_and_the_refreshed_token_serves(
    service: Service, admin: Admin, provider: str, upstream: MockUpstream
) -> None:
    key_id = f"{provider}-oauth"
    expires_at = (datetime.now(timezone.utc) + timedelta(hours=1)).isoformat()
    admin.put_key(
        key_id,
        provider,
        limit=1,
        secret={"access_token": "at-0", "refresh_token": "rt-0", "expires_at": expires_at},
        oauth={
            "token_url": upstream.base_url + "/token",
            "client_id": "client-1",
            "refresh_before_seconds": 0,
        },
    )
    upstream.reject("at-0")
    with pytest.raises(litellm.AuthenticationError):
        await completion(upstream)
    assert trail(service.database_url, key_id)[-1] == ("released", "auth_expired")
    rejected = psql(
        service.database_url,
        f"SELECT count(*) FROM credential_events WHERE key_id = '{key_id}' "
        "AND event = 'token_rejected'",
    )
    assert rejected == "1"
    # the rejected token leaves traffic; the next call waits for the refresh and uses its token
    answer = await completion(upstream)
    assert answer.usage.total_tokens == TOKENS_PER_ANSWER
    assert upstream.served["at-1"] == 1
    assert admin.key(key_id)["status"] == "available"
    await until("the release", lambda: nothing_leased(admin, key_id))


@pytest.mark.usefixtures("leases")
async def test_a_consumer_that_abandons_a_stream_leaves_no_live_lease(
    service: Service, admin: Admin, credential: StoredCredential, upstream: MockUpstream
) -> None:
    key_id = credential.key_id
    upstream.chunk_delay = 0.5

    async def read_one_chunk_and_stop() -> None:
        stream = await completion(upstream, stream=True)
        async for _ in stream:
            break  # the consumer stops reading and drops the stream

    await read_one_chunk_and_stop()
    # released (not left to expire: the lease is 35 s, renewed) with no fault of the provider's
    await until("the abandoned stream's release", lambda: nothing_leased(admin, key_id))
    assert trail(service.database_url, key_id)[-1] == ("released", "success")

    async def read_until_cancelled() -> None:
        stream = await completion(upstream, stream=True)
        async for _ in stream:
            await asyncio.sleep(0.1)

    reader = asyncio.ensure_future(read_until_cancelled())
    await until("the second stream's lease", lambda: admin.key(key_id)["in_flight"] == 1)
    reader.cancel()
    with pytest.raises(asyncio.CancelledError):
        await reader
    await until("the cancelled stream's release", lambda: nothing_leased(admin, key_id))
    events = trail(service.database_url, key_id)
    assert events[-1] == ("released", "success")
    assert ("expired", None) not in events


@pytest.mark.usefixtures("leases")
async def test_a_stream_the_provider_cuts_is_released_with_failure(
    service: Service, admin: Admin, credential: StoredCredential, upstream: MockUpstream
) -> None:
    key_id, secret = credential
    upstream.cut(secret)
    stream = await completion(upstream, stream=True)
    with pytest.raises(Exception):  # noqa: B017, PT011 - LiteLLM's class for a dropped stream varies
        async for _ in stream:
            pass
    await until("the release", lambda: nothing_leased(admin, key_id))
    assert trail(service.database_url, key_id)[-1] == ("released", "failure")
    del stream  # referenced up to here: the failure event released it, not collection


async def test_a_long_call_keeps_its_lease_renewed(
    service: Service, provider: str, credential: StoredCredential
) -> None:
    key_id = credential.key_id
    callback = CredpoolLeases(
        service.base_url, internal_key=service.internal_key, provider=provider, lease_seconds=2
    )
    async with installed(callback):
        with MockUpstream(delay=5.0) as slow:
            answer = await completion(slow, timeout=60)
    assert answer.usage.total_tokens == TOKENS_PER_ANSWER
    events = [event for event, _ in trail(service.database_url, key_id)]
    # a 2 s lease held for 5 s: renewed (every 2/3 s), then released, never expired
    assert events.count("renewed") >= 2
    assert events[-1] == "released"
    assert "expired" not in events
    assert released_tokens(service, key_id) == [TOKENS_PER_ANSWER]


class SlowReleases(httpx.AsyncBaseTransport):
    """Sends requests to credpool, holding each release for half a second first; ``started`` is
    set when a release arrives."""

    def __init__(self) -> None:
        self._inner = httpx.AsyncHTTPTransport()
        self.started = asyncio.Event()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/release-key"):
            self.started.set()
            await asyncio.sleep(0.5)
        return await self._inner.handle_async_request(request)

    async def aclose(self) -> None:
        await self._inner.aclose()


async def test_a_release_in_flight_survives_the_callers_cancellation(
    service: Service,
    admin: Admin,
    provider: str,
    credential: StoredCredential,
    upstream: MockUpstream,
) -> None:
    key_id, secret = credential
    upstream.rate_limit(secret, retry_after="30")
    transport = SlowReleases()
    callback = CredpoolLeases(
        service.base_url, internal_key=service.internal_key, provider=provider, transport=transport
    )
    async with installed(callback):
        caller = asyncio.ensure_future(completion(upstream))
        await asyncio.wait_for(transport.started.wait(), 30)
        # the caller's own timeout fires while its failure hook waits for the release
        caller.cancel()
        with pytest.raises(asyncio.CancelledError):
            await caller
        await until("the release", lambda: nothing_leased(admin, key_id), seconds=5)
        assert trail(service.database_url, key_id)[-1] == ("released", "rate_limited")


async def test_the_proxy_stream_hook_releases_when_the_client_goes_away(
    service: Service,
    admin: Admin,
    credential: StoredCredential,
    upstream: MockUpstream,
    leases: CredpoolLeases,
) -> None:
    key_id = credential.key_id
    upstream.chunk_delay = 0.5
    router = litellm.Router(
        model_list=[
            {
                "model_name": "gpt-4o",
                "litellm_params": {
                    "model": "openai/gpt-4o",
                    "api_base": upstream.base_url + "/v1",
                    "api_key": "sk-deployment-key-unused",
                },
            }
        ]
    )
    stream = await router.acompletion(model="gpt-4o", messages=MESSAGES, stream=True)
    # what the Proxy sends its client: the stream through every callback's iterator hook
    sent = leases.async_post_call_streaming_iterator_hook(None, stream, {})  # type: ignore[arg-type]
    await sent.__anext__()
    assert admin.key(key_id)["in_flight"] == 1
    # the client disconnects: the Proxy closes the generator (the stream object lives on)
    await sent.aclose()
    await until("the release", lambda: nothing_leased(admin, key_id), seconds=5)
    assert trail(service.database_url, key_id)[-1] == ("released", "success")
    del stream  # referenced up to here: the hook released it, not collection


def test_a_synchronous_call_is_not_leased_and_says_so(
    upstream: MockUpstream, caplog: pytest.LogCaptureFixture
) -> None:
    callback = CredpoolLeases("http://127.0.0.1:9", internal_key="ik-unused")
    saved = litellm.callbacks
    litellm.callbacks = [callback]
    try:
        answer = litellm.completion(
            model="openai/gpt-4o",
            messages=MESSAGES,
            api_base=upstream.base_url + "/v1",
            api_key="sk-own-key",
        )
    finally:
        litellm.callbacks = saved
    assert answer.usage.total_tokens == TOKENS_PER_ANSWER
    assert upstream.served["sk-own-key"] == 1
    warnings = [r.getMessage() for r in caplog.records if r.name == "credpool"]
    assert any("synchronous completion calls are not leased" in w for w in warnings)


async def test_a_call_that_finds_every_slot_taken_raises_pool_exhausted_and_sends_nothing(
    service: Service, provider: str, credential: StoredCredential, upstream: MockUpstream
) -> None:
    key_id, secret = credential
    callback = CredpoolLeases(
        service.base_url, internal_key=service.internal_key, provider=provider, wait=0
    )
    async with (
        installed(callback),
        AsyncClient(service.base_url, internal_key=service.internal_key) as other,
        other.lease(provider, "gpt-4o"),
    ):
        with pytest.raises(PoolExhausted) as refused:
            await completion(upstream)
    assert refused.value.retry_after >= 1
    assert upstream.served[secret] == 0
    assert [event for event, _ in trail(service.database_url, key_id)] == ["granted", "released"]
