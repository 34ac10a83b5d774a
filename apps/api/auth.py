"""Bearer tokens: `Authorization: Bearer <token>`, looked up by hash, scoped to one team."""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from functools import partial

from django.conf import settings
from django.db import transaction
from django.db.models.signals import post_delete
from django.dispatch import receiver
from django.utils import timezone
from rest_framework import authentication, exceptions

from apps.teams.lockout import client_address
from apps.teams.models import ApiToken, hash_token
from apps.teams.signals import token_revoked

# Recording every use would add a write to every heartbeat; once a minute is enough to answer
# "is this token still used?".
LAST_USED_RESOLUTION = timedelta(seconds=60)
# Workers call many times a second with the same token: a looked-up token is trusted for this
# long before it is read again. A revocation or a deletion drops it from the cache of the process
# that made it at once (the receivers below); other web processes notice within this time.
CACHE_SECONDS = 5.0
# At most this many addresses' failures are remembered; past it, expired ones are dropped.
MAX_FAILING_ADDRESSES = 10_000

KEYWORD = "Bearer"

_cache: dict[str, tuple[float, ApiToken]] = {}
_cache_lock = threading.Lock()
# Unknown or revoked tokens by client address: [end of its window (monotonic clock), count].
# Per process, like the cache: a guess that is refused here must cost no database lookup.
_failures: dict[str, list] = {}


def forget_cached_tokens() -> None:
    """Drop this process's cached tokens and counted failures (between tests, say)."""
    with _cache_lock:
        _cache.clear()
        _failures.clear()


def forget_token(token_hash: str) -> None:
    """Drop one token from this process's cache: its next use is looked up again."""
    with _cache_lock:
        _cache.pop(token_hash, None)


@receiver(token_revoked, dispatch_uid="api.auth.forget_revoked_token")
def _forget_revoked_token(sender, token: ApiToken, **kwargs) -> None:
    forget_token(token.token_hash)


@receiver(post_delete, sender=ApiToken, dispatch_uid="api.auth.forget_deleted_token")
def _forget_deleted_token(sender, instance: ApiToken, using: str, **kwargs) -> None:
    # A team's deletion deletes its tokens. Forgotten once committed: a lookup before that would
    # still find the token and cache it again.
    transaction.on_commit(partial(forget_token, instance.token_hash), using=using)


def _lookup(digest: str, now: float) -> ApiToken | None:
    token = ApiToken.objects.active().select_related("team").filter(token_hash=digest).first()
    with _cache_lock:
        if token is None:
            _cache.pop(digest, None)
        else:
            if len(_cache) > 10_000:
                _cache.clear()
            _cache[digest] = (now + CACHE_SECONDS, token)
    return token


def _refuse_if_throttled(address: str, now: float) -> None:
    failures = _failures.get(address)
    limit = settings.SCHEDULER_TOKEN_FAILURES_PER_ADDRESS
    if failures is not None and failures[0] > now and 0 < limit <= failures[1]:
        raise exceptions.Throttled(
            failures[0] - now, "Too many unknown or revoked tokens from this address."
        )


def _count_failure(address: str, now: float) -> None:
    if settings.SCHEDULER_TOKEN_FAILURES_PER_ADDRESS <= 0:
        return
    with _cache_lock:
        failures = _failures.get(address)
        if failures is not None and failures[0] > now:
            failures[1] += 1
            return
        if len(_failures) >= MAX_FAILING_ADDRESSES:
            for expired in [key for key, (end, _) in _failures.items() if end <= now]:
                del _failures[expired]
            if len(_failures) >= MAX_FAILING_ADDRESSES:
                _failures.clear()
        _failures[address] = [now + settings.SCHEDULER_TOKEN_FAILURE_WINDOW_SECONDS, 1]


class TokenUser:
    """The principal of an API request: the team its token belongs to."""

    is_authenticated = True
    is_anonymous = False

    def __init__(self, token: ApiToken) -> None:
        self.token = token
        self.team = token.team

    def __str__(self) -> str:
        return f"token:{self.token.prefix}"


def authenticate_bearer(request) -> tuple[TokenUser, ApiToken] | None:
    """The principal of a request's `Authorization` header; None when it has none.

    A token this process looked up less than CACHE_SECONDS ago costs one dict lookup. Any other
    is read from the database, unless it is not one this process knows and its client address
    sent too many unknown or revoked tokens lately: then 429, and the guess costs no lookup.
    """
    header = request.META.get("HTTP_AUTHORIZATION", "")
    if not header:
        return None
    keyword, _, raw = header.partition(" ")
    if keyword.lower() != KEYWORD.lower() or not raw.strip():
        raise exceptions.AuthenticationFailed("Use 'Authorization: Bearer <token>'.")
    raw = raw.strip()
    digest = hash_token(raw)
    now = time.monotonic()
    with _cache_lock:
        hit = _cache.get(digest)
    if hit is not None and hit[0] > now:
        token = hit[1]
    else:
        address = client_address(request)
        if hit is None:
            # A token whose cache entry merely expired is a known one, still read again: a
            # worker keeps working from an address where another process guesses.
            _refuse_if_throttled(address, now)
        token = _lookup(digest, now)
        if token is None or not token.matches(raw):
            _count_failure(address, now)
            raise exceptions.AuthenticationFailed("The token is unknown or revoked.")
    wall = timezone.now()
    if token.last_used_at is None or wall - token.last_used_at > LAST_USED_RESOLUTION:
        ApiToken.objects.filter(pk=token.pk).update(last_used_at=wall)
        token.last_used_at = wall
    return TokenUser(token), token


def still_active(token: ApiToken) -> None:
    """Refuse (401) a token revoked or deleted since its request began, as its next call would
    be: a long poll asks again after each wait (apps/runs/leasing.py)."""
    now = time.monotonic()
    with _cache_lock:
        hit = _cache.get(token.token_hash)
    if (hit is None or hit[0] <= now) and _lookup(token.token_hash, now) is None:
        raise exceptions.AuthenticationFailed("The token was revoked while this request waited.")


class BearerTokenAuthentication(authentication.BaseAuthentication):
    keyword = KEYWORD

    def authenticate(self, request):
        return authenticate_bearer(request)

    def authenticate_header(self, request) -> str:
        return self.keyword
