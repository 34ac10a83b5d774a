"""Turn due definitions into runs, one batch of one shard per transaction.

A definition's `next_due_at` is its next nominal fire time (UTC) that has no run yet; NULL when
nothing more is scheduled. For each due definition the materialiser inserts the runs of its fire
times up to `now + lookahead` and moves `next_due_at` past them, all set-based: one SELECT,
one INSERT (apps.runs.store.insert_runs), one UPDATE per batch.

Fire times the scheduler reaches more than `grace` after they were due are *missed* (the
scheduler was stopped or the database was down): they follow the definition's missedRunPolicy
and are inserted with trigger `catch_up`. The grace is longer than a failover plus a slow tick
can explain, so ordinary lateness never collapses runs. See `grace_for`.
"""

from __future__ import annotations

import json
import logging
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from functools import cached_property
from typing import Any

from django.conf import settings
from django.db import DatabaseError, OperationalError, transaction

from apps.jobs import firetimes
from apps.jobs import schedule as sched
from apps.runs import shards
from apps.runs.clock import format_utc
from apps.runs.models import Trigger
from apps.runs.store import NewRun, array_literal, atomic, insert_runs, server_cursor

log = logging.getLogger(__name__)

# The lease must still be ours, with our epoch, for the whole transaction: FOR SHARE keeps a
# taker's UPDATE of the row waiting until we commit, so its first materialisation sees our writes.
LOCK_LEASE = """
SELECT 1 FROM scheduler_shardlease
WHERE shard = %(shard)s AND owner = %(node)s AND epoch = %(epoch)s AND expires_at > now()
FOR SHARE
"""

# Served by the partial index job_due_by_shard (shard, next_due_at) WHERE NOT paused AND
# next_due_at IS NOT NULL. SKIP LOCKED: a definition being edited is taken next tick instead of
# stalling the shard behind the editor's transaction.
SELECT_DUE = """
SELECT id, name, schedule::text, next_due_at FROM jobs_jobdefinition
WHERE shard = %(shard)s AND NOT paused AND next_due_at IS NOT NULL AND next_due_at <= %(horizon)s
ORDER BY next_due_at
LIMIT %(batch)s
FOR UPDATE OF jobs_jobdefinition SKIP LOCKED
"""

# One statement moves every definition of the batch; the note is kept unless a new one is set.
# The arrays arrive as array literals (see store.array_literal). Served by the primary key: the
# redundant `d.id = ANY(…)` makes the planner fetch the batch's rows by key instead of hashing
# the whole table for the join, which it otherwise does for a few thousand ids.
ADVANCE = """
UPDATE jobs_jobdefinition d
SET next_due_at = u.next_due_at, missed_runs_note = coalesce(u.note, d.missed_runs_note)
FROM unnest(%(ids)s::bigint[], %(next_due_ats)s::timestamptz[], %(notes)s::text[])
     AS u(id, next_due_at, note)
WHERE d.id = u.id AND d.id = ANY(%(ids)s::bigint[])
"""

# A definition whose schedule cannot be computed is retried this much later, so one bad row
# costs a log line now and then instead of failing every tick.
BAD_DEFINITION_RETRY = timedelta(minutes=10)
# Cron fields are whole minutes, so one second before a fire time is strictly between it and the
# previous one: "(next_due_at - 1 s, …]" includes next_due_at exactly when it is a fire time.
JUST_BEFORE = timedelta(seconds=1)
TINY = timedelta(microseconds=1)
SCAN_CHUNK = 1000


def grace_for(tick_seconds: float, lease_seconds: float) -> timedelta:
    """Return how late a fire time may be materialised before it counts as missed.

    A lease TTL (a dead owner's shards wait that long for a new owner) plus two ticks (the tick in
    progress and the next) plus 5 s of slack for a slow database. Anything later means the
    scheduler was not running.
    """
    return timedelta(seconds=lease_seconds + 2 * tick_seconds + 5)


