"""Failed sign-ins: a user name or a client address that fails too often is locked out a while.

Counted in the database (`SignInFailure`), not in Django's cache: the cache is local memory per
web process, so with N processes an attacker would get N budgets and a restart would wipe them.
django-axes, the usual library, was weighed and not used: it applies one failure limit to every
lockout parameter, where a user name and an address (a whole office behind one NAT) need limits
of their own; its backend refuses any `authenticate()` call without a request; and its lockout
answer is its own page rather than an error in our sign-in form. What it would add beyond this
module is its admin pages and reset commands.

The limits (`SCHEDULER_LOGIN_FAILURES_PER_USER`, `_PER_ADDRESS` within
`SCHEDULER_LOGIN_LOCKOUT_SECONDS`) are a sliding window: a name with that many failures in the
window is refused, even with the right password, until the oldest of them leaves it.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.conf import settings
from django.contrib.auth import get_user_model
from django.contrib.auth.backends import ModelBackend
from django.core.exceptions import PermissionDenied
from django.db import connection, transaction
from django.http import HttpRequest
from django.utils import timezone

from apps.audit.models import Source
from apps.audit.record import Actor, record
from apps.teams.models import SignInFailure

# The sign-in form reads this attribute of the request to say why it was refused.
LOCKED_OUT_ATTRIBUTE = "sign_in_locked_out"


def client_address(request: HttpRequest) -> str:
    """The address a request came from: REMOTE_ADDR, or behind a proxy the address it saw.

    X-Forwarded-For is believed only with `SCHEDULER_BEHIND_PROXY` (anyone can send the header),
    and then only its last entry, the one the proxy appended: entries before it are the client's.
    """
    meta = request.META
    if settings.SCHEDULER_BEHIND_PROXY:
        forwarded = meta.get("HTTP_X_FORWARDED_FOR", "").rsplit(",", 1)[-1].strip()
        if forwarded:
            return forwarded[:64]
    return meta.get("REMOTE_ADDR", "")[:64]


class LockedOut(Exception):
    """Too many failed sign-ins for this user name or from this address; `seconds` to wait."""

    def __init__(self, seconds: int) -> None:
        self.seconds = seconds
        super().__init__(f"Too many failed sign-ins; try again in {self.wait}.")

    @property
    def wait(self) -> str:
        if self.seconds < 60:
            return f"{self.seconds} seconds"
        minutes = math.ceil(self.seconds / 60)
        return "1 minute" if minutes == 1 else f"{minutes} minutes"


@dataclass(frozen=True)
class Attempt:
    """A sign-in being checked, already written down as a failure."""

    username: str  # case-folded
    address: str
    # Failures in the window, this attempt included.
    user_failures: int
    address_failures: int


def _limits(username: str, address: str) -> list[tuple[str, str, int]]:
    limits = [("username", username, settings.SCHEDULER_LOGIN_FAILURES_PER_USER)]
    if address:
        limits.append(("address", address, settings.SCHEDULER_LOGIN_FAILURES_PER_ADDRESS))
    return [(field, value, limit) for field, value, limit in limits if limit > 0]


def _advisory_key(field: str, value: str) -> int:
    digest = hashlib.sha256(f"signin:{field}:{value}".encode()).digest()
    return int.from_bytes(digest[:8], "big", signed=True)


def _recent_failures(field: str, value: str, limit: int, since: datetime) -> list[datetime]:
    # signin_failure_username / signin_failure_address: the newest `limit` in the window.
    return list(
        SignInFailure.objects.filter(**{field: value, "created_at__gt": since})
        .order_by("-created_at")
        .values_list("created_at", flat=True)[:limit]
    )


def begin(username: str, address: str) -> Attempt:
    """Write the attempt down as a failure, or raise LockedOut if a limit is reached.

    1. Lock the user name, then the address (advisory locks held until this transaction ends,
       always taken in that order, so two attempts never wait on each other in a cycle).
    2. Count each one's failures in the window; one at its limit refuses the attempt until the
       oldest of its newest `limit` failures leaves the window.
    3. Otherwise write the attempt as a failure and commit, so the locks are released before the
       slow password hash and attempts still in flight count against the limits.
    """
    now = timezone.now()
    window = timedelta(seconds=settings.SCHEDULER_LOGIN_LOCKOUT_SECONDS)
    key = username.casefold()[:150]
    limits = _limits(key, address)
    counts = {"username": 0, "address": 0}
    with transaction.atomic():
        with connection.cursor() as cursor:
            for field, value, _ in limits:
                cursor.execute("SELECT pg_advisory_xact_lock(%s)", [_advisory_key(field, value)])
        waits = []
        for field, value, limit in limits:
            recent = _recent_failures(field, value, limit, now - window)
            counts[field] = len(recent)
            if len(recent) >= limit:
                waits.append((recent[-1] + window - now).total_seconds())
        if waits:
            raise LockedOut(max(1, math.ceil(max(waits))))
        SignInFailure.objects.create(username=key, address=address, created_at=now)
    return Attempt(key, address, counts["username"] + 1, counts["address"] + 1)


def succeeded(attempt: Attempt) -> None:
    """The password was right: forget this name's failures from this address (typos)."""
    # Failures from other addresses stay: they may be someone else's guesses.
    SignInFailure.objects.filter(username=attempt.username, address=attempt.address).delete()


def failed(attempt: Attempt, username: str) -> None:
    """The password was wrong: the attempt stays a failure; audit it, and a lockout it starts."""
    actor = Actor(label=attempt.address or "unknown address", source=Source.DASHBOARD)
    where = {"address": attempt.address}
    record(actor, "auth.login_failed", team=None, target_type="user", target=username, after=where)
    for field, value, limit in _limits(attempt.username, attempt.address):
        failures = attempt.user_failures if field == "username" else attempt.address_failures
        if failures >= limit:
            record(
                actor,
                "auth.locked_out",
                team=None,
                target_type="user" if field == "username" else "address",
                target=username if field == "username" else value,
                after={**where, "failures": failures, "lockedFor": field},
            )
    window = timedelta(seconds=settings.SCHEDULER_LOGIN_LOCKOUT_SECONDS)
    # signin_failure_created: what left the window is of no more use.
    SignInFailure.objects.filter(created_at__lt=timezone.now() - window).delete()


class SignInLockoutBackend(ModelBackend):
    """Django's user name and password check, refused while the name or the address is locked.

    Every sign-in goes through it: the dashboard's form, Django's admin, `Client.login` in tests
    (no request, so no address: only the user name's limit applies).
    """

    def authenticate(self, request, username=None, password=None, **kwargs):
        if username is None:
            username = kwargs.get(get_user_model().USERNAME_FIELD)
        if username is None or password is None:
            return None
        address = client_address(request) if request is not None else ""
        try:
            attempt = begin(username, address)
        except LockedOut as exc:
            if request is not None:
                setattr(request, LOCKED_OUT_ATTRIBUTE, exc)
            # Stops Django trying any other backend; authenticate() answers None.
            raise PermissionDenied(str(exc)) from exc
        user = super().authenticate(request, username=username, password=password, **kwargs)
        if user is None:
            failed(attempt, username)
        else:
            succeeded(attempt)
        return user
