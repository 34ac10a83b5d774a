"""The notifier's sender threads: a receiver that hangs holds one sender, not the others."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from django.db.models import F

from apps.notify.loop import Notifier
from apps.notify.models import Delivery, State
from tests.conftest import make_definition
from tests.notify.conftest import die, make_channel

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def hanging() -> Iterator[tuple[str, threading.Event, threading.Event]]:
    """A receiver that answers only once released: (url, reached, release)."""
    reached, release = threading.Event(), threading.Event()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            reached.set()
            release.wait(30)
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, args=(0.02,), daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/hook", reached, release
    release.set()
    server.shutdown()
    server.server_close()


def test_a_hanging_receiver_does_not_hold_another_channel_s_page(
    team_a, receiver, hanging, settings
):
    settings.SCHEDULER_NOTIFY_SENDERS = 2
    settings.SCHEDULER_NOTIFY_TIMEOUT_SECONDS = 20
    url, reached, release = hanging
    slow = make_channel(team_a, url, name="slow")
    fast = make_channel(team_a, receiver.url, name="fast")
    die(make_definition(team_a, "billing.flaky", queue="billing", retry_max_attempts=1))
    notifier = Notifier()
    notifier.handle_one_detection(force=True)
    assert Delivery.objects.filter(state=State.PENDING).count() == 2
    # The hanging receiver's delivery is due first: one sender alone would wait on it.
    Delivery.objects.filter(channel=fast).update(
        next_attempt_at=F("next_attempt_at") + timedelta(milliseconds=1)
    )

    stop = threading.Event()
    running = threading.Thread(target=notifier.run, args=(stop,), kwargs={"pause": 0.05})
    running.start()
    try:
        assert reached.wait(10), "the hanging receiver was never called"
        deadline = time.monotonic() + 10

        def state_of(channel) -> str:
            return Delivery.objects.get(channel=channel).state

        while state_of(fast) != State.SENT and time.monotonic() < deadline:
            time.sleep(0.05)
        # Sent while the other sender still waits on the hanging receiver.
        assert state_of(fast) == State.SENT and len(receiver.requests) == 1
        assert state_of(slow) == State.PENDING and not release.is_set()
        release.set()
        while (
            Delivery.objects.get(channel=slow).state != State.SENT and time.monotonic() < deadline
        ):
            time.sleep(0.05)
        assert Delivery.objects.get(channel=slow).state == State.SENT
    finally:
        release.set()
        stop.set()
        running.join(30)
    assert not running.is_alive()
