"""Notification channels, incidents, and the outbox of deliveries with their attempts.

Every table here is in the control database (apps/runs/shards.py: not SHARDED), beside the teams
they belong to. An incident and the deliveries that announce it are written in one transaction
(apps/notify/incidents.py), so a daemon that dies between the two leaves either both or neither.
"""

from __future__ import annotations

from django.conf import settings
from django.contrib.postgres.fields import ArrayField
from django.db import models


class Event(models.TextChoices):
    RUN_DEAD = "run.dead"
    JOB_LATE = "job.late"
    JOB_MISSED = "job.missed"
    DLQ_THRESHOLD = "dlq.threshold"
    SHARD_UNOWNED = "scheduler.shard_unowned"
    JOB_RECOVERED = "job.recovered"


# What a test message is sent as: never an incident, never subscribed to.
TEST_EVENT = "test"

# Incidents about one job; the others are about the whole team (its DLQ, its shards).
JOB_EVENTS = (Event.RUN_DEAD, Event.JOB_LATE, Event.JOB_MISSED)


class Kind(models.TextChoices):
    WEBHOOK = "webhook"
    EMAIL = "email"
    SLACK = "slack"


class Channel(models.Model):
    """Where a team is paged: a signed webhook, an email address or a Slack incoming webhook."""

    team = models.ForeignKey("teams.Team", on_delete=models.CASCADE, related_name="channels")
    name = models.CharField(max_length=100)
    kind = models.CharField(max_length=16, choices=Kind.choices)
    # A URL (webhook, Slack) or an email address. A Slack URL is its own secret: answers show
    # it whole only when the channel is created.
    target = models.CharField(max_length=2000)
    # The webhook's HMAC key (shown once, at creation); kept as it is, since signing needs it.
    secret = models.CharField(max_length=100, blank=True, default="")
    events = ArrayField(models.CharField(max_length=32))
    # Empty: every job (or queue). Events about the whole team ignore them.
    jobs = ArrayField(models.CharField(max_length=200), default=list, blank=True)
    queues = ArrayField(models.CharField(max_length=100), default=list, blank=True)
    enabled = models.BooleanField(default=True)
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["team", "name"], name="channel_team_name_unique")
        ]

    def __str__(self) -> str:
        return f"{self.team_id}:{self.name} ({self.kind})"

    def wants(self, event: str, job: str = "", queue: str = "") -> bool:
        """Whether this channel carries `event` (about `job` in `queue`, for a job's event)."""
        if not self.enabled or event not in self.events:
            return False
        if not job:
            return True
        return (not self.jobs or job in self.jobs) and (not self.queues or queue in self.queues)


class Incident(models.Model):
    """One problem of a team, paged once, reminded while open, and closed with a recovery.

    `last_event_at` is the time of the latest occurrence in the data (a dead run's end, a late
    or missed run's due time): an occurrence no later than the last incident's is not new.
    `last_seen_at` is when the detector last found something new (or, for a condition such as a
    full DLQ, found it still true): the incident closes after a quiet period from it.
    """

    team = models.ForeignKey("teams.Team", on_delete=models.CASCADE, related_name="+")
    event = models.CharField(max_length=32, choices=Event.choices)
    # The job's name, or "dlq", or "shards".
    subject = models.CharField(max_length=200)
    job = models.CharField(max_length=200, blank=True, default="")
    queue = models.CharField(max_length=100, blank=True, default="")
    summary = models.TextField()
    run_id = models.CharField(max_length=40, blank=True, default="")
    occurrences = models.PositiveIntegerField(default=1)
    reminders = models.PositiveIntegerField(default=0)
    opened_at = models.DateTimeField()
    last_event_at = models.DateTimeField()
    last_seen_at = models.DateTimeField()
    last_notified_at = models.DateTimeField()
    closed_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        constraints = [
            # One open incident per team, event and subject: the page is sent once.
            models.UniqueConstraint(
                fields=["team", "event", "subject"],
                name="incident_open_unique",
                condition=models.Q(closed_at__isnull=True),
            )
        ]
        indexes = [
            # "The latest incident of this subject" (is an occurrence new?).
            models.Index(fields=["team", "event", "subject", "-opened_at"], name="incident_recent"),
            # Reminders and recoveries: the open incidents.
            models.Index(
                fields=["opened_at"],
                name="incident_open",
                condition=models.Q(closed_at__isnull=True),
            ),
        ]

    def __str__(self) -> str:
        return f"{self.event} {self.subject} ({'open' if self.closed_at is None else 'closed'})"


class State(models.TextChoices):
    PENDING = "pending"
    SENT = "sent"
    FAILED = "failed"


class Delivery(models.Model):
    """One message to one channel: the outbox row, then its log.

    Written in the transaction of the incident it announces; sent by whichever daemon claims it
    first (apps/notify/outbox.py); `attempt_log` keeps each attempt's answer.
    """

    channel = models.ForeignKey(Channel, on_delete=models.CASCADE, related_name="deliveries")
    incident = models.ForeignKey(
        Incident, null=True, blank=True, on_delete=models.SET_NULL, related_name="deliveries"
    )
    event = models.CharField(max_length=32)
    # open, reminder, resolved or test: what this message says about its incident.
    phase = models.CharField(max_length=16)
    summary = models.TextField()
    # The webhook body exactly as signed and sent (Slack and email are rendered from it).
    body = models.TextField()
    state = models.CharField(max_length=16, choices=State.choices, default=State.PENDING)
    attempts = models.PositiveIntegerField(default=0)
    # When it may be tried next; a claim moves it past the claim's lease, so a daemon that dies
    # while sending leaves it to the next one after that.
    next_attempt_at = models.DateTimeField()
    # Set by each claim; the claim's outcome is written only while it is still the current one.
    claim = models.UUIDField(null=True, blank=True)
    last_status = models.IntegerField(null=True, blank=True)
    last_answer = models.TextField(blank=True, default="")
    created_at = models.DateTimeField()
    sent_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        indexes = [
            # The claim: pending deliveries that are due, oldest first.
            models.Index(
                fields=["next_attempt_at", "id"],
                name="delivery_due",
                condition=models.Q(state="pending"),
            ),
            # A channel's delivery log, newest first.
            models.Index(fields=["channel", "-id"], name="delivery_channel_recent"),
        ]

    def __str__(self) -> str:
        return f"{self.event} → {self.channel_id} ({self.state})"


class DeliveryAttempt(models.Model):
    """One try at sending a delivery: what the other end answered, or why it could not."""

    delivery = models.ForeignKey(Delivery, on_delete=models.CASCADE, related_name="attempt_log")
    number = models.PositiveIntegerField()
    started_at = models.DateTimeField()
    duration_ms = models.PositiveIntegerField(default=0)
    ok = models.BooleanField(default=False)
    # The HTTP status, or the SMTP reply code; null when nothing answered.
    status = models.IntegerField(null=True, blank=True)
    answer = models.TextField(blank=True, default="")

    class Meta:
        indexes = [models.Index(fields=["delivery", "number"], name="delivery_attempt_number")]

    def __str__(self) -> str:
        return f"{self.delivery_id}#{self.number} {'ok' if self.ok else 'failed'}"


class Watermark(models.Model):
    """How far a detector has read a stream: `dead:<database>` (dead runs by end time and id),
    `alerts:<team id>` (the first look at a team's late and missed runs)."""

    key = models.CharField(max_length=100, primary_key=True)
    position_at = models.DateTimeField()
    position_id = models.BigIntegerField(default=0)

    def __str__(self) -> str:
        return f"{self.key} @ {self.position_at} / {self.position_id}"
