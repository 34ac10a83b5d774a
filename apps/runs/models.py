from __future__ import annotations

from datetime import datetime

from django.contrib.postgres.fields import ArrayField
from django.db import models

from apps.runs.ids import public_run_id
from apps.runs.shards import next_id

# Priorities are stored as small integers so "ORDER BY priority" serves critical first.
PRIORITIES = {"critical": 0, "default": 1, "bulk": 2}
PRIORITY_NAMES = {value: name for name, value in PRIORITIES.items()}


class State(models.TextChoices):
    SCHEDULED = "scheduled"
    READY = "ready"
    LEASED = "leased"
    SUCCEEDED = "succeeded"
    RETRYING = "retrying"
    DEAD = "dead"
    CANCELLED = "cancelled"


# A run in one of these states waits for its availableAt; once that has passed it is claimable.
# `ready` is also stored (requeue and retry-now write it) but is otherwise derived, see reported_state.
WAITING_STATES = ("scheduled", "ready", "retrying")
FINISHED_STATES = ("succeeded", "dead", "cancelled")


def reported_state(state: str, available_at: datetime, now: datetime) -> str:
    """The state the API and dashboard show: a waiting run whose availableAt has passed is ready."""
    if state in WAITING_STATES and available_at <= now:
        return "ready"
    return state


class Trigger(models.TextChoices):
    CRON = "cron"
    CATCH_UP = "catch_up"
    API = "api"
    MANUAL = "manual"
    BACKFILL = "backfill"


# Runs made for a fire time: one a definition and due time (run_definition_due_unique).
SCHEDULED_TRIGGERS = ["cron", "catch_up", "backfill"]


class Outcome(models.TextChoices):
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    LEASE_EXPIRED = "lease_expired"
    TIMED_OUT = "timed_out"
    # The worker reported after a cancel was asked for: the run ended cancelled.
    CANCELLED = "cancelled"


