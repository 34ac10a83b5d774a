"""Webhook signatures: `X-Cronlease-Signature: t=<unix time>,v1=<hex HMAC-SHA256>`.

The MAC is over `"<t>.<body>"` (the body's bytes exactly as sent) with the channel's secret, as
Stripe signs its webhooks: a receiver checks it with the secret it was shown once, and refuses
a timestamp too far from its own clock, so a captured request cannot be replayed later.
README ("Notifications") has the receiver's side as a snippet; `verify` is the same code.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time

HEADER = "X-Cronlease-Signature"
SECRET_PREFIX = "whsec_"
# How far a receiver lets the timestamp be from its own clock (seconds).
TOLERANCE_SECONDS = 300


def new_secret() -> str:
    """A webhook secret: 256 random bits, shown once."""
    return SECRET_PREFIX + secrets.token_urlsafe(32)


def mac(secret: str, timestamp: int, body: bytes) -> str:
    return hmac.new(secret.encode(), f"{timestamp}.".encode() + body, hashlib.sha256).hexdigest()


def signature(secret: str, body: bytes, timestamp: int | None = None) -> str:
    """The header's value for `body` signed now (or at `timestamp`)."""
    t = int(time.time()) if timestamp is None else timestamp
    return f"t={t},v1={mac(secret, t, body)}"


def verify(secret: str, body: bytes, header: str, *, now: float | None = None) -> bool:
    """Whether `header` signs `body` with `secret`, at a time within the tolerance."""
    try:
        fields = dict(part.split("=", 1) for part in header.split(","))
        timestamp = int(fields["t"])
    except (KeyError, ValueError):
        return False
    if abs((time.time() if now is None else now) - timestamp) > TOLERANCE_SECONDS:
        return False
    return hmac.compare_digest(mac(secret, timestamp, body), fields.get("v1", ""))
