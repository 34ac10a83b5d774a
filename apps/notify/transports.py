"""Sending one message: a signed webhook, a Slack incoming webhook, or an email.

Each returns an `Outcome` (never raises for the other end's failures): whether it was taken,
the HTTP status or SMTP code, the answer (capped), and whether trying again may help.
"""

from __future__ import annotations

import smtplib
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import orjson
from django.conf import settings
from django.core.mail import EmailMessage, get_connection

from apps.notify import messages, signing, targets
from apps.notify.models import Channel, Kind

# The delivery log keeps this much of each answer, read from its first ANSWER_READ bytes.
ANSWER_CAP = 2000
ANSWER_READ = 8192
USER_AGENT = "cronlease-notify/1"
# HTTP answers worth another try: the other end may be back later. Other 4xx will not change.
RETRY_STATUSES = {408, 425, 429}


@dataclass(frozen=True)
class Outcome:
    ok: bool
    status: int | None
    answer: str
    retryable: bool
    duration_ms: int = 0


def cap(text: str) -> str:
    """The answer as the log keeps it: capped, and without NUL, which a text column cannot hold
    (a receiver answering binary made every record of the attempt fail, and it was retried
    for ever)."""
    text = text.replace("\x00", "\ufffd")
    return text if len(text) <= ANSWER_CAP else text[: ANSWER_CAP - 1] + "…"


@dataclass
class Deadline:
    """The end of one conversation, `SCHEDULER_NOTIFY_TIMEOUT_SECONDS` after it starts.

    httpx's and smtplib's timeouts bound each read, not the conversation: a receiver that
    answered a byte a second held a sender for a minute against a 2 s timeout, and outlived the
    delivery's claim, so another sender sent the same message again. At the deadline the
    conversation's sockets are shut down, which ends any read or write blocked on them."""

    seconds: float
    expired: bool = False
    _sockets: list[socket.socket] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _timer: threading.Timer | None = None

    def __enter__(self) -> Deadline:
        self._timer = threading.Timer(self.seconds, self._expire)
        self._timer.daemon = True
        self._timer.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._timer is not None:
            self._timer.cancel()

    def watch(self, sock: socket.socket | None) -> None:
        if sock is None:
            return
        with self._lock:
            self._sockets.append(sock)
            expired = self.expired
        if expired:
            _shut(sock)

    def trace(self, event: str, info: dict[str, Any]) -> None:
        """httpx's trace hook: watch each connection's socket once it is open."""
        if event in ("connection.connect_tcp.complete", "connection.start_tls.complete"):
            self.watch(info["return_value"].get_extra_info("socket"))

    def _expire(self) -> None:
        with self._lock:
            self.expired = True
            sockets = list(self._sockets)
        for sock in sockets:
            _shut(sock)

    def outcome(self) -> Outcome:
        return Outcome(False, None, f"No whole answer within {self.seconds:g} s.", retryable=True)


