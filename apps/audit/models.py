from __future__ import annotations

from django.conf import settings
from django.db import models


class Source(models.TextChoices):
    DASHBOARD = "dashboard"
    API = "api"
    CLI = "cli"
    SYSTEM = "system"


class AuditEvent(models.Model):
    """One change, by whom and from where. Rows are only ever inserted."""

    created_at = models.DateTimeField(auto_now_add=True, db_index=True)
    team = models.ForeignKey(
        "teams.Team", null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    actor_user = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    actor_token = models.ForeignKey(
        "teams.ApiToken", null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    # Kept as text too, so the trail still reads after a user or token is deleted.
    actor = models.CharField(max_length=200)
    source = models.CharField(max_length=16, choices=Source.choices)
    action = models.CharField(max_length=64)
    target_type = models.CharField(max_length=32)
    target = models.CharField(max_length=300)
    before = models.JSONField(null=True, blank=True)
    after = models.JSONField(null=True, blank=True)

    class Meta:
        indexes = [
            # The audit page filters by team and pages newest first.
            models.Index(fields=["team", "-created_at"], name="audit_team_created"),
            models.Index(fields=["target_type", "target"], name="audit_target"),
        ]

    def __str__(self) -> str:
        return f"{self.created_at:%Y-%m-%d %H:%M} {self.actor} {self.action} {self.target}"