class Run(models.Model):
    # Both foreign keys are covered by the composite indexes below; one less index to write per run.
    # Neither is a constraint in the database, whose check at commit, a query per run inserted,
    # cost 1-3.5 of the 20-23 ms an insert of 1 000 runs takes (bench/README.md).
    # The one statement that inserts runs (apps/runs/store.py, INSERT_RUNS) inserts only for a
    # definition it finds and holds FOR KEY SHARE until it commits, and deleting a definition
    # (apps/jobs/services.py) first locks it against such inserts, then deletes its runs.
    # Django still deletes a definition's or a team's runs with them (on_delete).
    definition = models.ForeignKey(
        "jobs.JobDefinition",
        on_delete=models.CASCADE,
        related_name="runs",
        db_index=False,
        db_constraint=False,
    )
    # Copied from the definition so the claim path reads one table. Teams live in the control
    # database once shards have servers of their own; the definition belongs to the team.
    team = models.ForeignKey(
        "teams.Team",
        on_delete=models.CASCADE,
        related_name="+",
        db_index=False,
        db_constraint=False,
    )
    queue = models.CharField(max_length=100)
    priority = models.PositiveSmallIntegerField()
    shard = models.PositiveSmallIntegerField()
    state = models.CharField(max_length=16, choices=State.choices, default=State.SCHEDULED)
    trigger = models.CharField(max_length=16, choices=Trigger.choices)
    due_at = models.DateTimeField()
    available_at = models.DateTimeField()
    attempt = models.PositiveIntegerField(default=0)
    max_attempts = models.PositiveIntegerField()
    idempotency_key = models.CharField(max_length=300)
    # The caller's grouping of runs for per-key limits ("one export per customer"). NULL, not
    # '', when the run has none: the API refuses an empty key, and an index of keyed runs can
    # then be partial (WHERE concurrency_key IS NOT NULL).
    concurrency_key = models.CharField(max_length=200, null=True, blank=True)  # noqa: DJ001
    fencing_token = models.BigIntegerField(null=True, blank=True)
    lease_expires_at = models.DateTimeField(null=True, blank=True)
    # The hard deadline of the current attempt: leased at + timeoutSeconds. Heartbeats never pass it.
    timeout_at = models.DateTimeField(null=True, blank=True)
    # What the worker asked for at claim time; each heartbeat extends the lease by as much.
    lease_seconds = models.PositiveIntegerField(default=60)
    worker_id = models.CharField(max_length=200, blank=True, default="")
    # Someone asked to cancel the run while it was leased: its heartbeats answer 409
    # (`…/cancelled`), and whatever its worker reports, or its lease's expiry, ends it cancelled.
    # A default in the database: the store's inserts name only the columns they set.
    cancel_requested = models.BooleanField(default=False, db_default=False)
    # Its definition has a limit (concurrency, per key or rate): the claim takes it through the
    # definition (run_waiting_by_def, run_waiting_limited), and the claim's scan of a queue for
    # everyone else's runs never reads it (run_claimable leads with this column after the lane).
    # Set from the definition at insert (under a key-share lock on it) and rewritten for every
    # unfinished run when the definition's limits come or go (apps/runs/store.py, LIMITED).
    limited = models.BooleanField(default=False, db_default=False)
    dry_run = models.BooleanField(default=False)
    # Inline when small; otherwise NULL and the payload is in storage under payload_key.
    payload = models.JSONField(null=True, blank=True)
    payload_key = models.CharField(max_length=100, blank=True, default="")
    result = models.JSONField(null=True, blank=True)
    last_error = models.JSONField(null=True, blank=True)
    # The last error's group (apps/runs/fingerprints.py) and when that attempt failed: set by
    # the FAIL and REAP statements, read by the failures' grouping (run_failed_by_fingerprint).
    # Left as they were when the run goes on (a later success keeps its last failure's).
    error_fingerprint = models.BigIntegerField(null=True, blank=True)
    failed_at = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    started_at = models.DateTimeField(null=True, blank=True)
    # Seconds from availableAt to the first lease, set once by the claim (lateness alerts).
    late_seconds = models.FloatField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        constraints = [
            # A double insert after a scheduler failover is harmless: one run per cron time.
            models.UniqueConstraint(
                fields=["definition", "due_at"],
                name="run_definition_due_unique",
                condition=models.Q(trigger__in=SCHEDULED_TRIGGERS),
            ),
            models.UniqueConstraint(
                fields=["definition", "idempotency_key"], name="run_definition_key_unique"
            ),
            models.CheckConstraint(
                condition=models.Q(state__in=[s.value for s in State]), name="run_state_valid"
            ),
        ]
        indexes = [
            # The claim: waiting runs of one team, queue and priority, oldest availableAt first.
            # Finished and leased runs leave this index, so it stays the size of the backlog.
            # `id` last, so ORDER BY available_at, id is read off the index without a sort.
            # `state` included so the overview splits the backlog by state from the index alone
            # (reading the rows took 160 ms with 150 000 waiting).
            # `limited` before the time: the claim's scan of a lane for the runs of definitions
            # without limits reads only those (a limited job's backlog of 100 000 at the head of
            # the lane was scanned past on every claim: bench/README.md, "Flow control").
            models.Index(
                fields=["team", "queue", "priority", "limited", "available_at", "id"],
                include=["state"],
                name="run_claimable",
                condition=models.Q(state__in=WAITING_STATES),
            ),
            # The reaper: leases that have expired, and the concurrency count of leased runs.
            models.Index(
                fields=["lease_expires_at"],
                name="run_leased_expiry",
                condition=models.Q(state="leased"),
            ),
            # The claim's runs of a concurrency-limited definition, oldest first.
            models.Index(
                fields=["definition", "available_at", "id"],
                name="run_waiting_by_def",
                condition=models.Q(state__in=WAITING_STATES),
            ),
            models.Index(
                fields=["definition"], name="run_leased_by_def", condition=models.Q(state="leased")
            ),
            # The claim's runs of a definition with a limit per key: its keys are visited one
            # index probe each (a hot key's backlog is never read row by row), then each key's
            # oldest runs. Only runs of limited definitions are written here.
            models.Index(
                fields=["definition", "concurrency_key", "available_at", "id"],
                name="run_waiting_limited",
                condition=models.Q(state__in=WAITING_STATES, limited=True),
            ),
            # Per-key concurrency: the leased runs of one key of a definition. Only keyed runs
            # of leased state: small, and written only by runs that carry a key.
            models.Index(
                fields=["definition", "concurrency_key"],
                name="run_leased_by_key",
                condition=models.Q(state="leased", concurrency_key__isnull=False),
            ),
            # Triage (apps/jobs/triage.py): a team's failed runs grouped by error fingerprint,
            # index-only (the group's jobs and first and last failure are included), and a
            # group's runs newest first. Retrying and dead runs only: a few percent of the table
            # (130 000 failed runs among 1 M grouped in 52 ms: apps/jobs/triage.py).
            models.Index(
                fields=["team", "error_fingerprint", "state", "id"],
                include=["definition", "failed_at"],
                name="run_failed_by_fingerprint",
                condition=models.Q(state__in=("retrying", "dead")),
            ),
            # Listings (API, dashboard): a team's runs newest first, optionally by state.
            models.Index(fields=["team", "state", "-id"], name="run_team_state"),
            models.Index(fields=["definition", "-id"], name="run_definition_recent"),
            # Blob clean-up: "is this payload key still used by a run?"
            models.Index(
                fields=["payload_key"], name="run_payload_key", condition=~models.Q(payload_key="")
            ),
        ]

    def __str__(self) -> str:
        return self.run_id

    def save(self, *args, **kwargs) -> None:
        # The id names the shard, as the store's insert makes it (apps/runs/shards.py).
        if self.pk is None:
            self.pk = next_id(Run, self.shard)
        super().save(*args, **kwargs)

    @property
    def run_id(self) -> str:
        return public_run_id(self.pk)

    def is_late(self) -> bool:
        """Whether the first lease came later after availableAt than the definition's SLO allows."""
        slo = self.definition.lateness_slo_seconds
        return slo is not None and self.late_seconds is not None and self.late_seconds > slo


