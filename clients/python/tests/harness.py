"""Test support: the real credpool service on a fresh database, its operator API, the audit
trail in SQL, a proxy that loses an answer, and a fake credpool for what the real one cannot be
made to say.

The service is the built binary (``CREDPOOL_BIN``, default ``target/debug/credpool`` at the
repository root; built with ``cargo build`` when missing), started with ``credpool serve
--listen 127.0.0.1:0`` against a database created for the test session on the PostgreSQL server
of ``DATABASE_URL`` (default ``postgres://postgres@127.0.0.1:5432/test``); ``serve`` applies the
migrations at start-up. SQL goes through ``psql``.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import secrets
import shutil
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import (
    Any,
    Awaitable,
    Callable,
    Dict,
    List,
    NamedTuple,
    Optional,
    Tuple,
    TypeVar,
    Union,
)
from urllib.parse import urlsplit, urlunsplit

import httpx

REPO_ROOT = Path(__file__).resolve().parents[3]
DEFAULT_DATABASE_URL = "postgres://postgres@127.0.0.1:5432/test"

#: Added to waits that must only not hang (the timeout around waiting for ``lost``, a sleep the
#: loss must cut short), so that a loaded 2-core CI machine (PostgreSQL, the service and the test
#: share it) does not fail them. Where a test promises a time, it asserts a tighter bound of its
#: own (``LOSS_SLACK_SECONDS``).
SCHEDULING_SLACK_SECONDS = 10.0

#: The slack on "a force release sets ``lost`` within one renewal interval". The tests count the
#: bound from before the allocate, as the client's renewal clock does, so the slack covers only
#: the renewal's round trip and scheduling on a loaded machine: with a 1 s interval the bound is
#: 3 s, which a client that renews every 3 s (or renews by some other length) misses.
LOSS_SLACK_SECONDS = 2.0


def loss_bound(lease_seconds: float) -> float:
    """Seconds from before the allocate within which a force release must set ``lost`` on a
    lease of ``lease_seconds``: one renewal interval (a third of the lease, the clients' default
    ``renew_fraction``) and ``LOSS_SLACK_SECONDS``."""
    return lease_seconds / 3 + LOSS_SLACK_SECONDS


#: How long the service may take to start (migrations on a fresh database, a loaded machine).
START_TIMEOUT_SECONDS = 120.0


def credpool_bin() -> Path:
    """The credpool binary: ``CREDPOOL_BIN``, else ``target/debug/credpool`` (built if missing)."""
    configured = os.environ.get("CREDPOOL_BIN")
    path = Path(configured) if configured else REPO_ROOT / "target" / "debug" / "credpool"
    if not path.is_absolute():
        path = REPO_ROOT / path
    if not path.exists():
        if configured:
            raise RuntimeError(f"CREDPOOL_BIN={configured} does not exist")
        if shutil.which("cargo") is None:
            raise RuntimeError(f"{path} is missing and cargo is not on PATH to build it")
        subprocess.run(["cargo", "build", "--bin", "credpool"], cwd=REPO_ROOT, check=True)
    return path


def with_database(url: str, name: str) -> str:
    """``url`` naming database ``name`` instead of its own."""
    parts = urlsplit(url)
    return urlunsplit((parts.scheme, parts.netloc, "/" + name, parts.query, parts.fragment))


def psql(url: str, sql: str) -> str:
    """Runs ``sql`` with psql on ``url``; returns its unaligned, tuples-only output."""
    if shutil.which("psql") is None:
        raise RuntimeError("the tests need psql (apt-get install postgresql-client)")
    done = subprocess.run(
        ["psql", url, "-X", "-q", "-t", "-A", "-v", "ON_ERROR_STOP=1", "-c", sql],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"psql failed: {done.stderr.strip()}")
    return done.stdout.strip()


@dataclass
class Service:
    """A running ``credpool serve`` and the database it owns."""

    base_url: str
    internal_key: str
    admin_key: str
    database_url: str
    binary: Path
    log_path: Path
    process: subprocess.Popen[bytes]
    address: Tuple[str, int] = ("127.0.0.1", 0)
    #: The key its secrets are sealed with: a replica on the same database needs the same one.
    master_key: str = ""

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])


def start_service(database_url: str, workdir: Path, *, like: Optional[Service] = None) -> Service:
    """Starts ``credpool serve`` on a free port against ``database_url`` (already created): with
    keys of its own, or a replica of ``like`` (its internal, admin and master keys)."""
    binary = credpool_bin()
    internal_key = like.internal_key if like else "ik-" + secrets.token_hex(16)
    admin_key = like.admin_key if like else "ak-" + secrets.token_hex(16)
    master_key = like.master_key if like else secrets.token_hex(32)
    log_path = workdir / "credpool-serve.log"
    env = dict(os.environ)
    env.update(
        DATABASE_URL=database_url,
        CREDPOOL_LISTEN="127.0.0.1:0",
        # Keys go by environment, not argv, so they are not in the process list.
        CREDPOOL_INTERNAL_KEY=internal_key,
        CREDPOOL_ADMIN_KEY=admin_key,
        CREDPOOL_MASTER_KEY=master_key,
        CREDPOOL_DATA_DIR=str(workdir / "data"),
        RUST_LOG=os.environ.get("CREDPOOL_TEST_RUST_LOG", "credpool=info,warn"),
    )
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [str(binary), "serve"], stdout=log, stderr=subprocess.STDOUT, env=env
        )
    deadline = time.monotonic() + START_TIMEOUT_SECONDS
    listening = re.compile(r"credpool listening on (http://(\S+):(\d+))")
    while True:
        match = listening.search(log_path.read_text(errors="replace"))
        if match:
            break
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise RuntimeError(
                "credpool serve did not start:\n" + log_path.read_text(errors="replace")[-4000:]
            )
        time.sleep(0.05)
    return Service(
        base_url=match.group(1),
        internal_key=internal_key,
        admin_key=admin_key,
        database_url=database_url,
        binary=binary,
        log_path=log_path,
        process=process,
        address=(match.group(2), int(match.group(3))),
        master_key=master_key,
    )


def stop_service(service: Service) -> None:
    service.process.terminate()
    try:
        service.process.wait(timeout=20)
    except subprocess.TimeoutExpired:
        service.process.kill()
        service.process.wait()


class Admin:
    """The operator API, for setting up credentials and reading their state."""

    def __init__(self, service: Service) -> None:
        self._http = httpx.Client(
            base_url=service.base_url + "/api/admin",
            headers={"x-admin-key": service.admin_key, "x-operator": "pytest"},
            timeout=30.0,
        )

    def close(self) -> None:
        self._http.close()

    def _ok(self, response: httpx.Response) -> Any:
        if response.status_code >= 300:
            raise AssertionError(f"{response.request.url}: {response.status_code} {response.text}")
        return response.json()

    def put_key(
        self,
        key_id: str,
        provider: str,
        *,
        models: Tuple[str, ...] = ("gpt-4o",),
        limit: int = 1,
        pool: str = "default",
        status: Optional[str] = None,
        secret: Optional[Dict[str, Any]] = None,
        oauth: Optional[Dict[str, Any]] = None,
        rate_limits: Optional[List[Dict[str, int]]] = None,
    ) -> Any:
        body: Dict[str, Any] = {
            "provider": provider,
            "pool": pool,
            "models": list(models),
            "max_concurrent_uses": limit,
            "secret": secret if secret is not None else {"api_key": f"sk-{key_id}"},
        }
        if status is not None:
            body["status"] = status
        if oauth is not None:
            body["oauth"] = oauth
        if rate_limits is not None:
            body["rate_limits"] = rate_limits
        return self._ok(self._http.put(f"/keys/{key_id}", json=body))

    def tenant_key(self, tenant_id: str, settings: Dict[str, Any]) -> str:
        """PUTs tenant ``tenant_id`` with ``settings`` (leasing from every pool) and mints a key
        for it: the key."""
        self._ok(self._http.put(f"/tenants/{tenant_id}", json={"pools": ["*/*"], **settings}))
        key: str = self._ok(self._http.post(f"/tenants/{tenant_id}/keys"))["key"]
        return key

    def key(self, key_id: str) -> Any:
        return self._ok(self._http.get(f"/keys/{key_id}"))

    def put_upstream(self, provider: str, base_url: str, api: str, **settings: Any) -> Any:
        """Sets ``provider``'s relay upstream: ``base_url``, ``api`` (``openai`` or
        ``anthropic``) and any other field of the body (``wait_ms``, ``timeout_seconds``, ...)."""
        body = {"base_url": base_url, "api": api, **settings}
        return self._ok(self._http.put(f"/relay/upstreams/{provider}", json=body))

    def mint_tenant_key(self, tenant_id: str) -> Tuple[str, str]:
        """A new executor key of tenant ``tenant_id`` (which exists): its id and the key."""
        minted = self._ok(self._http.post(f"/tenants/{tenant_id}/keys"))
        return minted["key_id"], minted["key"]

    def revoke_tenant_key(self, tenant_id: str, key_id: str) -> Any:
        return self._ok(self._http.delete(f"/tenants/{tenant_id}/keys/{key_id}"))

    def force_release(self, lease_id: str, reason: str = "test") -> Any:
        return self._ok(self._http.post(f"/leases/{lease_id}/release", json={"reason": reason}))


class StoredCredential(NamedTuple):
    """A credential a test stored: its key id and the API key it holds."""

    key_id: str
    secret: str


def peak_from_trail(database_url: str, key_id: str) -> int:
    """The most leases ``key_id`` ever held at once, from the audit trail alone: the book's "How a
    lease is claimed", the peak-concurrency query, for one credential."""
    key = key_id.replace("'", "''")
    sql = f"""
WITH spans AS (
    SELECT lease_id, key_id,
           min(at) FILTER (WHERE event = 'granted') AS started,
           coalesce(min(at) FILTER (WHERE event = 'released'),
                    max(lease_until) FILTER (WHERE event IN ('granted', 'renewed'))) AS ended
    FROM lease_events WHERE key_id = '{key}' GROUP BY lease_id, key_id),
edges AS (SELECT key_id, started AS at, 1 AS delta FROM spans
          UNION ALL SELECT key_id, ended, -1 FROM spans)
SELECT coalesce(max(held), 0) FROM (
    SELECT key_id, sum(delta) OVER (PARTITION BY key_id ORDER BY at, delta) AS held FROM edges) r
"""
    return int(psql(database_url, sql))


