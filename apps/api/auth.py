"""Bearer tokens: `Authorization: Bearer <token>`, looked up by hash, scoped to one team."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

from django.utils import timezone
from rest_framework import authentication, exceptions

from apps.teams.models import ApiToken, hash_token

# Recording every use would add a write to every heartbeat; once a minute is enough to answer
# "is this token still used?".
LAST_USED_RESOLUTION = timedelta(seconds=60)
# Workers call many times a second with the same token: a looked-up token is trusted for this
# long before it is read again, so a revocation reaches every web process within it.
CACHE_SECONDS = 5.0

KEYWORD = "Bearer"

_cache: dict[str, tuple[float, ApiToken]] = {}
_cache_lock = threading.Lock()


def forget_cached_tokens() -> None:
    """Drop this process's cached tokens (after a revocation, and between tests)."""
    with _cache_lock:
        _cache.clear()


def _lookup(digest: str) -> ApiToken | None:
    now = time.monotonic()
    with _cache_lock:
        hit = _cache.get(digest)
    if hit is not None and hit[0] > now:
        return hit[1]
    token = ApiToken.objects.active().select_related("team").filter(token_hash=digest).first()
    if token is not None:
        with _cache_lock:
            if len(_cache) > 10_000:
                _cache.clear()
            _cache[digest] = (now + CACHE_SECONDS, token)
    return token


class TokenUser:
    """The principal of an API request: the team its token belongs to."""

    is_authenticated = True
    is_anonymous = False

    def __init__(self, token: ApiToken) -> None:
        self.token = token
        self.team = token.team

    def __str__(self) -> str:
        return f"token:{self.token.prefix}"


def authenticate_bearer(header: str) -> tuple[TokenUser, ApiToken] | None:
    """The principal of an `Authorization` header's value; None when there is no header."""
    if not header:
        return None
    keyword, _, raw = header.partition(" ")
    if keyword.lower() != KEYWORD.lower() or not raw.strip():
        raise exceptions.AuthenticationFailed("Use 'Authorization: Bearer <token>'.")
    raw = raw.strip()
    token = _lookup(hash_token(raw))
    if token is None or not token.matches(raw):
        raise exceptions.AuthenticationFailed("The token is unknown or revoked.")
    now = timezone.now()
    if token.last_used_at is None or now - token.last_used_at > LAST_USED_RESOLUTION:
        ApiToken.objects.filter(pk=token.pk).update(last_used_at=now)
        token.last_used_at = now
    return TokenUser(token), token


class BearerTokenAuthentication(authentication.BaseAuthentication):
    keyword = KEYWORD

    def authenticate(self, request):
        return authenticate_bearer(
            authentication.get_authorization_header(request).decode("latin-1")
        )

    def authenticate_header(self, request) -> str:
        return self.keyword
