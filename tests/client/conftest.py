"""Helpers for the worker SDK tests: workers against the live server, waits with deadlines."""

from __future__ import annotations

import sqlite3
import ssl
import subprocess
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import closing
from pathlib import Path
from typing import Any

import httpx
import pytest
from cronlease_client import Client, Worker

from apps.runs.models import Run
from tests.client.scripted import Request, Response, ScriptedServer, json_response
from tests.waiting import wait_for  # noqa: F401 - shared by this package's tests


def runs_when(ids: Iterable[int], *states: str) -> Callable[[], list[Run] | None]:
    """A predicate: the runs (in id order) once every one of them is in one of `states`."""
    ids = list(ids)

    def check() -> list[Run] | None:
        runs = list(Run.objects.filter(pk__in=ids).order_by("pk"))
        ok = len(runs) == len(ids) and all(run.state in states for run in runs)
        return runs if ok else None

    return check


def read_ledger(path: Path) -> dict[str, dict[str, Any]]:
    """The example handlers' effects, by idempotency key."""
    if not path.exists():
        return {}
    with closing(sqlite3.connect(path)) as db:
        db.row_factory = sqlite3.Row
        try:
            rows = db.execute("SELECT * FROM effects").fetchall()
        except sqlite3.OperationalError:
            return {}
    return {row["idempotency_key"]: dict(row) for row in rows}


@pytest.fixture(scope="session")
def tls_certificate(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 and its key, made by openssl."""
    folder = tmp_path_factory.mktemp("tls")
    cert, key = folder / "cert.pem", folder / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2"]
        + ["-keyout", str(key), "-out", str(cert), "-subj", "/CN=127.0.0.1"]
        + ["-addext", "subjectAltName=IP:127.0.0.1"],
        check=True,
        capture_output=True,
    )
    return cert, key


@pytest.fixture
def tls(tls_certificate: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch) -> ssl.SSLContext:
    """A server context for scripted servers over TLS, whose certificate clients trust."""
    cert, key = tls_certificate
    monkeypatch.setenv("SSL_CERT_FILE", str(cert))
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    return context


@pytest.fixture
def serve() -> Iterator[Callable[..., ScriptedServer]]:
    """Start scripted HTTP servers (tests/client/scripted.py); each is closed at teardown."""
    servers: list[ScriptedServer] = []

    def start(
        handle: Callable[[Request], Response], tls: ssl.SSLContext | None = None
    ) -> ScriptedServer:
        servers.append(ScriptedServer(handle, tls))
        return servers[-1]

    yield start
    for server in servers:
        server.close()


# The headers a forwarding proxy passes on.
FORWARDED = ("authorization", "content-type", "accept")


def forwarding(target: str, down: threading.Event) -> Callable[[Request], Response]:
    """A scripted server's handler that passes each request on to `target`, or answers 503
    while `down` is set: a web process restarting behind its load balancer."""

    def web(request: Request) -> Response:
        if down.is_set():
            return json_response(503, {"status": 503, "detail": "restarting"})
        answer = httpx.request(
            request.method,
            target + request.path,
            content=request.content,
            headers={k: v for k, v in request.headers.items() if k in FORWARDED},
            timeout=30,
        )
        return Response(answer.status_code, answer.content, {"Content-Type": "application/json"})

    return web


@pytest.fixture
def ledger(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Where the example handlers write, for this test only."""
    path = tmp_path / "ledger.sqlite3"
    monkeypatch.setenv("PLAIN_WORKER_DB", str(path))
    return path


@pytest.fixture
def make_worker(live_server, worker_token_a) -> Iterator[Callable[..., Worker]]:
    """Build (not start) workers against the live server; every one is stopped at teardown."""
    workers: list[Worker] = []

    def make(queues: list[str], **options: Any) -> Worker:
        # Short long-polls and grace so a test never waits on a quiet worker for long.
        options.setdefault("wait_seconds", 1)
        options.setdefault("grace_seconds", 5)
        token = options.pop("token", worker_token_a)
        worker = Worker(live_server.url, token, queues, **options)
        workers.append(worker)
        return worker

    yield make
    for worker in workers:
        if not worker.stop(timeout=15):
            worker.stop(force=True, timeout=5)


class CountingTransport(httpx.HTTPTransport):
    """A real HTTP transport that keeps each request's method, path and answer status."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[str, str, int]] = []

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        response = super().handle_request(request)
        self.seen.append((request.method, request.url.path, response.status_code))
        return response


@pytest.fixture
def wire() -> CountingTransport:
    """The requests of the `producer` fixture's client, as they went out."""
    return CountingTransport()


@pytest.fixture
def producer(live_server, token_a, ready_listener, wire) -> Iterator[Client]:
    """Team A's producer client against the live server, with short backoffs."""
    with Client(
        live_server.url, token_a, backoff_base=0.01, backoff_cap=0.1, http_transport=wire
    ) as client:
        yield client
