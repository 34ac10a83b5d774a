"""Sending one message: a signed webhook, a Slack incoming webhook, or an email.

Each returns an `Outcome` (never raises for the other end's failures): whether it was taken,
the HTTP status or SMTP code, the answer (capped), and whether trying again may help.
"""

from __future__ import annotations

import smtplib
import time
from dataclasses import dataclass

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


def send(channel: Channel, body: str) -> Outcome:
    """Send `body` (the webhook JSON) to the channel, in the channel's form."""
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
    host_header = original.host + (f":{original.port}" if original.port else "")
    extensions = {"sni_hostname": original.host} if original.scheme == "https" else {}
    request_headers = {
        "Content-Type": "application/json",
        "User-Agent": USER_AGENT,
        "Host": host_header,
        **headers,
    }
    failure: Outcome | None = None
    with httpx.Client(
        timeout=settings.SCHEDULER_NOTIFY_TIMEOUT_SECONDS, follow_redirects=False, trust_env=False
    ) as client:
        for address in resolved.addresses:
            pinned = original.copy_with(host=str(address))
            try:
                with client.stream(
                    "POST", pinned, content=content, headers=request_headers, extensions=extensions
                ) as response:
                    status = response.status_code
                    location = response.headers.get("location", "")
                    answer = _head(response)
            except httpx.ConnectError as exc:
                failure = Outcome(False, None, f"{address}: ConnectError: {exc}", retryable=True)
                continue
            except httpx.HTTPError as exc:
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
    try:
        message.send(fail_silently=False)
    except smtplib.SMTPRecipientsRefused as exc:
        code, reply = next(iter(exc.recipients.values()))
        return Outcome(False, code, _text(reply), retryable=code < 500)
    except smtplib.SMTPResponseException as exc:
        return Outcome(False, exc.smtp_code, _text(exc.smtp_error), retryable=exc.smtp_code < 500)
    except (smtplib.SMTPException, OSError) as exc:
        return Outcome(False, None, f"{type(exc).__name__}: {exc}", retryable=True)
    return Outcome(True, 250, f"accepted for {address}", retryable=False)


def _text(reply: bytes | str) -> str:
    return reply.decode(errors="replace") if isinstance(reply, bytes) else str(reply)
