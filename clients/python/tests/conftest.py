"""Fixtures: one real credpool service (and its database) per test session; a fresh provider
name per test, so that tests never see each other's credentials."""

from __future__ import annotations

import os
import secrets
import shutil
from typing import Iterator, List

import pytest

# LiteLLM fetches its model price map from the internet when imported unless told to use the
# copy it ships; the tests reach nothing but 127.0.0.1.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

from harness import (
    DEFAULT_DATABASE_URL,
    Admin,
    Service,
    StoredCredential,
    psql,
    start_service,
    stop_service,
    temp_workdir,
    with_database,
)


def pytest_collection_modifyitems(items: List[pytest.Item]) -> None:
    """Marks every test that uses the real service (directly or through ``admin``) with
    ``service``, so that ``pytest -m "not service"`` runs the offline tests alone: no binary, no
    database."""
    for item in items:
        if "service" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.service)


@pytest.fixture(scope="session")
def service() -> Iterator[Service]:
    """``credpool serve`` on a free port, on a database created for this session (dropped
    afterwards) on the server of ``DATABASE_URL``."""
    server_url = os.environ.get("DATABASE_URL", DEFAULT_DATABASE_URL)
    name = f"credpool_py_{os.getpid()}_{secrets.token_hex(4)}"
    maintenance = with_database(server_url, "postgres")
    psql(maintenance, f"CREATE DATABASE {name}")
    workdir = temp_workdir()
    running = None
    try:
        running = start_service(with_database(server_url, name), workdir)
        yield running
    finally:
        if running is not None:
            stop_service(running)
        psql(maintenance, f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
        shutil.rmtree(workdir, ignore_errors=True)


@pytest.fixture
def admin(service: Service) -> Iterator[Admin]:
    client = Admin(service)
    yield client
    client.close()


@pytest.fixture
def provider() -> str:
    """A provider name no other test uses."""
    return "py-" + secrets.token_hex(5)


@pytest.fixture
def credential(admin: Admin, provider: str) -> StoredCredential:
    """One credential of ``provider``, ``{provider}-a``: one slot, serving gpt-4o, holding the
    API key ``sk-{provider}-a``."""
    stored = StoredCredential(f"{provider}-a", f"sk-{provider}-a")
    admin.put_key(stored.key_id, provider, secret={"api_key": stored.secret})
    return stored
