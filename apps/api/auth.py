"""Bearer tokens: `Authorization: Bearer <token>`, looked up by hash, scoped to one team."""

from __future__ import annotations

from datetime import timedelta

from django.utils import timezone
from rest_framework import authentication, exceptions

from apps.teams.models import ApiToken, hash_token

# Recording every use would add a write to every heartbeat; once a minute is enough to answer
# "is this token still used?".
LAST_USED_RESOLUTION = timedelta(seconds=60)


class TokenUser:
    """The principal of an API request: the team its token belongs to."""

    is_authenticated = True
    is_anonymous = False

    def __init__(self, token: ApiToken) -> None:
        self.token = token
        self.team = token.team

    def __str__(self) -> str:
        return f"token:{self.token.prefix}"


class BearerTokenAuthentication(authentication.BaseAuthentication):
    keyword = "Bearer"

    def authenticate(self, request):
        header = authentication.get_authorization_header(request).decode("latin-1")
        if not header:
            return None
        keyword, _, raw = header.partition(" ")
        if keyword.lower() != self.keyword.lower() or not raw.strip():
            raise exceptions.AuthenticationFailed("Use 'Authorization: Bearer <token>'.")
        raw = raw.strip()
        token = (
            ApiToken.objects.active()
            .select_related("team")
            .filter(token_hash=hash_token(raw))
            .first()
        )
        if token is None or not token.matches(raw):
            raise exceptions.AuthenticationFailed("The token is unknown or revoked.")
        now = timezone.now()
        if token.last_used_at is None or now - token.last_used_at > LAST_USED_RESOLUTION:
            ApiToken.objects.filter(pk=token.pk).update(last_used_at=now)
        return TokenUser(token), token

    def authenticate_header(self, request) -> str:
        return self.keyword
