"""The relay (``/relay/{provider}/{pool}/<upstream path>``) with real clients: the OpenAI and
Anthropic SDKs and curl point their base URL at the real service and pass an executor key as
their API key; the service leases a credential and forwards each call to the mock provider
(:mod:`mock_upstream`), which counts the calls it serves at once per credential."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timedelta, timezone
from typing import Any, Callable, Dict, Iterator, List, Tuple

import httpx
import pytest

if sys.version_info < (3, 10):
    pytest.skip("the mock provider (aiohttp) needs Python 3.10+", allow_module_level=True)
# mypy --python-version 3.9 skips the rest of the file (and the mock's aiohttp) from here
assert sys.version_info >= (3, 10)

import anthropic  # noqa: E402
import openai  # noqa: E402

from credpool import Client  # noqa: E402
from harness import (  # noqa: E402
    SCHEDULING_SLACK_SECONDS,
    Admin,
    Service,
    StoredCredential,
    audit_verify,
    peak_from_trail,
    psql,
    start_service,
    stop_service,
    temp_workdir,
    trail,
)
from mock_upstream import PROMPT_TOKENS, WORDS, MockUpstream  # noqa: E402

#: What every mock answer says, and the tokens it reports using (10 prompt, 6 completion).
TEXT = "".join(WORDS)
TOKENS_PER_ANSWER = PROMPT_TOKENS + len(WORDS)
CLAUDE = "claude-sonnet-4"
MESSAGES: List[Any] = [{"role": "user", "content": "hi"}]
CHAT_PATH = "/v1/chat/completions"
MESSAGES_PATH = "/v1/messages"


@pytest.fixture
def upstream() -> Iterator[MockUpstream]:
    with MockUpstream(delay=0.2) as mock:
        yield mock


@pytest.fixture
def relayed(admin: Admin, provider: str, upstream: MockUpstream) -> str:
    """The test's provider relayed to the mock as an OpenAI-compatible upstream: the provider."""
    admin.put_upstream(provider, upstream.base_url, "openai")
    return provider


def relay_base(service: Service, provider: str) -> str:
    return f"{service.base_url}/relay/{provider}/default"


def openai_client(service: Service, provider: str, key: str, **options: Any) -> openai.OpenAI:
    """The OpenAI SDK pointed at the relay. ``max_retries=0``: a refusal reaches the test as the
    SDK raises it, not hidden behind the SDK's own retries."""
    return openai.OpenAI(
        base_url=relay_base(service, provider) + "/v1", api_key=key, max_retries=0, **options
    )


def anthropic_client(
    service: Service, provider: str, key: str, **options: Any
) -> anthropic.Anthropic:
    """The Anthropic SDK pointed at the relay (it appends ``/v1/messages``)."""
    return anthropic.Anthropic(
        base_url=relay_base(service, provider), api_key=key, max_retries=0, **options
    )


def chat(client: openai.OpenAI, stream: bool = False) -> Tuple[str, int]:
    """One chat completion of gpt-4o: its text and the tokens its answer reports."""
    if not stream:
        answer = client.chat.completions.create(model="gpt-4o", messages=MESSAGES, max_tokens=64)
        assert answer.usage is not None
        return answer.choices[0].message.content or "", answer.usage.total_tokens
    text, tokens = "", 0
    for chunk in client.chat.completions.create(
        model="gpt-4o",
        messages=MESSAGES,
        max_tokens=64,
        stream=True,
        stream_options={"include_usage": True},
    ):
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
        if chunk.usage is not None:
            tokens = chunk.usage.total_tokens
    return text, tokens


def message(client: anthropic.Anthropic, stream: bool = False) -> Tuple[str, int]:
    """One Anthropic message of claude-sonnet-4: its text and the tokens its answer reports."""
    if not stream:
        answer = client.messages.create(model=CLAUDE, max_tokens=64, messages=MESSAGES)
        block = answer.content[0]
        assert block.type == "text"
        return block.text, answer.usage.input_tokens + answer.usage.output_tokens
    with client.messages.stream(model=CLAUDE, max_tokens=64, messages=MESSAGES) as events:
        text = "".join(events.text_stream)
        usage = events.get_final_message().usage
    return text, usage.input_tokens + usage.output_tokens


def until(what: str, check: Callable[[], bool], seconds: float = 10.0) -> float:
    """Waits (bounded) for ``check``; fails naming ``what``. Returns the seconds it took."""
    started = time.monotonic()
    deadline = started + seconds + SCHEDULING_SLACK_SECONDS
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)
    return time.monotonic() - started


