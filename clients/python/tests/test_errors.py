"""Every error code maps to its class: through a fake transport for all of them (both clients),
and against the real service for those it can be made to answer."""

from __future__ import annotations

import logging
from typing import Dict, Optional, Type

import httpx
import pytest

import credpool
from credpool import (
    ApiError,
    AsyncClient,
    Client,
    CredpoolError,
    InvalidRequest,
    ModelNotSupported,
    NoUsableCredentials,
    PayloadTooLarge,
    PoolExhausted,
    PoolNotFound,
    RetryPolicy,
    RouteNotFound,
    TransportError,
    Unauthorized,
    UnexpectedResponse,
)
from harness import Admin, FakeCredpool, Service, error_response

#: The book's "Errors" (docs/src/executor-api.md): every code the API answers with, its status
#: and the class it maps to (the operator routes' and the probes' codes are mapped all the same).
CODES = [
    (400, "invalid_request", credpool.InvalidRequest),
    (401, "unauthorized", credpool.Unauthorized),
    (403, "forbidden", credpool.Forbidden),
    (404, "pool_not_found", credpool.PoolNotFound),
    (404, "credential_not_found", credpool.CredentialNotFound),
    (404, "route_not_found", credpool.RouteNotFound),
    (405, "method_not_allowed", credpool.MethodNotAllowed),
    (409, "model_not_supported", credpool.ModelNotSupported),
    (409, "no_usable_credentials", credpool.NoUsableCredentials),
    (409, "request_id_conflict", credpool.RequestIdConflict),
    (409, "tokens_exceed_budget", credpool.TokensExceedBudget),
    (410, "lease_lost", credpool.LeaseLost),
    (413, "payload_too_large", credpool.PayloadTooLarge),
    (415, "unsupported_media_type", credpool.UnsupportedMediaType),
    (429, "pool_exhausted", credpool.PoolExhausted),
    (429, "tenant_limit", credpool.TenantLimit),
    (500, "internal_error", credpool.InternalError),
    (503, "store_unavailable", credpool.StoreUnavailable),
    (403, "pool_not_allowed", credpool.PoolNotAllowed),
    (400, "token_url_not_allowed", credpool.TokenUrlNotAllowed),
    (404, "tenant_not_found", credpool.TenantNotFound),
    (404, "tenant_key_not_found", credpool.TenantKeyNotFound),
    (409, "tenant_in_use", credpool.TenantInUse),
    (409, "provider_changed", credpool.ProviderChanged),
    (412, "generation_moved", credpool.GenerationMoved),
    (503, "not_ready", credpool.NotReady),
    (503, "shutting_down", credpool.ShuttingDown),
    (404, "upstream_not_configured", credpool.UpstreamNotConfigured),
    (502, "upstream_unreachable", credpool.UpstreamUnreachable),
    (502, "credential_not_relayable", credpool.CredentialNotRelayable),
    (504, "upstream_timeout", credpool.UpstreamTimeout),
]

#: Retries give up at once, so a 503 comes back as its class instead of being retried.
NO_RETRIES = RetryPolicy(max_retries=0, max_elapsed=None)


def test_the_table_covers_every_class_the_package_maps() -> None:
    assert {code for _, code, _ in CODES} == set(credpool.errors.ERRORS_BY_CODE)


@pytest.mark.parametrize(("status", "code", "cls"), CODES)
async def test_every_code_maps_to_its_class_async(
    status: int, code: str, cls: Type[ApiError]
) -> None:
    fake = FakeCredpool()
    fake.queue(
        "allocate-key",
        error_response(
            status, code, f"says {code}", request_id="rid-7", headers={"retry-after": "9"}
        ),
    )
    async with AsyncClient(
        "http://credpool.test", internal_key="ik", retry=NO_RETRIES, transport=fake.transport()
    ) as client:
        with pytest.raises(cls) as raised:
            async with client.lease("openai", "gpt-4o"):
                pass
    check_error(raised.value, status, code, cls)


@pytest.mark.parametrize(("status", "code", "cls"), CODES)
def test_every_code_maps_to_its_class_sync(status: int, code: str, cls: Type[ApiError]) -> None:
    fake = FakeCredpool()
    fake.queue(
        "allocate-key",
        error_response(
            status, code, f"says {code}", request_id="rid-7", headers={"retry-after": "9"}
        ),
    )
    with (
        Client(
            "http://credpool.test", internal_key="ik", retry=NO_RETRIES, transport=fake.transport()
        ) as client,
        pytest.raises(cls) as raised,
        client.lease("openai", "gpt-4o"),
    ):
        pass
    check_error(raised.value, status, code, cls)


def check_error(error: ApiError, status: int, code: str, cls: Type[ApiError]) -> None:
    assert type(error) is cls
    assert isinstance(error, CredpoolError)
    assert (error.status, error.code, error.message, error.request_id) == (
        status,
        code,
        f"says {code}",
        "rid-7",
    )
    assert code in str(error)
    assert "rid-7" in str(error)
    assert code in repr(error) or cls.__name__ in repr(error)
    if isinstance(error, PoolExhausted):
        assert error.retry_after == 9.0


def test_an_unknown_code_is_a_generic_api_error() -> None:
    fake = FakeCredpool()
    fake.queue("allocate-key", error_response(418, "teapot", "short and stout"))
    with Client("http://credpool.test", internal_key="ik", transport=fake.transport()) as client:
        with pytest.raises(ApiError) as raised, client.lease("openai", "gpt-4o"):
            pass
    assert type(raised.value) is ApiError
    assert (raised.value.status, raised.value.code) == (418, "teapot")