class Attempt(models.Model):
    """One lease of a run, identified by its fencing token."""

    # Covered by attempt_run_number; one less index to write per lease. Not a constraint in
    # the database: its check at commit locked each run just leased once more, a WAL record per
    # lease, 9 of the 100 µs PostgreSQL spent per run claimed and completed (bench/README.md).
    # Attempts are written by the claim alone, on the run it has just updated and holds; the
    # statements that delete runs delete their attempts after them (apps/runs/retention.py).
    run = models.ForeignKey(
        Run,
        on_delete=models.CASCADE,
        related_name="attempts",
        db_index=False,
        db_constraint=False,
    )
    number = models.PositiveIntegerField()
    # Unique by construction (each lease takes the next value of runs_fencing_token), not by an
    # index: an attempt is found by its run and number (attempt_run_number), and the unique
    # index on the token was a third index written twice per lease (on the insert, and on the
    # attempt's end, an update that moves the row): 6.5 of ~71 µs PostgreSQL spent per run
    # claimed and completed (bench/README.md).
    fencing_token = models.BigIntegerField()
    worker_id = models.CharField(max_length=200, blank=True, default="")
    leased_at = models.DateTimeField()
    last_heartbeat_at = models.DateTimeField(null=True, blank=True)
    ended_at = models.DateTimeField(null=True, blank=True)
    outcome = models.CharField(max_length=16, choices=Outcome.choices, blank=True, default="")
    error_message = models.TextField(blank=True, default="")
    error_type = models.CharField(max_length=200, blank=True, default="")
    # The worker's stack trace (`error.stack`, at most 64 KB), kept per attempt so the run page
    # shows each attempt's error as history. A default in the database: the claim's insert of
    # attempts names only the columns it sets.
    error_stack = models.TextField(blank=True, default="", db_default="")

    class Meta:
        indexes = [models.Index(fields=["run", "number"], name="attempt_run_number")]

    def __str__(self) -> str:
        return f"{self.run_id}#{self.number}"


