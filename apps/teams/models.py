from __future__ import annotations

import hashlib
import hmac
import secrets

from django.conf import settings
from django.core.validators import MaxValueValidator
from django.db import models
from django.utils import timezone

# 100 years, the bound of SCHEDULER_RETENTION_DAYS too (settings.py): a date further back is past
# PostgreSQL's range, and every retention round failed on it.
MAX_RETENTION_DAYS = 36_600


class Team(models.Model):
    slug = models.SlugField(max_length=64, unique=True)
    name = models.CharField(max_length=200)
    # Finished runs older than this are deleted by the scheduler; None: the site's default. A
    # value past the bound, set in the database or a shell, counts as the bound (retention.py).
    retention_days = models.PositiveIntegerField(
        null=True, blank=True, validators=[MaxValueValidator(MAX_RETENTION_DAYS)]
    )
    created_at = models.DateTimeField(auto_now_add=True)

    def __str__(self) -> str:
        return self.slug


class Role(models.TextChoices):
    VIEWER = "viewer"
    OPERATOR = "operator"
    EDITOR = "editor"
    ADMIN = "admin"


ROLE_RANK = {Role.VIEWER: 0, Role.OPERATOR: 1, Role.EDITOR: 2, Role.ADMIN: 3}


class Membership(models.Model):
    user = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="memberships"
    )
    team = models.ForeignKey(Team, on_delete=models.CASCADE, related_name="memberships")
    role = models.CharField(max_length=16, choices=Role.choices, default=Role.VIEWER)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["user", "team"], name="membership_user_team_unique")
        ]

    def __str__(self) -> str:
        return f"{self.user_id}@{self.team_id}:{self.role}"

    def allows(self, role: str) -> bool:
        return ROLE_RANK[Role(self.role)] >= ROLE_RANK[Role(role)]


class Scope(models.TextChoices):
    WORKER = "worker"
    MANAGE = "manage"


TOKEN_PREFIX = "jst_"


def hash_token(raw: str) -> str:
    # Tokens carry 256 bits of randomness, so a fast hash is enough: there is nothing to brute-force.
    return hashlib.sha256(raw.encode()).hexdigest()


class ApiTokenQuerySet(models.QuerySet):
    def active(self) -> ApiTokenQuerySet:
        return self.filter(revoked_at__isnull=True)


class ApiToken(models.Model):
    team = models.ForeignKey(Team, on_delete=models.CASCADE, related_name="tokens")
    name = models.CharField(max_length=100, default="")
    token_hash = models.CharField(max_length=64, unique=True)
    # The first characters of the token, kept so people can tell their tokens apart.
    prefix = models.CharField(max_length=16)
    scopes = models.JSONField(default=list)
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    created_at = models.DateTimeField(auto_now_add=True)
    last_used_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)

    objects = ApiTokenQuerySet.as_manager()

    def __str__(self) -> str:
        return f"{self.prefix}… ({self.team.slug})"

    @classmethod
    def issue(
        cls, team: Team, scopes: list[str], *, name: str = "", created_by=None
    ) -> tuple[ApiToken, str]:
        """Create a token and return it with its raw value, which is shown once and never stored."""
        raw = TOKEN_PREFIX + secrets.token_urlsafe(32)
        token = cls.objects.create(
            team=team,
            name=name,
            token_hash=hash_token(raw),
            prefix=raw[:12],
            scopes=sorted(set(scopes)),
            created_by=created_by,
        )
        return token, raw

    def matches(self, raw: str) -> bool:
        return hmac.compare_digest(self.token_hash, hash_token(raw))

    def has_scope(self, scope: str) -> bool:
        return scope in self.scopes


class SignInFailure(models.Model):
    """A failed sign-in, kept for the lockout window (apps/teams/lockout.py).

    An attempt is written before its password is checked and deleted when the password was right,
    so attempts in flight count too: the limits hold exactly across web processes.
    """

    # Case-folded, so "Alice" and "alice" share one budget.
    username = models.CharField(max_length=150)
    address = models.CharField(max_length=64, blank=True)
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        indexes = [
            # The lockout counts a user name's, then an address's, failures in the window.
            models.Index(fields=["username", "-created_at"], name="signin_failure_username"),
            models.Index(fields=["address", "-created_at"], name="signin_failure_address"),
            # Failures older than the window are deleted as new ones are written.
            models.Index(fields=["created_at"], name="signin_failure_created"),
        ]

    def __str__(self) -> str:
        return f"{self.created_at:%Y-%m-%d %H:%M:%S} {self.username} from {self.address}"