@dataclass(frozen=True)
class Slot:
    """One fire time to insert: when (nominal), its local form for the key, and the trigger."""

    utc: datetime
    local: datetime
    trigger: str
    # When the run may start, if not at `utc` plus jitter (a one-off long past: see below).
    start: datetime | None = None

    @cached_property
    def local_iso(self) -> str:
        # A plan is shared by every definition with the same schedule and due time: the key's
        # time is formatted once for all of them.
        return self.local.isoformat()


def _slot(fire: firetimes.FireTime, trigger: str) -> Slot:
    return Slot(fire.utc, fire.local, trigger)


@dataclass(frozen=True)
class Plan:
    """What to write for one definition: runs, its new next_due_at, and a note if capped."""

    slots: tuple[Slot, ...]
    next_due_at: datetime | None
    jitter_seconds: int = 0
    note: str | None = None


@dataclass
class BatchResult:
    """What one materialiser step did."""

    lease_held: bool = True
    definitions: int = 0
    inserted: int = 0
    bad: list[str] = field(default_factory=list)
    full: bool = False


def _latest(
    schedule: sched.CronSchedule, after: datetime, until: datetime, n: int
) -> tuple[list[firetimes.FireTime], bool]:
    """Return the latest `n` fire times in (after, until] and whether earlier ones exist.

    1. Look back from `until` over a window of one hour, doubling it until the window holds more
       than `n` times or reaches `after`: the cost follows what is kept, not how long the outage
       was (a minutely job stopped for a year is not walked minute by minute).
    2. Scan each window forwards in chunks, keeping only the last n + 1 times.
    """
    span = timedelta(hours=1)
    while True:
        start = max(after, until - span)
        window: deque[firetimes.FireTime] = deque(maxlen=n + 1)
        cursor = start
        while True:
            chunk = firetimes.fire_times_between(schedule, cursor, until, SCAN_CHUNK)
            window.extend(chunk)
            if len(chunk) < SCAN_CHUNK:
                break
            cursor = chunk[-1].utc
        if len(window) > n:
            return list(window)[-n:], True
        if start == after:
            return list(window), False
        span *= 2


def plan_cron(
    name: str,
    schedule: sched.CronSchedule,
    next_due_at: datetime,
    *,
    now: datetime,
    horizon: datetime,
    grace: timedelta,
    missed_cap: int,
) -> Plan:
    """Return the runs of a cron definition due by `horizon`, and its next due time.

    1. Times in [next_due_at, now - grace) are missed: run_once keeps the latest, run_all the
       latest `missed_cap` (noting the cap), skip none; all are `catch_up` runs.
    2. Times in [max(next_due_at, now - grace), horizon] are ordinary `cron` runs.
    3. The next due time is the first fire time after horizon (None if the cron never fires again).
    """
    start = next_due_at - JUST_BEFORE
    cutoff = now - grace
    slots: list[Slot] = []
    note = None
    if next_due_at < cutoff and schedule.missed_run_policy != "skip":
        keep = 1 if schedule.missed_run_policy == "run_once" else max(missed_cap, 1)
        missed, more = _latest(schedule, start, cutoff - TINY, keep)
        if more and schedule.missed_run_policy == "run_all" and missed:
            note = (
                f"Missed runs from {format_utc(next_due_at)} exceeded the cap of {keep}; "
                f"only the latest {keep} (from {missed[0].local.isoformat()}) were inserted "
                f"on {format_utc(now.replace(microsecond=0))}."
            )
        slots.extend(_slot(f, Trigger.CATCH_UP) for f in missed)
    upcoming_after = max(start, cutoff - TINY)
    # Lookahead is seconds to minutes and cron fires at most once a minute: the limit never binds
    # in practice, and if it did the rest would simply come next tick.
    upcoming = firetimes.fire_times_between(schedule, upcoming_after, horizon, SCAN_CHUNK)
    slots.extend(_slot(f, Trigger.CRON) for f in upcoming)
    if len(upcoming) == SCAN_CHUNK:
        following = upcoming[-1].utc + TINY
    else:
        nxt = firetimes.next_fire_times(schedule, horizon, 1)
        following = nxt[0].utc if nxt else None
    return Plan(tuple(slots), following, schedule.jitter_seconds, note)


