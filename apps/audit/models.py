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

    # The pending event it was relayed from (PendingEvent): a relay repeated after a failure
    # inserts it once.
    relayed_from = models.UUIDField(null=True, blank=True)

    class Meta:
        indexes = [
            # The audit page filters by team and pages newest first.
            models.Index(fields=["team", "-created_at"], name="audit_team_created"),
            models.Index(fields=["target_type", "target"], name="audit_target"),
        ]
        constraints = [
            models.UniqueConstraint(
                fields=["relayed_from"],
                condition=models.Q(relayed_from__isnull=False),
                name="audit_relayed_once",
            )
        ]

    def __str__(self) -> str:
        return f"{self.created_at:%Y-%m-%d %H:%M} {self.actor} {self.action} {self.target}"


class PendingEvent(models.Model):
    """An audit event kept in a shard database of its own, written in the transaction of the
    rows it is about (apps/audit/record.py: `kept_with_rows`), until `relay` moves it to the
    trail. Writes across databases are not two-phase: written to the control database, the
    event of a change committed on its shard database was lost when the control database's
    commit, last, failed (a sync that failed on another database, say). Ids and names are
    kept as they are: the control database's rows are not reachable from here."""

    id = models.UUIDField(primary_key=True)
    created_at = models.DateTimeField()
    team_id = models.BigIntegerField(null=True)
    actor_user_id = models.BigIntegerField(null=True)
    actor_token_id = models.BigIntegerField(null=True)
    actor = models.CharField(max_length=200)
    source = models.CharField(max_length=16)
    action = models.CharField(max_length=64)
    target_type = models.CharField(max_length=32)
    target = models.CharField(max_length=300)
    before = models.JSONField(null=True)
    after = models.JSONField(null=True)

    def __str__(self) -> str:
        return (
            f"{self.created_at:%Y-%m-%d %H:%M} {self.actor} {self.action} {self.target} (pending)"
        )
