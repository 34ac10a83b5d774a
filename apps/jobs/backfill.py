"""Backfill: a run for every cron time of a past range, once each, previewed before it is made."""

from __future__ import annotations

from dataclasses import dataclass, replace
from datetime import datetime, timedelta

from django.conf import settings

from apps.audit.record import Actor, record
from apps.jobs import firetimes
from apps.jobs import schedule as sched
from apps.jobs.models import JobDefinition, database_of, database_to_write
from apps.runs import shards
from apps.runs.clock import database_now
from apps.runs.models import SCHEDULED_TRIGGERS, Run
from apps.runs.store import NewRun, insert_runs


class BackfillError(ValueError):
    def __init__(self, errors: dict[str, str]) -> None:
        super().__init__("; ".join(f"{key}: {reason}" for key, reason in errors.items()))
        self.errors = errors


# A bound at the very ends of what a datetime holds, where fire times cannot be computed.
AT_THE_ENDS_OF_TIME = (
    "The range reaches the first or last instants a time can hold (in 0001-01-01 or "
    "9999-12-31, in the zone of the schedule): fire times cannot be computed there."
)


@dataclass(frozen=True)
class BackfillPlan:
    times: list[firetimes.FireTime]
    existing: int  # cron times in the range that already have a run
    capped: bool
    # Where it stops: the `to` asked for, now when that is ahead, or the cap's last time.
    until: datetime

    @property
    def new(self) -> int:
        return len(self.times) - self.existing


def plan(definition: JobDefinition, start: datetime, end: datetime) -> BackfillPlan:
    """Return the cron times in [start, end] and how many already have a run.

    1. Refuse a definition without a cron schedule, or a range that ends before it starts or
       starts in the future; one that runs past now stops at now (`until`).
    2. List the fire times (start inclusive, end inclusive), up to the cap plus one; past the
       cap, it stops at the cap's last time (`until`).
    3. Count those that a run already covers: a scheduled run of the time ((definition, due
       time) is unique), or any run holding the time's key ((definition, key) is unique: the
       insert would skip the time).
    """
    schedule = sched.parse_schedule(definition.schedule)
    if not isinstance(schedule, sched.CronSchedule):
        raise BackfillError({"schedule": "Only cron jobs can be backfilled."})
    if start.tzinfo is None or end.tzinfo is None:
        raise BackfillError({"from": "Give times with an offset or Z."})
    if end < start:
        raise BackfillError({"to": "Must not be before from."})
    now = database_now()
    if start > now:
        # The schedule makes the runs ahead (catch-up covers an outage): a backfill is for the
        # past. A range that runs into the future stops at now.
        raise BackfillError({"from": "A backfill is for the past: from must not be ahead."})
    end = min(end, now)
    cap = settings.SCHEDULER_BACKFILL_CAP
    try:
        times = firetimes.fire_times_between(
            schedule, start - timedelta(microseconds=1), end, cap + 1
        )
    except OverflowError as exc:  # a bound at the very ends of datetime's range
        raise BackfillError({"from": AT_THE_ENDS_OF_TIME}) from exc
    capped = len(times) > cap
    times = times[:cap]
    if capped:
        # The range's end said "done up to `to`" of one that stopped 3 days short of it.
        end = times[-1].utc
    # The trigger filter lets the partial unique index on (definition, due time) answer the
    # first; the unique (definition, idempotency key) index the second.
    existing = 0
    if times:
        with shards.reaching(database_of(definition.name)):
            runs = Run.objects.filter(definition=definition)
            at_times = runs.filter(
                trigger__in=SCHEDULED_TRIGGERS, due_at__in=[t.utc for t in times]
            ).values_list("due_at", flat=True)
            keys = {sched.idempotency_key(definition.name, t.local): t.utc for t in times}
            holding = runs.filter(idempotency_key__in=list(keys)).values_list(
                "idempotency_key", flat=True
            )
            existing = len(set(at_times) | {keys[key] for key in holding})
    return BackfillPlan(times, existing, capped, end)


def run_backfill(
    definition: JobDefinition, start: datetime, end: datetime, actor: Actor
) -> tuple[BackfillPlan, int]:
    """Create the planned runs (deduplicated on definition and due time); return (plan, created)."""
    backfill = plan(definition, start, end)
    jitter = timedelta(
        seconds=sched.jitter_offset(
            definition.name, sched.parse_schedule(definition.schedule).jitter_seconds
        )
    )
    runs = [
        NewRun(
            definition.pk,
            "backfill",
            t.utc,
            t.utc + jitter,
            sched.idempotency_key(definition.name, t.local),
        )
        for t in backfill.times
    ]
    with shards.writing(database_to_write(definition.name)):
        created = len(insert_runs(runs))
        # What the insert found, not what the plan counted before it: the same backfill sent
        # twice at once answered "5 473 new" over none created (the other had made them).
        backfill = replace(backfill, existing=len(backfill.times) - created)
        record(
            actor,
            "job.backfill",
            team=definition.team,
            target_type="job",
            target=definition.name,
            after={
                "from": start.isoformat(),
                "to": backfill.until.isoformat(),
                "created": created,
                "capped": backfill.capped,
            },
        )
    return backfill, created