def plan_definition(
    name: str,
    schedule: sched.Schedule,
    next_due_at: datetime,
    *,
    now: datetime,
    horizon: datetime,
    grace: timedelta,
    missed_cap: int,
) -> Plan:
    """Return what to insert for one due definition (see plan_cron for cron schedules).

    One-off and delayed schedules have a single run at next_due_at (even if late: the README says a
    past runAt runs at once), then nothing more; no schedule means nothing to insert.
    """
    if isinstance(schedule, sched.CronSchedule):
        return plan_cron(
            name,
            schedule,
            next_due_at,
            now=now,
            horizon=horizon,
            grace=grace,
            missed_cap=missed_cap,
        )
    if isinstance(schedule, sched.OneOffSchedule | sched.DelayedSchedule):
        due = next_due_at.astimezone(UTC)
        # A runAt further back than the run-time window (a one-off of 1970) keeps its nominal
        # dueAt but becomes available now: counted from 1970 it would be decades late in every
        # lateness figure of its queue.
        floor = now - timedelta(seconds=settings.SCHEDULER_RUN_AT_PAST_SECONDS)
        return Plan((Slot(due, due, Trigger.CRON, start=now if due < floor else None),), None)
    return Plan((), None)


class _PlanCache:
    """Plan each distinct (schedule, due time) once per batch.

    Fleets share a few popular schedules and due times ("0 * * * *" at the top of the hour):
    plans depend on nothing else (names only enter in _runs_for), so those definitions share
    the parsing and the fire-time maths. A schedule that fails to parse fails once per batch.
    """

    def __init__(self, **context: Any) -> None:
        self._context = context
        self._parsed: dict[str, sched.Schedule | Exception] = {}
        self._plans: dict[tuple[str, datetime], Plan] = {}

    def plan(self, name: str, text: str, due_at: datetime) -> Plan:
        # `text`: the schedule as SELECT_DUE reads it; jsonb text is canonical, so equal
        # schedules are equal keys.
        parsed = self._parsed.get(text)
        if parsed is None:
            try:
                parsed = sched.parse_schedule(json.loads(text))
            except Exception as exc:  # noqa: BLE001 - remembered, re-raised for each user
                parsed = exc
            self._parsed[text] = parsed
        if isinstance(parsed, Exception):
            raise parsed
        plan = self._plans.get((text, due_at))
        if plan is None:
            plan = plan_definition(name, parsed, due_at, **self._context)
            self._plans[(text, due_at)] = plan
        return plan


def _runs_for(definition_id: int, name: str, plan: Plan) -> list[NewRun]:
    jitter = timedelta(seconds=sched.jitter_offset(name, plan.jitter_seconds))
    return [
        NewRun(
            definition_id=definition_id,
            trigger=slot.trigger,
            due_at=slot.utc,
            available_at=slot.start or slot.utc + jitter,
            idempotency_key=sched.idempotency_key(name, slot.local_iso),
        )
        for slot in plan.slots
    ]


def _insert_isolating(groups: Sequence[tuple[int, str, list[NewRun]]]) -> tuple[int, set[int]]:
    """Insert all groups' runs at once; if that fails, one group at a time to find the bad rows.

    Return (runs inserted, ids of definitions whose runs could not be inserted). An
    OperationalError (a cancelled or timed-out statement, a deadlock, a lost connection) says
    nothing about the rows: it is raised, so the tick fails, commits nothing, and the next tick
    tries again. Pushing next_due_at forward for it would skip those fire times for good.
    """
    everything = [run for _, _, runs in groups for run in runs]
    try:
        with atomic():
            return len(insert_runs(everything)), set()
    except OperationalError:
        raise
    except DatabaseError:
        log.exception(
            "bulk insert of %d runs failed; retrying definition by definition", len(everything)
        )
    inserted, failed = 0, set()
    for definition_id, name, runs in groups:
        try:
            with atomic():
                inserted += len(insert_runs(runs))
        except OperationalError:
            raise
        except DatabaseError:
            log.exception("cannot insert runs of %s; retrying it in %s", name, BAD_DEFINITION_RETRY)
            failed.add(definition_id)
    return inserted, failed