def trail(database_url: str, key_id: str) -> List[Tuple[str, Optional[str]]]:
    """``(event, outcome)`` of every lease event of ``key_id``, oldest first."""
    key = key_id.replace("'", "''")
    out = psql(
        database_url,
        f"SELECT event || '|' || coalesce(outcome::text, '') FROM lease_events "
        f"WHERE key_id = '{key}' ORDER BY event_id",
    )
    rows = []
    for line in out.splitlines():
        event, _, outcome = line.partition("|")
        rows.append((event, outcome or None))
    return rows


def audit_verify(service: Service) -> Dict[str, Any]:
    """``credpool audit verify --json`` over the last day (exits non-zero on any oversell)."""
    env = dict(os.environ, DATABASE_URL=service.database_url)
    done = subprocess.run(
        [str(service.binary), "audit", "verify", "--json"],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    if done.returncode != 0:
        raise AssertionError(f"credpool audit verify failed:\n{done.stdout}\n{done.stderr}")
    result: Dict[str, Any] = json.loads(done.stdout)
    return result


Served = TypeVar("Served", bound="ServedInThread")


class ServedInThread:
    """A server on 127.0.0.1 on an event loop of its own in a daemon thread, so that sync and
    async tests (and other processes) reach it alike. A context manager: entering starts it and
    waits (30 s at most) until it listens, on ``port`` (``base_url``); leaving stops it.
    Subclasses start listening in :meth:`_listen`."""

    def __init__(self, name: str, port: int = 0) -> None:
        self.port = port
        self._name = name
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._stop: Optional[asyncio.Event] = None
        self._thread = threading.Thread(target=self._run, daemon=True, name=name)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def _listen(self) -> Tuple[int, Callable[[], Awaitable[None]]]:
        """Starts serving (on ``self.port``, 0 for any); returns the port it listens on and what
        stops it."""
        raise NotImplementedError

    def __enter__(self: Served) -> Served:
        self._thread.start()
        if not self._ready.wait(30):
            raise RuntimeError(f"the {self._name} did not start")
        return self

    def __exit__(self, *exc: object) -> None:
        if self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(30)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_until_complete(self._serve_until_stopped())
        self._loop.close()

    async def _serve_until_stopped(self) -> None:
        self._stop = asyncio.Event()
        self.port, close = await self._listen()
        self._ready.set()
        await self._stop.wait()
        await close()


class DropFirstAllocateAnswer(ServedInThread):
    """An HTTP-aware TCP proxy, served in a thread of its own (so both clients can use it), that
    forwards every request to the service and every answer back, except the answer to the first
    allocate: that one it reads from the service and then drops, closing the client's connection
    without a byte, as a network failure after the grant would.

    Each request goes to the service on a fresh connection; answers carry ``Content-Length``
    (credpool's JSON answers do)."""

    def __init__(self, upstream: Tuple[str, int]) -> None:
        super().__init__("proxy")
        self._upstream = upstream
        self.dropped: List[Dict[str, Any]] = []
        self.allocates = 0

    async def _listen(self) -> Tuple[int, Callable[[], Awaitable[None]]]:
        server = await asyncio.start_server(self._serve, "127.0.0.1", self.port)

        async def close() -> None:
            server.close()
            await server.wait_closed()

        return server.sockets[0].getsockname()[1], close

    @staticmethod
    async def _read_message(reader: asyncio.StreamReader) -> Tuple[bytes, bytes]:
        head = await reader.readuntil(b"\r\n\r\n")
        match = re.search(rb"(?im)^content-length:\s*(\d+)\s*$", head)
        body = await reader.readexactly(int(match.group(1))) if match else b""
        return head, body

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                try:
                    head, body = await self._read_message(reader)
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                up_reader, up_writer = await asyncio.open_connection(*self._upstream)
                up_writer.write(head + body)
                await up_writer.drain()
                answer_head, answer_body = await self._read_message(up_reader)
                up_writer.close()
                request_line = head.split(b"\r\n", 1)[0]
                if b"/api/internal/allocate-key" in request_line:
                    self.allocates += 1
                    if not self.dropped:
                        self.dropped.append(json.loads(answer_body))
                        return  # the answer is lost: close without a byte
                writer.write(answer_head + answer_body)
                await writer.drain()
        finally:
            writer.close()


# -- a fake credpool ----------------------------------------------------------------------

Reply = Union[httpx.Response, Exception]


@dataclass
class FakeCredpool:
    """A scripted credpool behind ``httpx.MockTransport`` (for both clients). Each route answers
    from its queue of replies (an ``httpx.Response``, or an exception to raise as a transport
    error); an empty queue answers the route's default. Every request is recorded, with the
    ``time.monotonic()`` it came at."""

    replies: Dict[str, List[Reply]] = field(default_factory=dict)
    requests: List[Tuple[str, Dict[str, Any], httpx.Headers]] = field(default_factory=list)
    arrivals: List[Tuple[str, float]] = field(default_factory=list)
    secret: str = "sk-FAKE-SECRET"
    on_request: Optional[Callable[[str, Dict[str, Any]], None]] = None

    def transport(self) -> httpx.MockTransport:
        return httpx.MockTransport(self._handle)

    def queue(self, route: str, *replies: Reply) -> None:
        self.replies.setdefault(route, []).extend(replies)

    def bodies(self, route: str) -> List[Dict[str, Any]]:
        return [body for r, body, _ in self.requests if r == route]

    def times(self, route: str) -> List[float]:
        """When each request to ``route`` came (``time.monotonic()``), oldest first."""
        return [at for r, at in self.arrivals if r == route]

    def granted(self, **override: Any) -> Dict[str, Any]:
        grant = {
            "key_id": "key-a",
            "lease_id": "0123456789abcdef0123456789abcdef",
            "provider": "openai",
            "pool": "default",
            "provider_model": "gpt-4o-2024-08-06",
            "lease_until": "2030-01-01T00:00:35.123456Z",
            "probe": False,
            "fence": 4711,
            "lease_seconds": 35,
            "credential": {"api_key": self.secret},
        }
        grant.update(override)
        return grant

    def granted_by_an_older_server(self, **override: Any) -> Dict[str, Any]:
        """A grant as servers before the answer's ``lease_seconds`` gave it."""
        grant = self.granted(**override)
        del grant["lease_seconds"]
        return grant

    def _handle(self, request: httpx.Request) -> httpx.Response:
        route = request.url.path.rsplit("/", 1)[-1]
        body = json.loads(request.content) if request.content else {}
        self.requests.append((route, body, request.headers))
        self.arrivals.append((route, time.monotonic()))
        if self.on_request is not None:
            self.on_request(route, body)
        queue = self.replies.get(route) or []
        if queue:
            reply = queue.pop(0)
            if isinstance(reply, Exception):
                raise reply
            return reply
        if route == "allocate-key":
            # As today's server: granted for the length asked for, else its default, and says so.
            return httpx.Response(
                200, json=self.granted(lease_seconds=body.get("lease_seconds", 35))
            )
        if route == "renew-lease":
            return httpx.Response(200, json={"lease_until": "2030-01-01T00:01:10Z"})
        if route == "release-key":
            return httpx.Response(200, json={"released": True})
        return error_response(404, "route_not_found", "no such route")


def error_response(
    status: int,
    code: str,
    message: str = "m",
    *,
    request_id: str = "req-1",
    headers: Optional[Dict[str, str]] = None,
) -> httpx.Response:
    """An answer in credpool's error shape, with an ``X-Request-Id``."""
    all_headers = {"x-request-id": request_id, **(headers or {})}
    return httpx.Response(
        status, json={"error": {"code": code, "message": message}}, headers=all_headers
    )


def temp_workdir() -> Path:
    return Path(tempfile.mkdtemp(prefix="credpool-py-tests-"))
