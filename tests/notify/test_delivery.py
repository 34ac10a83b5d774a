"""Sending: email to a real SMTP server, Slack's body, retries with backoff and their log, an
answer that no retry can change, and the SSRF check again at delivery time."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from email import policy
from email.parser import BytesParser
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import orjson
import pytest
from django.db.models import F

from apps.audit.record import Actor
from apps.notify import channels, messages, outbox
from apps.notify.loop import Notifier
from apps.notify.models import Delivery, DeliveryAttempt, State
from tests.notify.conftest import make_channel

pytestmark = pytest.mark.django_db


def test_an_email_channel_delivers_to_a_real_smtp_server(team_a, smtp):
    channel = make_channel(team_a, "oncall@example.com", kind="email", name="mail")
    delivery = channels.send_test(channel, Actor.cli("test"))
    assert delivery.state == State.SENT and delivery.last_status == 250, delivery.last_answer
    (envelope,) = smtp.envelopes
    assert envelope.rcpt_tos == ["oncall@example.com"]
    assert envelope.mail_from == "cronlease@example.test"
    message = BytesParser(policy=policy.default).parsebytes(envelope.content)
    assert message["subject"] == "[cronlease] [team-a] test: test message"
    assert "https://cronlease.example.test/teams/team-a" in message.get_content()


def test_a_refusing_smtp_server_is_logged_and_the_delivery_retried(team_a, settings):
    from tests.notify.conftest import free_port

    settings.EMAIL_BACKEND = "django.core.mail.backends.smtp.EmailBackend"
    settings.EMAIL_HOST, settings.EMAIL_PORT = "127.0.0.1", free_port()  # nobody listens
    channel = make_channel(team_a, "oncall@example.com", kind="email", name="mail")
    delivery = channels.send_test(channel, Actor.cli("test"))
    assert delivery.state == State.PENDING and delivery.attempts == 1
    assert "ConnectionRefusedError" in delivery.last_answer


def test_a_slack_channel_gets_text_and_its_url_is_shown_once(team_a, receiver):
    channel = make_channel(team_a, receiver.url + "/T000/B000/XXXX", kind="slack", name="slack")
    assert channels.shown_target(channel) == f"http://{receiver.url.split('/')[2]}/…"
    delivery = channels.send_test(channel, Actor.cli("test"))
    assert delivery.state == State.SENT
    (request,) = receiver.requests
    assert request.path.endswith("/T000/B000/XXXX")
    assert "X-Cronlease-Signature" not in request.headers
    text = orjson.loads(request.body)["text"]
    assert (
        text.startswith("*[team-a] test")
        and "<https://cronlease.example.test/teams/team-a|" in text
    )


def test_a_worker_s_error_text_reaches_slack_as_text_not_as_mentions_or_links():
    body = messages.body(
        event="run.dead",
        phase="open",
        team_slug="team-a",
        summary="a.b: run run_1 is dead (<!channel> see <https://evil.example|bank> & *x*).",
        at=datetime(2026, 12, 4, tzinfo=UTC),
        job="a.b",
        run_id="run_1",
    )
    text = orjson.loads(messages.slack(orjson.loads(body)))["text"]
    assert "<!channel>" not in text and "<https://evil" not in text
    assert "(&lt;!channel&gt; see &lt;https://evil.example|bank&gt; &amp; *x*)." in text
    assert text.endswith("/runs/run_1|Open in cronlease>")


def test_failures_are_retried_with_backoff_until_sent_each_attempt_logged(
    team_a, receiver, settings
):
    settings.SCHEDULER_NOTIFY_BACKOFF_SECONDS = 0
    receiver.answers = [503, 429]
    channel = make_channel(team_a, receiver.url)
    first = channels.send_test(channel, Actor.cli("test"))
    assert (first.state, first.attempts, first.last_status) == (State.PENDING, 1, 503)
    assert first.last_answer == "receiver says no"
    while outbox.deliver_next():
        pass
    first.refresh_from_db()
    assert (first.state, first.attempts, first.last_status) == (State.SENT, 3, 200)
    log = DeliveryAttempt.objects.filter(delivery=first).order_by("number")
    assert [(a.number, a.status, a.ok) for a in log] == [
        (1, 503, False),
        (2, 429, False),
        (3, 200, True),
    ]
    assert len(receiver.requests) == 3 and len({r.body for r in receiver.requests}) == 1


def test_a_binary_answer_is_logged_readable_and_the_delivery_retried(team_a, receiver, settings):
    """A text column cannot hold NUL: an answer with one is logged with a replacement
    character, and the delivery goes on as any refused one does."""
    settings.SCHEDULER_NOTIFY_BACKOFF_SECONDS = 0
    receiver.answers = [503]
    receiver.refusal = b"\x00\xff\xfe binary"
    channel = make_channel(team_a, receiver.url)
    first = channels.send_test(channel, Actor.cli("test"))
    assert (first.state, first.attempts, first.last_status) == (State.PENDING, 1, 503)
    assert first.last_answer == "\ufffd\ufffd\ufffd binary"
    assert DeliveryAttempt.objects.get(delivery=first).answer == first.last_answer
    while outbox.deliver_next():
        pass
    first.refresh_from_db()
    assert (first.state, first.attempts) == (State.SENT, 2)


def test_spent_attempts_and_answers_no_retry_can_change_fail_the_delivery(
    team_a, receiver, settings
):
    settings.SCHEDULER_NOTIFY_MAX_ATTEMPTS = 2
    receiver.answers = [500, 500, 404]
    channel = make_channel(team_a, receiver.url)
    spent = channels.send_test(channel, Actor.cli("test"))
    while outbox.deliver_next():
        pass
    spent.refresh_from_db()
    assert (spent.state, spent.attempts) == (State.FAILED, 2)
    gone = channels.send_test(channel, Actor.cli("test"))
    assert (gone.state, gone.attempts, gone.last_status) == (State.FAILED, 1, 404)
    assert backoff_doubles(settings)


def backoff_doubles(settings) -> bool:
    settings.SCHEDULER_NOTIFY_BACKOFF_SECONDS = 15
    settings.SCHEDULER_NOTIFY_BACKOFF_MAX_SECONDS = 100
    return [outbox.backoff_seconds(n) for n in (1, 2, 3, 4)] == [15, 30, 60, 100]


def test_the_target_is_checked_again_when_sending(team_a, receiver, settings):
    channel = make_channel(team_a, receiver.url)  # allowed when saved
    settings.SCHEDULER_NOTIFY_ALLOW_PRIVATE_TARGETS = False
    delivery = channels.send_test(channel, Actor.cli("test"))
    assert delivery.state == State.FAILED and delivery.attempts == 1
    assert "127.0.0.1 is a loopback address" in delivery.last_answer
    assert receiver.requests == []


def test_old_deliveries_and_closed_incidents_are_pruned_pending_ones_kept(team_a, receiver):
    channel = make_channel(team_a, receiver.url)
    sent = channels.send_test(channel, Actor.cli("test"))
    receiver.answers = [503]
    waiting = channels.send_test(channel, Actor.cli("test"))
    assert waiting.state == State.PENDING
    Delivery.objects.update(created_at=F("created_at") - timedelta(days=31))
    assert Notifier().handle_one_prune(force=True) is False
    assert list(Delivery.objects.values_list("pk", flat=True)) == [waiting.pk]
    assert not DeliveryAttempt.objects.filter(delivery=sent.pk).exists()


@pytest.fixture
def trickler() -> Iterator[Callable[[bytes, bytes], str]]:
    """A TCP server that sends `head` at once, then `tail` a byte every 0.2 s: each read
    comes within any timeout, the conversation never ends. Gives its address."""
    servers: list[socket.socket] = []
    stop = threading.Event()

    def start(head: bytes, tail: bytes) -> str:
        server = socket.create_server(("127.0.0.1", 0))
        servers.append(server)

        def serve() -> None:
            with contextlib.suppress(OSError):
                conn, _ = server.accept()
                with conn:
                    conn.sendall(head)
                    for byte in tail:
                        if stop.wait(0.2):
                            return
                        conn.sendall(bytes([byte]))

        threading.Thread(target=serve, daemon=True).start()
        return f"127.0.0.1:{server.getsockname()[1]}"

    yield start
    stop.set()
    for server in servers:
        server.close()


@pytest.mark.parametrize(
    "head, tail",
    [
        (b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\n", b"x" * 1000),  # the body trickles
        (b"HTTP/1.1 200 OK\r\n", b"X-Slow: " + b"y" * 1000),  # the headers trickle
    ],
)
def test_a_receiver_that_trickles_is_cut_off_at_the_timeout_and_retried(
    team_a, settings, trickler, head, tail
):
    settings.SCHEDULER_NOTIFY_TIMEOUT_SECONDS = 1
    channel = make_channel(team_a, f"http://{trickler(head, tail)}/hook")
    started = time.monotonic()
    delivery = channels.send_test(channel, Actor.cli("test"))
    # Past its claim (twice the timeout and 5 s), another sender would send it again.
    assert time.monotonic() - started < 2 * 1 + 5 - 1
    assert delivery.state == State.PENDING and delivery.attempts == 1
    assert delivery.last_answer == "No whole answer within 1 s."


def test_an_smtp_server_that_trickles_is_cut_off_at_the_timeout(team_a, settings, trickler):
    settings.SCHEDULER_NOTIFY_TIMEOUT_SECONDS = 1
    settings.EMAIL_BACKEND = "django.core.mail.backends.smtp.EmailBackend"
    address = trickler(b"220 slow.example ESMTP\r\n", b"250-" + b"z" * 1000)
    settings.EMAIL_HOST, port = address.split(":")
    settings.EMAIL_PORT = int(port)
    channel = make_channel(team_a, "oncall@example.com", kind="email", name="mail")
    started = time.monotonic()
    delivery = channels.send_test(channel, Actor.cli("test"))
    assert time.monotonic() - started < 2 * 1 + 5 - 1
    assert delivery.state == State.PENDING
    assert delivery.last_answer == "No whole answer within 1 s."


def test_an_ipv6_target_is_named_in_brackets_in_host(team_a):
    seen: list[str] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            seen.append(self.headers["Host"])
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args) -> None:
            pass

    class Server6(ThreadingHTTPServer):
        address_family = socket.AF_INET6

    server = Server6(("::1", 0), Handler)
    threading.Thread(target=server.serve_forever, args=(0.02,), daemon=True).start()
    try:
        port = server.server_address[1]
        channel = make_channel(team_a, f"http://[::1]:{port}/hook")
        assert channels.send_test(channel, Actor.cli("test")).state == State.SENT
        assert seen == [f"[::1]:{port}"]
    finally:
        server.shutdown()
        server.server_close()
