"""Real parts for the notification tests: an HTTP receiver and an SMTP server on local ports,
the README's signature check, and short intervals."""

from __future__ import annotations

import re
import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from aiosmtpd.controller import Controller

from apps.notify import detect
from apps.notify.loop import Notifier

# The browser test's fixtures: a team admin, the live ASGI server and headless Chromium.
from tests.dashboard.conftest import admin_a  # noqa: F401

README = Path(__file__).resolve().parents[2] / "README.md"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def readme_verifier():
    """`verify_signature` from README's verification snippet, run as a receiver would run it."""
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    (snippet,) = [block for block in blocks if "def verify_signature" in block]
    scope: dict = {}
    exec(snippet, scope)  # noqa: S102 - the documented code itself is under test
    return scope["verify_signature"]


@dataclass
class Received:
    path: str
    headers: dict[str, str]
    body: bytes


@dataclass
class Receiver:
    """An HTTP server that records every POST and answers the next of `answers` (else 200)."""

    url: str = ""
    requests: list[Received] = field(default_factory=list)
    answers: list[int] = field(default_factory=list)
    refusal: bytes = b"receiver says no"  # the body of an answer other than 2xx
    lock: threading.Lock = field(default_factory=threading.Lock)

    def answer(self) -> int:
        with self.lock:
            return self.answers.pop(0) if self.answers else 200


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    box = Receiver()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            with box.lock:
                box.requests.append(Received(self.path, dict(self.headers.items()), body))
            status = box.answer()
            payload = b'{"ok": true}' if status < 300 else box.refusal
            self.send_response(status)
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    box.url = f"http://127.0.0.1:{server.server_address[1]}/hooks/cronlease"
    # A short poll: shutting the server down waits for it.
    thread = threading.Thread(target=server.serve_forever, args=(0.02,), daemon=True)
    thread.start()
    yield box
    server.shutdown()
    server.server_close()


class Inbox:
    """aiosmtpd's handler: keeps every message it accepts."""

    def __init__(self) -> None:
        self.envelopes = []

    async def handle_DATA(self, server, session, envelope) -> str:  # noqa: N802 - aiosmtpd's name
        self.envelopes.append(envelope)
        return "250 Message accepted for delivery"


@pytest.fixture
def smtp(settings) -> Iterator[Inbox]:
    """A real SMTP server on a local port, and Django's SMTP backend pointed at it."""
    inbox = Inbox()
    port = free_port()
    controller = Controller(inbox, hostname="127.0.0.1", port=port)
    controller.start()
    settings.EMAIL_BACKEND = "django.core.mail.backends.smtp.EmailBackend"
    settings.EMAIL_HOST = "127.0.0.1"
    settings.EMAIL_PORT = port
    settings.EMAIL_USE_TLS = False
    settings.DEFAULT_FROM_EMAIL = "cronlease@example.test"
    yield inbox
    controller.stop()


@pytest.fixture(autouse=True)
def notify_settings(settings, monkeypatch) -> None:
    """Local receivers allowed, retries at once, no reminders or recovery unless a test asks,
    and dead runs read as soon as they are written."""
    settings.SCHEDULER_NOTIFY_ALLOW_PRIVATE_TARGETS = True
    settings.SCHEDULER_NOTIFY_BACKOFF_SECONDS = 0
    settings.SCHEDULER_NOTIFY_TIMEOUT_SECONDS = 5
    settings.SCHEDULER_NOTIFY_REMINDER_SECONDS = 0
    settings.SCHEDULER_NOTIFY_RECOVERY_SECONDS = 3600
    settings.SCHEDULER_PUBLIC_URL = "https://cronlease.example.test"
    # The people of these tests sign in by session: their passwords need no slow hash.
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
    monkeypatch.setattr(detect, "SETTLE_SECONDS", 0.0)


@pytest.fixture
def notifier() -> Notifier:
    return Notifier()


def drain(notifier: Notifier) -> int:
    """Send every due delivery; return how many were tried."""
    sent = 0
    while notifier.handle_one_delivery():
        sent += 1
    return sent


# --- runs and channels ------------------------------------------------------------------------


def die(definition, prefix: str = "d") -> None:
    """One run of the definition leased and failed for good: dead, as the fail path leaves it."""
    from tests.dashboard.conftest import failed_runs

    failed_runs(definition, 1, prefix=prefix)


def succeed(definition, prefix: str = "s") -> None:
    """One run of the definition leased and completed."""
    from apps.runs import store
    from tests.conftest import add_ready_runs, claim

    add_ready_runs(definition, 1, prefix=prefix)
    (lease,) = claim(
        queues=[definition.queue], max_runs=1, worker_id="w", team_ids=[definition.team_id]
    )
    store.complete([(lease.id, lease.fencing_token, None)], team_ids=[definition.team_id])


def make_channel(team, target: str, *, kind: str = "webhook", name: str = "pager", **fields):
    from apps.audit.record import Actor
    from apps.notify import channels

    spec = channels.ChannelSpec(
        name=name,
        kind=kind,
        target=target,
        events=fields.pop("events", ["run.dead", "job.recovered"]),
        **fields,
    )
    return channels.create(team, spec, Actor.cli("test"))


def messages_of(receiver: Receiver) -> list[tuple[str, str]]:
    """(event, phase) of every message the receiver got, in order."""
    import orjson

    return [
        (body["event"], body["phase"])
        for body in (orjson.loads(request.body) for request in receiver.requests)
    ]