def in_flight(admin: Admin, key_id: str) -> int:
    count: int = admin.key(key_id)["in_flight"]
    return count


def releases(service: Service, key_id: str) -> List[Tuple[str, str, int, str]]:
    """``(holder, outcome, tokens, tenant)`` of each release of ``key_id`` in the trail, oldest
    first; an absent outcome is ``""``, absent tokens ``-1``."""
    out = psql(
        service.database_url,
        "SELECT concat_ws('|', holder, coalesce(outcome, ''), coalesce(tokens, -1), "
        f"coalesce(tenant, '')) FROM lease_events WHERE key_id = '{key_id}' "
        "AND event = 'released' ORDER BY event_id",
    )
    rows = []
    for line in out.splitlines():
        holder, outcome, tokens, tenant = line.split("|")
        rows.append((holder, outcome, int(tokens), tenant))
    return rows


def relay_calls(service: Service, provider: str, outcome: str) -> int:
    """``credpool_relay_calls_total`` of ``provider``'s default pool with ``outcome``, from
    ``/metrics`` (0 when absent)."""
    text = httpx.get(service.base_url + "/metrics", timeout=30).text
    for line in text.splitlines():
        if (
            line.startswith("credpool_relay_calls_total{")
            and f'provider="{provider}"' in line
            and 'pool="default"' in line
            and f'outcome="{outcome}"' in line
        ):
            return int(float(line.rsplit(" ", 1)[1]))
    return 0


def test_sixty_sdk_calls_through_two_replicas_never_put_more_on_a_credential_than_its_limit(
    service: Service, admin: Admin, provider: str, upstream: MockUpstream
) -> None:
    # one OpenAI-compatible provider and one Anthropic one, each with two limit-2 credentials
    openai_provider, anthropic_provider = provider + "-oa", provider + "-an"
    secrets = {}
    for relayed, api, model in [
        (openai_provider, "openai", "gpt-4o"),
        (anthropic_provider, "anthropic", CLAUDE),
    ]:
        # 30 callers on 4 slots: the last ones wait several rounds of calls on a loaded machine
        admin.put_upstream(relayed, upstream.base_url, api, wait_ms=30_000)
        for name in ("a", "b"):
            key_id = f"{relayed}-{name}"
            secrets[key_id] = f"sk-{key_id}"
            admin.put_key(
                key_id, relayed, models=(model,), limit=2, secret={"api_key": secrets[key_id]}
            )
    replica = start_service(service.database_url, temp_workdir(), like=service)
    try:
        replicas = [service, replica]

        def call(n: int) -> Tuple[str, int]:
            on = replicas[n % 2]
            stream = n % 3 == 0
            if n % 4 < 2:
                with openai_client(on, openai_provider, on.internal_key) as client:
                    return chat(client, stream)
            with anthropic_client(on, anthropic_provider, on.internal_key) as other:
                return message(other, stream)

        with ThreadPoolExecutor(max_workers=60) as pool:
            answers = list(pool.map(call, range(60)))
    finally:
        stop_service(replica)
    # every call was answered in full, none refused for want of a credential
    assert answers == [(TEXT, TOKENS_PER_ANSWER)] * 60
    # only leased credentials reached the provider, each at most 2 at once, and at 2: the load
    # kept every slot busy
    assert sum(upstream.served.values()) == 60
    assert set(upstream.served) == set(secrets.values())
    assert {upstream.peak[secret] for secret in secrets.values()} == {2}
    for key_id in secrets:
        assert peak_from_trail(service.database_url, key_id) == 2
        assert "expired" not in [event for event, _ in trail(service.database_url, key_id)]
        assert in_flight(admin, key_id) == 0
    audit_verify(service)


def test_a_streamed_answer_reaches_the_client_chunk_by_chunk(
    service: Service, credential: StoredCredential, relayed: str, upstream: MockUpstream
) -> None:
    upstream.chunk_delay = 0.4
    arrivals: List[float] = []
    text = ""
    with openai_client(service, relayed, service.internal_key) as client:
        started = time.monotonic()
        for chunk in client.chat.completions.create(model="gpt-4o", messages=MESSAGES, stream=True):
            if chunk.choices and chunk.choices[0].delta.content:
                text += chunk.choices[0].delta.content
                arrivals.append(time.monotonic() - started)
    assert text == TEXT
    # six chunks 0.4 s apart upstream: the first reached the client in the first half of the
    # stream, and the last ones came as the upstream sent them, not all at once at its end
    assert len(arrivals) == len(WORDS)
    assert arrivals[0] < arrivals[-1] / 2
    assert arrivals[-1] - arrivals[0] > 1.5
    assert upstream.served[credential.secret] == 1