def materialise_batch(
    *,
    shard: int,
    node: str,
    epoch: int,
    now: datetime,
    lookahead: timedelta,
    grace: timedelta,
    missed_cap: int,
    batch: int,
) -> BatchResult:
    """Materialise up to `batch` due definitions of one shard, in one transaction.

    1. Check (FOR SHARE) that this node still holds the shard with this epoch; if not, write nothing.
    2. Lock the due definitions (next_due_at <= now + lookahead), oldest first, skipping locked ones.
    3. Plan each in Python; a definition whose schedule raises is pushed BAD_DEFINITION_RETRY ahead.
    4. Insert every run with one insert_runs call, then advance every next_due_at with one UPDATE.
    `now` is the database clock read once per tick. `full` says a full batch was taken: call again.
    """
    horizon = now + lookahead
    result = BatchResult()
    plans = _PlanCache(now=now, horizon=horizon, grace=grace, missed_cap=missed_cap)
    # Prepared statements and psycopg's C timestamp loader (see store.server_cursor). The lease
    # is checked in the control database, whose transaction stays open (and the lease locked)
    # until the shard's database has committed.
    with (
        shards.using(shards.CONTROL),
        transaction.atomic(using=shards.CONTROL),
        server_cursor() as control,
    ):
        control.execute(LOCK_LEASE, {"shard": shard, "node": node, "epoch": epoch})
        if control.fetchone() is None:
            result.lease_held = False
            return result
        with (
            shards.using(shards.alias_of_shard(shard)),
            atomic(savepoint=False),
            server_cursor() as cursor,
        ):
            cursor.execute(SELECT_DUE, {"shard": shard, "horizon": horizon, "batch": batch})
            rows = cursor.fetchall()
            result.definitions = len(rows)
            result.full = len(rows) == batch
            if not rows:
                return result

            groups: list[tuple[int, str, list[NewRun]]] = []
            ids: list[int] = []
            next_due: list[datetime | None] = []
            notes: list[str | None] = []
            retry_at = now + BAD_DEFINITION_RETRY
            for definition_id, name, raw_schedule, due_at in rows:
                try:
                    plan = plans.plan(name, raw_schedule, due_at)
                    runs = _runs_for(definition_id, name, plan)
                except Exception:  # noqa: BLE001 - one bad definition must not stop the shard
                    log.exception(
                        "cannot compute the schedule of %s (id %s); next try at %s",
                        name,
                        definition_id,
                        retry_at.isoformat(),
                    )
                    result.bad.append(name)
                    ids.append(definition_id)
                    next_due.append(retry_at)
                    notes.append(None)
                    continue
                if plan.note:
                    log.warning("%s: %s", name, plan.note)
                groups.append((definition_id, name, runs))
                ids.append(definition_id)
                next_due.append(plan.next_due_at)
                notes.append(plan.note)

            result.inserted, failed = _insert_isolating(groups)
            if failed:
                for index, definition_id in enumerate(ids):
                    if definition_id in failed:
                        next_due[index] = retry_at
                        notes[index] = None
                result.bad.extend(
                    name for definition_id, name, _ in groups if definition_id in failed
                )
            cursor.execute(
                ADVANCE,
                {
                    "ids": array_literal(ids),
                    "next_due_ats": array_literal(next_due),
                    "notes": array_literal(notes),
                },
            )
    return result