class MinuteCounts(models.Model):
    """Attempts started and ended per minute, team, queue and priority: what the overview charts.

    Written by the statements that lease, complete, fail and reap (apps/runs/store.py), in the
    same statement, so the overview reads a few thousand rows instead of every attempt of the
    last day. Each web connection adds to one of `counters.SLOTS` rows of a minute, so that
    concurrent batches seldom wait for each other's row lock. `latency` counts first attempts by
    due→start delay, per bucket of `counters.LATENCY_BOUNDS` (the last one: above all bounds).
    """

    minute = models.DateTimeField()
    # No constraint in the database: the team is in the control database (see Run.team).
    team = models.ForeignKey(
        "teams.Team", on_delete=models.CASCADE, db_index=False, db_constraint=False
    )
    queue = models.CharField(max_length=200)
    priority = models.PositiveSmallIntegerField()
    slot = models.PositiveSmallIntegerField()
    started = models.IntegerField(default=0, db_default=0)
    succeeded = models.IntegerField(default=0, db_default=0)
    failed = models.IntegerField(default=0, db_default=0)
    latency = ArrayField(models.IntegerField(), default=list)

    class Meta:
        constraints = [
            # Also the index of the overview's window scans (minute range, then team).
            models.UniqueConstraint(
                fields=["minute", "team", "queue", "priority", "slot"], name="minute_counts_key"
            )
        ]

    def __str__(self) -> str:
        return f"{self.minute:%Y-%m-%d %H:%M} team {self.team_id} {self.queue}/{self.priority}"


class ShardPlacement(models.Model):
    """Where a shard lives when `manage.py moveshard` moved it (control database): it overrides
    `SCHEDULER_SHARD_DATABASES` for that shard; `moving` while the move is under way, when
    new runs of the shard are refused. Every process reads these rows at most a second late
    (`apps.runs.shards.refresh`)."""

    shard = models.PositiveSmallIntegerField(primary_key=True)
    url = models.TextField(blank=True, default="")  # empty: where the map says
    moving = models.BooleanField(default=False)
    # Where the move under way takes the shard: a move that died is finished or undone by
    # the same command, which knows then whose copy the target's rows of the shard are.
    moving_to = models.TextField(blank=True, default="")
    # And where from: after its flip, the rows it kept there for the processes behind are its
    # to delete, wherever the map puts the rest.
    moving_from = models.TextField(blank=True, default="")
    # Until then (two map refreshes past the move's flip) no claim leases the shard's runs
    # in its new database: a process that has not read the move yet would send their
    # results to the old one.
    settles_at = models.DateTimeField(null=True)
    updated_at = models.DateTimeField(auto_now=True)

    def __str__(self) -> str:
        return f"shard {self.shard}{' (moving)' if self.moving else ''}"


class PayloadBlob(models.Model):
    """A payload kept in storage (apps/runs/payloads.py), by its key (control database). A
    writer about to refer to the blob and the deletion of unreferenced blobs both lock its row,
    so that neither misses the other: the writer's lock is held until its rows commit, and the
    deletion looks for rows referring to the blob only under its own."""

    key = models.CharField(max_length=100, primary_key=True)
    placed_at = models.DateTimeField()  # the last time a writer referred to it
    # Found unreferenced, but the storage failed to delete it (or a shard database could not
    # be looked in): retention tries again.
    stranded_at = models.DateTimeField(null=True)

    class Meta:
        indexes = [
            models.Index(
                fields=["stranded_at"],
                condition=models.Q(stranded_at__isnull=False),
                name="payloadblob_stranded",
            )
        ]

    def __str__(self) -> str:
        return self.key