def test_openai_sdk_streams_read_to_done_free_their_slot_for_the_next_call(
    service: Service,
    admin: Admin,
    credential: StoredCredential,
    relayed: str,
    upstream: MockUpstream,
) -> None:
    key_id, secret = credential
    # the OpenAI SDK closes its connection once it has read `data: [DONE]`, while the relay is
    # still reading the upstream's end and releasing: ten calls in a row on one slot, each
    # waiting at most 5 s, all find it free (a release lost to the close holds it 35 s)
    with openai_client(
        service, relayed, service.internal_key, default_headers={"X-Credpool-Wait-Ms": "5000"}
    ) as client:
        for _ in range(10):
            text = "".join(
                chunk.choices[0].delta.content or ""
                for chunk in client.chat.completions.create(
                    model="gpt-4o", messages=MESSAGES, stream=True
                )
                if chunk.choices
            )
            assert text == TEXT
    assert upstream.served[secret] == 10
    until("the last release", lambda: in_flight(admin, key_id) == 0, seconds=1.0)
    events = [event for event, _ in trail(service.database_url, key_id)]
    assert events == ["granted", "released"] * 10


def test_a_client_that_disconnects_mid_stream_leaves_no_live_lease(
    service: Service,
    admin: Admin,
    credential: StoredCredential,
    relayed: str,
    upstream: MockUpstream,
) -> None:
    key_id, secret = credential
    upstream.chunk_delay = 1.0  # a 6 s stream
    with openai_client(service, relayed, service.internal_key) as client:
        stream = client.chat.completions.create(model="gpt-4o", messages=MESSAGES, stream=True)
        next(iter(stream))
        assert in_flight(admin, key_id) == 1
        stream.close()  # the client goes away after its first chunk
    # released within a second (the stream had 5 s to run), with no outcome: neither the
    # provider's failure nor left to expire; and the provider's stream saw its client go
    gone = until("the lease's release", lambda: in_flight(admin, key_id) == 0, seconds=1.0)
    assert gone < 1.0
    assert trail(service.database_url, key_id)[-1] == ("released", None)
    until("the upstream stream's end", lambda: upstream.abandoned[secret] == 1, seconds=1.0)
    assert upstream.serving() == {}
    assert relay_calls(service, relayed, "client_closed") == 1
    # the one slot is free for the next caller at once
    upstream.chunk_delay = 0.02
    with openai_client(
        service, relayed, service.internal_key, default_headers={"X-Credpool-Wait-Ms": "0"}
    ) as client:
        assert chat(client, stream=True) == (TEXT, TOKENS_PER_ANSWER)


def test_a_client_that_gives_up_waiting_is_granted_nothing_and_sends_nothing(
    service: Service,
    admin: Admin,
    provider: str,
    credential: StoredCredential,
    relayed: str,
    upstream: MockUpstream,
) -> None:
    key_id = credential.key_id
    with Client(service.base_url, internal_key=service.internal_key) as credpool:
        with credpool.lease(provider, "gpt-4o"):
            # the relay would wait 10 s for the one slot; the client's timeout ends it in 1 s
            with openai_client(service, relayed, service.internal_key, timeout=1.0) as client:
                with pytest.raises(openai.APITimeoutError):
                    chat(client)
        # the slot freed after the client left: no lease is granted to the departed call
        time.sleep(1.0)
        assert in_flight(admin, key_id) == 0
    assert upstream.received == {}
    assert trail(service.database_url, key_id) == [("granted", None), ("released", "success")]