@pytest.mark.parametrize(
    ("status", "body", "cls"),
    [
        (502, b"<html>Bad Gateway</html>", TransportError),
        (504, b"", TransportError),
        (500, b"<html>oops</html>", UnexpectedResponse),
        (400, b'{"error": {"message": "no code"}}', UnexpectedResponse),
        (200, b'{"lease_id": "x"}', UnexpectedResponse),
    ],
)
def test_answers_not_in_credpools_shape(status: int, body: bytes, cls: Type[CredpoolError]) -> None:
    fake = FakeCredpool()
    fake.queue("allocate-key", httpx.Response(status, content=body))
    with (
        Client(
            "http://credpool.test", internal_key="ik", retry=NO_RETRIES, transport=fake.transport()
        ) as client,
        pytest.raises(cls),
        client.lease("openai", "gpt-4o"),
    ):
        pass


def test_pool_exhausted_reads_retry_after_or_falls_back_to_one_second() -> None:
    retry_after: Dict[Optional[str], float] = {
        "7": 7.0,
        " 3 ": 3.0,
        "0": 1.0,
        "soon": 1.0,
        "Wed, 21 Oct 2015 07:28:00 GMT": 1.0,
        None: 1.0,
    }
    for header, expected in retry_after.items():
        fake = FakeCredpool()
        headers = {} if header is None else {"retry-after": header}
        fake.queue("allocate-key", error_response(429, "pool_exhausted", headers=headers))
        with Client("http://credpool.test", internal_key="ik", transport=fake.transport()) as c:
            with pytest.raises(PoolExhausted) as raised, c.lease("openai", "gpt-4o"):
                pass
        assert raised.value.retry_after == expected, header


def test_the_internal_key_is_scrubbed_from_server_messages(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    key = "ik-MUST-NOT-SHOW"
    fake = FakeCredpool()
    fake.queue("allocate-key", error_response(400, "invalid_request", f"bad key {key} here"))
    with Client("http://credpool.test", internal_key=key, transport=fake.transport()) as client:
        with pytest.raises(InvalidRequest) as raised, client.lease("openai", "gpt-4o"):
            pass
        assert key not in repr(client)
    assert key not in str(raised.value)
    assert key not in repr(raised.value)
    assert "<redacted>" in raised.value.message
    assert all(key not in record.getMessage() for record in caplog.records)


# -- the real service ----------------------------------------------------------------------


def error_codes_of(document: object) -> set[str]:
    """The members of the enum in ``document`` (an OpenAPI document) that lists the API's error
    codes: the schema whose ``enum`` holds ``pool_exhausted``, wherever it is."""
    found: set[str] = set()
    if isinstance(document, dict):
        members = document.get("enum")
        if isinstance(members, list) and "pool_exhausted" in members:
            found.update(str(member) for member in members)
        for value in document.values():
            found |= error_codes_of(value)
    elif isinstance(document, list):
        for value in document:
            found |= error_codes_of(value)
    return found


def test_the_client_knows_every_code_the_openapi_document_lists(service: Service) -> None:
    document = httpx.get(f"{service.base_url}/openapi.json", timeout=10).json()
    listed = error_codes_of(document)
    assert "store_unavailable" in listed, "the document lists no error codes"
    unknown = listed - set(credpool.errors.ERRORS_BY_CODE)
    assert not unknown, f"codes the server lists that the client does not know: {sorted(unknown)}"
    stale = set(credpool.errors.ERRORS_BY_CODE) - listed
    assert not stale, f"codes the client maps that the server no longer lists: {sorted(stale)}"


async def test_the_real_service_answers_map_to_their_classes(
    service: Service, admin: Admin, provider: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    admin.put_key(f"{provider}-a", provider, models=("gpt-4o",))
    admin.put_key(f"{provider}-off", provider, models=("o1",), status="disabled")

    async def raised(cls: Type[CredpoolError], client: AsyncClient, **kw: object) -> CredpoolError:
        args = {"provider": provider, "model": "gpt-4o", **kw}
        with pytest.raises(cls) as error:
            async with client.lease(**args):  # type: ignore[arg-type]
                pass
        return error.value

    async with AsyncClient(service.base_url, internal_key=service.internal_key) as client:
        errors = [
            await raised(PoolNotFound, client, pool="nowhere"),
            await raised(ModelNotSupported, client, model="gpt-2"),
            await raised(NoUsableCredentials, client, model="o1"),
            await raised(InvalidRequest, client, holder="h" * 201),
            await raised(InvalidRequest, client, lease_seconds=86_401),
            await raised(PayloadTooLarge, client, model="m" * 300_000),
        ]
        async with client.lease(provider, "gpt-4o"):
            exhausted = await raised(PoolExhausted, client)
            assert isinstance(exhausted, PoolExhausted)
            assert exhausted.retry_after >= 1
            errors.append(exhausted)
    async with AsyncClient(service.base_url, internal_key="wrong-key") as client:
        errors.append(await raised(Unauthorized, client))
    async with AsyncClient(
        service.base_url + "/not-credpool", internal_key=service.internal_key
    ) as client:
        errors.append(await raised(RouteNotFound, client))
    for error in errors:
        assert isinstance(error, ApiError)
        assert error.request_id, f"{error!r} has no X-Request-Id"
        assert service.internal_key not in str(error) + repr(error)
    assert all(service.internal_key not in r.getMessage() for r in caplog.records)


def test_a_connection_refused_is_a_transport_error_after_retries() -> None:
    policy = RetryPolicy(base_delay=0.01, max_delay=0.02, max_retries=2, max_elapsed=None)
    with Client("http://127.0.0.1:9", internal_key="ik", retry=policy) as client:
        with pytest.raises(TransportError) as raised, client.lease("openai", "gpt-4o"):
            pass
    assert raised.value.kind == "connect"