class RateStart(models.Model):
    """One lease started of a rate-limited definition: the sliding window of its `rateLimit`
    counts these (claim, step 2, apps/runs/store.py) and drops those older than the window.
    Lives with the definition, in its shard's database."""

    id = models.BigAutoField(primary_key=True)
    definition_id = models.BigIntegerField()
    started_at = models.DateTimeField()

    class Meta:
        indexes = [
            models.Index(fields=["definition_id", "started_at"], name="ratestart_window"),
        ]

    def __str__(self) -> str:
        return f"definition {self.definition_id} started a lease at {self.started_at}"


class Worker(models.Model):
    """A worker id a team's lease requests named (control database): the queues of its latest
    request, when it last asked for work and when one of its runs last heartbeated. Written at
    most every few seconds per worker and web process (apps/runs/activity.py), read by the
    workers list (apps/runs/workers.py); rows idle for a day are deleted by retention."""

    # The unique constraint below leads with the team: no index of its own.
    team = models.ForeignKey(
        "teams.Team", on_delete=models.CASCADE, related_name="+", db_index=False
    )
    worker_id = models.CharField(max_length=200)
    queues = ArrayField(models.CharField(max_length=100), default=list)
    last_lease_at = models.DateTimeField()
    last_heartbeat_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        constraints = [
            # The upserts' conflict target, and the index of a team's workers list.
            models.UniqueConstraint(fields=["team", "worker_id"], name="worker_team_id_unique")
        ]

    def __str__(self) -> str:
        return f"{self.worker_id} (team {self.team_id})"


class Census(models.Model):
    """The runs of one database counted by team, queue, priority and stored state, as the
    dashboard's overview and queues pages count them (apps/runs/census.py). The scheduler
    replaces all rows every SCHEDULER_CENSUS_SECONDS; the pages read them instead of counting
    when there are too many runs to count on every load. Lives in each shard database."""

    id = models.BigAutoField(primary_key=True)
    # The team's id (it is in the control database); a deleted team's rows go with the next count.
    team_id = models.BigIntegerField()
    queue = models.CharField(max_length=200)  # empty for dead and cancelled runs
    priority = models.PositiveSmallIntegerField()
    state = models.CharField(max_length=16)
    due = models.BigIntegerField()  # waiting runs: availableAt passed; others: all of them
    later = models.BigIntegerField()  # waiting runs with availableAt still ahead
    oldest_due = models.DateTimeField(null=True)
    taken_at = models.DateTimeField()
    seconds = models.FloatField()  # how long the count took

    class Meta:
        indexes = [models.Index(fields=["team_id"], name="census_team")]

    def __str__(self) -> str:
        return f"team {self.team_id} {self.queue}/{self.priority} {self.state}"


class FailureCensus(models.Model):
    """The failed runs (retrying or dead) of one database counted by team, error fingerprint,
    definition and state, as the dashboard's grouped failures show them: taken with `Census`,
    read instead of counting above SCHEDULER_LIVE_COUNT_LIMIT runs (apps/runs/census.py)."""

    id = models.BigAutoField(primary_key=True)
    team_id = models.BigIntegerField()
    fingerprint = models.BigIntegerField(null=True)  # None: runs that failed before fingerprints
    definition_id = models.BigIntegerField()
    state = models.CharField(max_length=16)
    n = models.BigIntegerField()
    first_at = models.DateTimeField(null=True)
    last_at = models.DateTimeField(null=True)
    latest = models.BigIntegerField()  # the newest run's id
    taken_at = models.DateTimeField()
    seconds = models.FloatField()

    class Meta:
        indexes = [models.Index(fields=["team_id"], name="failure_census_team")]

    def __str__(self) -> str:
        return f"team {self.team_id} group {self.fingerprint} {self.state}: {self.n}"