def test_an_upstream_429_reaches_the_client_and_rests_the_credential(
    service: Service,
    admin: Admin,
    provider: str,
    credential: StoredCredential,
    relayed: str,
    upstream: MockUpstream,
) -> None:
    key_id, secret = credential
    upstream.rate_limit(secret, retry_after="30")
    with openai_client(service, relayed, service.internal_key) as client:
        with pytest.raises(openai.RateLimitError) as limited:
            chat(client)
    # the provider's own answer, with its Retry-After
    assert limited.value.response.headers["retry-after"] == "30"
    assert limited.value.code == "rate_limit_exceeded"
    assert limited.value.message.endswith("Rate limit reached")
    assert trail(service.database_url, key_id)[-1] == ("released", "rate_limited")
    key = admin.key(key_id)
    assert key["status"] == "rate_limited"
    cooldown_until = datetime.fromisoformat(key["cooldown_until"].replace("Z", "+00:00"))
    assert cooldown_until - datetime.now(timezone.utc) > timedelta(seconds=20)
    assert upstream.received[CHAT_PATH] == 1
    # resting, the credential is not sent again: a call that will not wait is credpool's 429
    with openai_client(
        service, relayed, service.internal_key, default_headers={"X-Credpool-Wait-Ms": "0"}
    ) as client:
        with pytest.raises(openai.RateLimitError) as exhausted:
            chat(client)
    assert exhausted.value.code == "pool_exhausted"
    assert int(exhausted.value.response.headers["retry-after"]) >= 1
    assert upstream.received[CHAT_PATH] == 1
    # a second credential takes the next calls, while the first rests
    other = f"{provider}-b"
    admin.put_key(other, provider, secret={"api_key": f"sk-{other}"})
    with openai_client(service, relayed, service.internal_key) as client:
        assert [chat(client) for _ in range(3)] == [(TEXT, TOKENS_PER_ANSWER)] * 3
    assert upstream.served == {f"sk-{other}": 3}
    assert upstream.received[CHAT_PATH] == 4


def test_usage_lands_in_the_trail_with_the_relays_holder(
    service: Service, admin: Admin, provider: str, upstream: MockUpstream
) -> None:
    openai_key, anthropic_key = f"{provider}-oa", f"{provider}-an"
    anthropic_provider = provider + "-an"
    admin.put_upstream(provider, upstream.base_url, "openai")
    admin.put_upstream(anthropic_provider, upstream.base_url, "anthropic")
    admin.put_key(openai_key, provider)
    admin.put_key(anthropic_key, anthropic_provider, models=(CLAUDE,))
    tenant = provider + "-tenant"
    tenant_key = admin.tenant_key(tenant, {})
    with openai_client(service, provider, service.internal_key) as client:
        assert chat(client) == (TEXT, TOKENS_PER_ANSWER)
        # released before the client saw the answer's end: the trail has it already
        assert releases(service, openai_key) == [("relay", "success", 16, "default")]
    with anthropic_client(
        service, anthropic_provider, tenant_key, default_headers={"X-Credpool-Holder": "agent-7"}
    ) as other:
        assert message(other, stream=True) == (TEXT, TOKENS_PER_ANSWER)
    # the stream's usage: 10 input tokens in message_start, 6 output tokens in message_delta
    assert releases(service, anthropic_key) == [("relay:agent-7", "success", 10 + 6, tenant)]
    assert relay_calls(service, provider, "success") == 1
    assert relay_calls(service, anthropic_provider, "success") == 1