def _shut(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:  # already closed
        pass


def send(channel: Channel, body: str) -> Outcome:
    """Send `body` (the webhook JSON) to the channel, in the channel's form, in at most
    `SCHEDULER_NOTIFY_TIMEOUT_SECONDS` (name resolution aside)."""
    started = time.monotonic()
    try:
        if channel.kind == Kind.EMAIL:
            outcome = _email(channel.target, body)
        elif channel.kind == Kind.SLACK:
            outcome = _post(channel.target, messages.slack(orjson.loads(body)), {})
        else:
            raw = body.encode()
            headers = {signing.HEADER: signing.signature(channel.secret, raw)}
            outcome = _post(channel.target, raw, headers)
    except targets.TargetUnresolved as exc:
        outcome = Outcome(False, None, str(exc), retryable=True)
    except targets.TargetRefused as exc:
        outcome = Outcome(False, None, str(exc), retryable=False)
    elapsed = int((time.monotonic() - started) * 1000)
    return Outcome(outcome.ok, outcome.status, cap(outcome.answer), outcome.retryable, elapsed)


def _post(url: str, content: bytes, headers: dict[str, str]) -> Outcome:
    """POST to the addresses `url` resolved to and was checked at (targets.resolve), each in
    turn until one connects, with the URL's host in `Host` and in TLS's SNI and certificate
    check. Redirects are not followed (a redirect could lead anywhere), proxies from the
    environment are not used, and at most ANSWER_READ bytes of the answer are read."""
    resolved = targets.resolve(url)
    original = httpx.URL(url)
    # An IPv6 literal is written in brackets in `Host` as in the URL (RFC 9110, 7.2).
    host = f"[{original.host}]" if ":" in original.host else original.host
    host_header = host + (f":{original.port}" if original.port else "")
    deadline = Deadline(settings.SCHEDULER_NOTIFY_TIMEOUT_SECONDS)
    extensions: dict[str, Any] = {"trace": deadline.trace}
    if original.scheme == "https":
        extensions["sni_hostname"] = original.host
    request_headers = {
        "Content-Type": "application/json",
        "User-Agent": USER_AGENT,
        "Host": host_header,
        **headers,
    }
    failure: Outcome | None = None
    with (
        deadline,
        httpx.Client(
            timeout=settings.SCHEDULER_NOTIFY_TIMEOUT_SECONDS,
            follow_redirects=False,
            trust_env=False,
        ) as client,
    ):
        for address in resolved.addresses:
            pinned = original.copy_with(host=str(address))
            try:
                with client.stream(
                    "POST", pinned, content=content, headers=request_headers, extensions=extensions
                ) as response:
                    status = response.status_code
                    location = response.headers.get("location", "")
                    answer = _head(response)
            except httpx.HTTPError as exc:
                if deadline.expired:
                    return deadline.outcome()
                if isinstance(exc, httpx.ConnectError):
                    failure = Outcome(
                        False, None, f"{address}: ConnectError: {exc}", retryable=True
                    )
                    continue
                return Outcome(False, None, f"{type(exc).__name__}: {exc}", retryable=True)
            break
        else:
            return failure or Outcome(False, None, "No address to connect to.", retryable=True)
    if 200 <= status < 300:
        return Outcome(True, status, answer, retryable=False)
    if 300 <= status < 400:
        answer = f"redirects are not followed (Location: {location})"
    return Outcome(False, status, answer, retryable=status >= 500 or status in RETRY_STATUSES)


def _head(response: httpx.Response) -> str:
    """The start of an answer: a receiver that sends gigabytes gets read for ANSWER_READ."""
    read = b""
    for chunk in response.iter_bytes():
        read += chunk
        if len(read) >= ANSWER_READ:
            break
    return read[:ANSWER_READ].decode(response.encoding or "utf-8", errors="replace")


def _email(address: str, body: str) -> Outcome:
    subject, text = messages.email(orjson.loads(body))
    connection = get_connection(timeout=settings.SCHEDULER_NOTIFY_TIMEOUT_SECONDS)
    message = EmailMessage(
        subject, text, settings.DEFAULT_FROM_EMAIL, [address], connection=connection
    )
    deadline = Deadline(settings.SCHEDULER_NOTIFY_TIMEOUT_SECONDS)
    try:
        # Opened first (connect and greeting, each read within the timeout), so the deadline
        # can watch its socket through the rest of the conversation.
        with deadline, connection:
            deadline.watch(getattr(getattr(connection, "connection", None), "sock", None))
            message.send(fail_silently=False)
    except (smtplib.SMTPException, OSError) as exc:
        return deadline.outcome() if deadline.expired else _refused(exc)
    return Outcome(True, 250, f"accepted for {address}", retryable=False)


def _refused(exc: smtplib.SMTPException | OSError) -> Outcome:
    if isinstance(exc, smtplib.SMTPRecipientsRefused):
        code, reply = next(iter(exc.recipients.values()))
        return Outcome(False, code, _text(reply), retryable=code < 500)
    if isinstance(exc, smtplib.SMTPResponseException):
        return Outcome(False, exc.smtp_code, _text(exc.smtp_error), retryable=exc.smtp_code < 500)
    return Outcome(False, None, f"{type(exc).__name__}: {exc}", retryable=True)


def _text(reply: bytes | str) -> str:
    return reply.decode(errors="replace") if isinstance(reply, bytes) else str(reply)
