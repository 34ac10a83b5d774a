from __future__ import annotations

from django.db import models
from django.http import Http404

from apps.runs import shards
from apps.runs.models import PRIORITIES, PRIORITY_NAMES
from apps.runs.shards import alias_of_shard, next_id


def database_of(name: str) -> str:
    """The database that holds the definition named `name` (its shard's, by the name's hash)."""
    from apps.jobs.schedule import shard_for

    return alias_of_shard(shard_for(name))


def database_to_write(name: str) -> str:
    """`database_of(name)`, refused (`shards.Moving`, a 503) while its shard is being moved."""
    from apps.jobs.schedule import shard_for

    return shards.writable(shard_for(name))


class DefinitionGone(Http404):
    """The definition was deleted while a change or a new run waited for it (another client's
    delete committed first): a 404 wherever it was asked for, the API's and the dashboard's."""

    def __init__(self, name: str) -> None:
        super().__init__(f"No job named '{name}': it was deleted meanwhile.")


class JobDefinitionQuerySet(models.QuerySet):
    def for_team(self, team) -> JobDefinitionQuerySet:
        return self.filter(team=team)

    def named(self, name: str) -> JobDefinitionQuerySet:
        """The definition called `name`, read from its shard's database (names are unique
        everywhere: a name's rows can only be in that one)."""
        return self.using(database_of(name)).filter(name=name)


class LiveDefinitions(models.Manager.from_queryset(JobDefinitionQuerySet)):  # type: ignore[misc]
    """The definitions that are not being deleted: what every read and change sees. A deleted
    definition is gone for everyone from the moment its delete begins, though its runs take a
    while to go (JobDefinition.deleting)."""

    def get_queryset(self) -> JobDefinitionQuerySet:
        return super().get_queryset().filter(deleting=False)


class JobDefinition(models.Model):
    # Ordered by code point whatever the database's locale: lists merged across shard
    # databases, and the dashboard's keyset pages, compare names in Python. In a database
    # made under en_US, "b-1" sorted after "b_0" in SQL and before it in Python: the jobs
    # pager showed one job twice and skipped another.
    name = models.CharField(max_length=200, unique=True, db_collation="C")
    # No index of its own: job_team_name leads with the team. Every index here is written on
    # each advance of next_due_at (indexed, so never a HOT update), once per fire time.
    # No constraint in the database: with shards on servers of their own, definitions live in
    # their shard's database and teams in the control database (apps/runs/shards.py).
    team = models.ForeignKey(
        "teams.Team",
        on_delete=models.CASCADE,
        related_name="jobs",
        db_index=False,
        db_constraint=False,
    )
    schedule = models.JSONField(default=dict)
    queue = models.CharField(max_length=100, default="default")
    priority = models.PositiveSmallIntegerField(default=PRIORITIES["default"])
    timeout_seconds = models.PositiveIntegerField(default=3600)
    retry_max_attempts = models.PositiveIntegerField(default=3)
    retry_base_seconds = models.PositiveIntegerField(default=30)
    retry_max_seconds = models.PositiveIntegerField(default=1800)
    concurrency = models.PositiveIntegerField(null=True, blank=True)
    # At most this many leased runs per concurrency key ("one export per customer at a time");
    # cron runs take their key from this payload field.
    concurrency_per_key = models.PositiveIntegerField(null=True, blank=True)
    concurrency_key_field = models.CharField(max_length=100, blank=True, default="")
    # At most `rate_limit_count` leases started in any window of `rate_limit_period_seconds`
    # (a sliding window: runs.RateStart logs each start of a rate-limited definition).
    rate_limit_count = models.PositiveIntegerField(null=True, blank=True)
    rate_limit_period_seconds = models.PositiveIntegerField(null=True, blank=True)
    # Set by a claim that found the rate window full: until then the claim does not even look at
    # the definition's runs (no lock on it, no candidates locked and refused), so a spent
    # rate-limited backlog costs the other jobs of its queue nothing.
    rate_blocked_until = models.DateTimeField(null=True, blank=True)
    # Inline when small; otherwise NULL and the payload is in storage under payload_key.
    payload = models.JSONField(null=True, blank=True, default=dict)
    payload_key = models.CharField(max_length=100, blank=True, default="")
    paused = models.BooleanField(default=False)
    # Set, with the audit event, by the first step of a delete, before its runs go in batches:
    # from then on no run of it is inserted (INSERT_RUNS) or claimed, and nothing reads it but
    # the delete (and the retention round that finishes a delete its process did not).
    deleting = models.BooleanField(default=False)
    dry_run = models.BooleanField(default=False)
    # A run that starts later than this after its availableAt is flagged, and a cron time with no
    # successful run this long after it (plus the timeout) counts as missed. None: not watched.
    lateness_slo_seconds = models.PositiveIntegerField(null=True, blank=True)
    # Who to call and what to read when it fails; shown wherever a failure of it is shown.
    owner = models.CharField(max_length=200, blank=True, default="")
    runbook_url = models.URLField(max_length=500, blank=True, default="")
    # Owned by the scheduler: when the next cron time falls due, and which shard materialises it.
    next_due_at = models.DateTimeField(null=True, blank=True)
    # When its schedule last took effect: set when it is created, when its schedule changes and
    # when it (or its queue) resumes. Cron times before it are not "missed" (a pause and a
    # change restart from the next fire time; they were). None: since it was created.
    armed_at = models.DateTimeField(null=True, blank=True)
    shard = models.PositiveSmallIntegerField(default=0)
    # Set when a run_all catch-up hit its cap, so the dashboard can say how many were dropped.
    missed_runs_note = models.CharField(max_length=300, blank=True, default="")
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    objects = LiveDefinitions()
    # With the definitions being deleted: for the delete itself.
    everything = JobDefinitionQuerySet.as_manager()

    class Meta:
        indexes = [
            # The materialiser: "definitions of shard S due before T", unpaused only.
            models.Index(
                fields=["shard", "next_due_at"],
                name="job_due_by_shard",
                condition=models.Q(paused=False, next_due_at__isnull=False),
            ),
            models.Index(fields=["team", "name"], name="job_team_name"),
            # Retention's look for the deletes their process left (services.finish_deletions):
            # none but while a delete runs, so the round does not scan every definition.
            models.Index(
                fields=["updated_at"], name="job_deleting", condition=models.Q(deleting=True)
            ),
            # The long poll's alarm for a rate window a claim found full (store._NEXT_RATE_SLOT):
            # the few rate-limited definitions only.
            models.Index(
                fields=["queue", "rate_blocked_until"],
                name="job_rate_blocked",
                condition=models.Q(rate_limit_count__isnull=False),
            ),
        ]

    def __str__(self) -> str:
        return self.name

    def save(self, *args, **kwargs) -> None:
        # Stored in its shard's database, under a key that names the shard (apps/runs/shards.py):
        # keys of definitions on two databases never meet.
        from apps.jobs.schedule import shard_for

        self.shard = shard_for(self.name)
        if self.pk is None:
            self.pk = next_id(JobDefinition, self.shard)
            kwargs["using"] = alias_of_shard(self.shard)
        super().save(*args, **kwargs)

    @property
    def priority_name(self) -> str:
        return PRIORITY_NAMES[self.priority]

    @property
    def limited(self) -> bool:
        """Whether any limit holds its runs (their `limited`; apps/runs/store.py, LIMITED)."""
        return (
            self.concurrency is not None
            or self.concurrency_per_key is not None
            or self.rate_limit_count is not None
        )