def test_refusals_come_in_the_clients_api_shape_and_reach_no_upstream(
    service: Service,
    admin: Admin,
    provider: str,
    credential: StoredCredential,
    relayed: str,
    upstream: MockUpstream,
) -> None:
    key = service.internal_key
    # an unconfigured provider, in either SDK
    with openai_client(service, provider + "-none", key) as client:
        with pytest.raises(openai.NotFoundError) as not_found:
            chat(client)
    assert not_found.value.code == "upstream_not_configured"
    with anthropic_client(service, provider + "-none", key) as other:
        with pytest.raises(anthropic.NotFoundError) as not_found_too:
            message(other)
    assert not_found_too.value.body == {
        "type": "error",
        "error": {
            "type": "not_found_error",
            "message": "no relay upstream is configured for this provider",
            "code": "upstream_not_configured",
        },
    }
    # no key, a wrong key
    missing = httpx.post(
        relay_base(service, relayed) + CHAT_PATH,
        json={"model": "gpt-4o", "messages": MESSAGES},
        timeout=30,
    )
    assert missing.status_code == 401
    assert missing.json()["error"]["code"] == "unauthorized"
    assert missing.json()["error"]["type"] == "authentication_error"
    with openai_client(service, relayed, "sk-not-a-credpool-key") as client:
        with pytest.raises(openai.AuthenticationError) as wrong:
            chat(client)
    assert wrong.value.code == "unauthorized"
    with anthropic_client(service, relayed, "cpk_" + "0" * 64) as other:
        with pytest.raises(anthropic.AuthenticationError) as unknown:
            message(other)
    assert isinstance(unknown.value.body, dict)
    assert unknown.value.body["error"]["type"] == "authentication_error"
    # a tenant key serves until it is revoked
    tenant = provider + "-tenant"
    admin.tenant_key(tenant, {})
    tenant_key_id, tenant_key = admin.mint_tenant_key(tenant)
    with openai_client(service, relayed, tenant_key) as client:
        assert chat(client) == (TEXT, TOKENS_PER_ANSWER)
        admin.revoke_tenant_key(tenant, tenant_key_id)
        with pytest.raises(openai.AuthenticationError):
            chat(client)
    assert upstream.received == {CHAT_PATH: 1}
    # no credential free within the wait: credpool's 429, which either SDK reads as a rate limit
    anthropic_provider = provider + "-an"
    admin.put_upstream(anthropic_provider, upstream.base_url, "anthropic")
    admin.put_key(anthropic_provider + "-a", anthropic_provider, models=(CLAUDE,))
    with (
        Client(service.base_url, internal_key=key) as credpool,
        credpool.lease(relayed, "gpt-4o"),
        credpool.lease(anthropic_provider, CLAUDE),
    ):
        with openai_client(
            service, relayed, key, default_headers={"X-Credpool-Wait-Ms": "100"}
        ) as client:
            with pytest.raises(openai.RateLimitError) as exhausted:
                chat(client)
        with anthropic_client(
            service, anthropic_provider, key, default_headers={"X-Credpool-Wait-Ms": "0"}
        ) as other:
            with pytest.raises(anthropic.RateLimitError) as exhausted_too:
                message(other)
    assert exhausted.value.code == "pool_exhausted"
    assert int(exhausted.value.response.headers["retry-after"]) >= 1
    assert isinstance(exhausted_too.value.body, dict)
    assert exhausted_too.value.body["error"]["type"] == "rate_limit_error"
    assert exhausted_too.value.body["error"]["code"] == "pool_exhausted"
    assert upstream.received == {CHAT_PATH: 1}
    assert upstream.served == {credential.secret: 1}


def curl(*args: str) -> Tuple[int, Dict[str, Any]]:
    """``curl`` with ``args``: the answer's status and JSON body."""
    done = subprocess.run(
        ["curl", "--silent", "--show-error", "--write-out", "\n%{http_code}", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    body, _, status = done.stdout.rpartition("\n")
    return int(status), json.loads(body)


@pytest.mark.parametrize(
    "forged",
    [
        "//evil.example.com/v1/chat/completions",
        "/v1/../../api/admin/keys",
        "/v1/%2e%2e/chat/completions",
        "/v1%2fchat%2fcompletions",
        "/v1/chat/completions/..",
    ],
)
def test_a_forged_path_is_refused_before_anything_is_leased_or_sent(
    service: Service,
    credential: StoredCredential,
    relayed: str,
    upstream: MockUpstream,
    forged: str,
) -> None:
    status, body = curl(
        "--path-as-is",
        "-H",
        f"Authorization: Bearer {service.internal_key}",
        "-H",
        "Content-Type: application/json",
        "-d",
        json.dumps({"model": "gpt-4o", "messages": MESSAGES}),
        relay_base(service, relayed) + forged,
    )
    assert status == 400
    assert body["error"]["code"] == "invalid_request"
    assert upstream.received == {}
    assert trail(service.database_url, credential.key_id) == []


def test_curl_is_a_relay_client_too(
    service: Service, credential: StoredCredential, relayed: str, upstream: MockUpstream
) -> None:
    status, answer = curl(
        "-H",
        f"Authorization: Bearer {service.internal_key}",
        "-H",
        "Content-Type: application/json",
        "-d",
        json.dumps({"model": "gpt-4o", "messages": MESSAGES, "max_tokens": 64}),
        relay_base(service, relayed) + CHAT_PATH,
    )
    assert status == 200
    assert answer["choices"][0]["message"]["content"] == TEXT
    assert answer["usage"]["total_tokens"] == TOKENS_PER_ANSWER
    # the mock saw the leased credential, never the executor key
    assert upstream.served == {credential.secret: 1}
    assert releases(service, credential.key_id) == [("relay", "success", 16, "default")]