class Queue(models.Model):
    """A team's named queue; a row exists once it has been paused or leased from."""

    team = models.ForeignKey("teams.Team", on_delete=models.CASCADE, related_name="queues")
    name = models.CharField(max_length=100)
    paused = models.BooleanField(default=False)
    updated_at = models.DateTimeField(auto_now=True)
    # When a worker last asked this queue for work (recorded at most every few seconds per web
    # process), so "why is this not running?" can say that no worker is leasing the queue.
    last_leased_at = models.DateTimeField(null=True, blank=True)
    last_worker_id = models.CharField(max_length=200, blank=True, default="")
    # At most `rate_limit_count` leases started from the queue (every job of it together) in
    # any window of `rate_limit_period_seconds`: a sliding window over QueueStart, kept here in
    # the control database so that it holds across shard databases (apps/runs/leasing.py).
    rate_limit_count = models.PositiveIntegerField(null=True, blank=True)
    rate_limit_period_seconds = models.PositiveIntegerField(null=True, blank=True)
    # The time of a resume that could not restart its definitions' schedules on every shard
    # database (one was down): the scheduler restarts those it meets armed before it from this
    # time, as the resume would have (apps/scheduler/materialiser.py). None once a pause or a
    # resume that reached every database has passed.
    rearm_from = models.DateTimeField(null=True, blank=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["team", "name"], name="queue_team_name_unique")
        ]

    def __str__(self) -> str:
        return f"{self.team_id}:{self.name}"


class QueueStart(models.Model):
    """One lease started from a rate-limited queue: the claim counts those within the queue's
    window under the queue's row lock and drops the older ones (apps/runs/store.py)."""

    id = models.BigAutoField(primary_key=True)
    queue = models.ForeignKey(Queue, on_delete=models.CASCADE, db_index=False)
    started_at = models.DateTimeField()

    class Meta:
        indexes = [models.Index(fields=["queue", "started_at"], name="queuestart_window")]

    def __str__(self) -> str:
        return f"queue {self.queue_id} started a lease at {self.started_at}"
