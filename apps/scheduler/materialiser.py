"""Turn due definitions into runs, one batch of one shard per transaction.

A definition's `next_due_at` is its next nominal fire time (UTC) that has no run yet; NULL when
nothing more is scheduled. For each due definition the materialiser inserts the runs of its fire
times up to `now + lookahead` and moves `next_due_at` past them, all set-based: one SELECT,
one INSERT (apps.runs.store.insert_runs), one UPDATE per batch, and a statement or two more
when the batch holds definitions with an overlap policy.

Fire times the scheduler reaches more than `grace` after they were due are *missed* (the
scheduler was stopped or the database was down): they follow the definition's missedRunPolicy
and are inserted with trigger `catch_up`. The grace is longer than a failover plus a slow tick
can explain, so ordinary lateness never collapses runs. See `grace_for`.

A cron schedule's overlapPolicy judges each fire time against the definition's runs that are
not finished, whatever created them (cron, catch-up, API, dashboard, backfill): *waiting*
(scheduled, ready, retrying: WAITING_STATES) or *leased*. See `keep_slots` for what each policy
keeps, and OVERLAPPING / LOCK_OTHERS for why the judgement holds against concurrent claims.
A definition with a policy other than allow_all is materialised at its fire time, not up to
the lookahead ahead of it: ahead of time its runs would be judged against runs still running.
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
from django.db.backends.utils import CursorWrapper

from apps.audit.record import TARGETS_SHOWN, Actor, record
from apps.jobs import firetimes
from apps.jobs import schedule as sched
from apps.jobs.services import initial_next_due_at
from apps.runs import shards
from apps.runs.clock import format_utc
from apps.runs.ids import public_run_id
from apps.runs.models import Trigger
from apps.runs.store import NewRun, array_literal, atomic, insert_runs, server_cursor
from apps.runs.transitions import CANCEL
from apps.teams.models import Team

log = logging.getLogger(__name__)

# The lease must still be ours, with our epoch, for the whole transaction: FOR SHARE keeps a
# taker's UPDATE of the row waiting until we commit, so its first materialisation sees our writes.
LOCK_LEASE = """
SELECT 1 FROM scheduler_shardlease
WHERE shard = %(shard)s AND owner = %(node)s AND epoch = %(epoch)s AND expires_at > now()
FOR SHARE
"""

# The paused queues (control database; a handful of rows): their definitions make no runs.
# And those resumed while a shard database was down (`rearm_from`; fewer still): a definition
# of theirs armed before that time and still due before it is restarted from it, as the resume
# would have done (one due after it was armed since, or came into the queue since: its own).
PAUSED_QUEUES = """
SELECT team_id, name, paused, rearm_from FROM jobs_queue WHERE paused OR rearm_from IS NOT NULL
"""

# Served by the partial index job_due_by_shard (shard, next_due_at) WHERE NOT paused AND
# next_due_at IS NOT NULL; the definitions of paused queues are filtered from what it finds
# (they stay due, and are walked past, until their queue resumes and restarts them). SKIP LOCKED: a definition being edited is taken next tick instead of
# stalling the shard behind the editor's transaction. NO KEY UPDATE, which an edit's FOR UPDATE
# still excludes, but an insert of the definition's runs (FOR KEY SHARE, apps/runs/store.py)
# does not: a definition that producers enqueue to all the time is never passed over. A
# definition with an overlap policy is
# due at its fire time, not within the lookahead (module docstring); the test of its schedule
# filters rows the index found.
SELECT_DUE = """
SELECT d.id, d.name, d.schedule::text, d.next_due_at, rearm.at AS rearm_from
FROM jobs_jobdefinition d
LEFT JOIN unnest(%(rearm_teams)s::bigint[], %(rearm_queues)s::text[],
                 %(rearm_ats)s::timestamptz[]) AS rearm(team_id, queue, at)
     ON rearm.team_id = d.team_id AND rearm.queue = d.queue
    AND coalesce(d.armed_at, d.created_at) < rearm.at AND d.next_due_at < rearm.at
WHERE d.shard = %(shard)s AND NOT d.paused AND d.next_due_at IS NOT NULL
  AND d.next_due_at <= %(horizon)s
  AND (d.next_due_at <= %(now)s OR coalesce(d.schedule ->> 'overlapPolicy', 'allow_all') = 'allow_all')
  AND (d.team_id, d.queue) NOT IN (
      SELECT * FROM unnest(%(paused_teams)s::bigint[], %(paused_queues)s::text[]))
ORDER BY d.next_due_at
LIMIT %(batch)s
FOR NO KEY UPDATE OF d SKIP LOCKED
"""

# skip and buffer_one: does the definition have a waiting run, a leased one? Each EXISTS is one
# probe of a partial index, run_waiting_by_def (definition_id, …) WHERE state IN the waiting
# states, or run_leased_by_def (definition_id) WHERE state = 'leased', stopping at the first
# entry. Race-free without locking the runs: the definitions are locked (SELECT_DUE), so no other
# materialiser adds to them, and claim, heartbeat, complete, fail and the reaper only move a
# run from waiting to leased, between leased and retrying, or out to a finished state. So what
# this snapshot finds absent stays absent until we commit, except a failure sending the leased
# run back to retrying: for buffer_one that retry then waits beside the buffered run, exactly
# as if it had failed a moment after our commit. (Runs created through the API or the
# dashboard, and a DLQ requeue, are not serialised with the materialiser: README.)
OVERLAPPING = """
SELECT d.id,
       EXISTS (SELECT FROM runs_run r WHERE r.definition_id = d.id
               AND r.state IN ('scheduled', 'ready', 'retrying')) AS waiting,
       EXISTS (SELECT FROM runs_run r WHERE r.definition_id = d.id
               AND r.state = 'leased') AS leased
FROM unnest(%(ids)s::bigint[]) AS d(id)
"""

# cancel_other, step 1: the definition's runs to cancel (waiting) or to ask to stop (leased,
# not asked yet), all but the run of the fire time itself (its key: after a failover it may
# exist already), found through run_waiting_by_def and run_leased_by_def (one branch each: an OR
# of both states would walk every run of the definition by run_definition_key_unique). They are
# locked with SKIP LOCKED, and every run found is answered with whether we hold it now. We hold
# the definition, and a claim of a limited definition takes its runs before the definition
# (store.py, step 2): waiting for a run's lock here could deadlock with it. So a definition with
# a run that another transaction holds (a claim, a heartbeat, a report; or a run that finished
# meanwhile) is left whole to the next tick. FOR UPDATE re-reads each row in its latest
# version: a run leased by a claim that committed after our snapshot is locked as leased.
# Step 2 is the cancel people ask for (apps.runs.transitions.CANCEL), on the runs locked here: a
# waiting run ends cancelled now; a leased one is told at its next heartbeat and ends cancelled
# when its worker reports or its lease expires.
LOCK_OTHERS = """
WITH k AS (
    SELECT * FROM unnest(%(ids)s::bigint[], %(keys)s::text[]) AS k(definition_id, idempotency_key)
), found AS (
    SELECT r.id, r.definition_id, r.team_id
    FROM k JOIN runs_run r ON r.definition_id = k.definition_id
    WHERE r.state IN ('scheduled', 'ready', 'retrying') AND r.idempotency_key <> k.idempotency_key
    UNION ALL
    SELECT r.id, r.definition_id, r.team_id
    FROM k JOIN runs_run r ON r.definition_id = k.definition_id
    WHERE r.state = 'leased' AND NOT r.cancel_requested AND r.idempotency_key <> k.idempotency_key
), held AS (
    SELECT r.id FROM runs_run r
    WHERE r.id IN (SELECT id FROM found)
      AND (r.state IN ('scheduled', 'ready', 'retrying')
           OR (r.state = 'leased' AND NOT r.cancel_requested))
    FOR UPDATE SKIP LOCKED
)
SELECT f.definition_id, f.id, f.team_id, h.id IS NOT NULL
FROM found f LEFT JOIN held h ON h.id = f.id
"""
# One statement moves every definition of the batch; the note is kept unless a new one is set.
# The arrays arrive as array literals (see store.array_literal). Served by the primary key: the
# redundant `d.id = ANY(…)` makes the planner fetch the batch's rows by key instead of hashing
# the whole table for the join, which it otherwise does for a few thousand ids.
ADVANCE = """
UPDATE jobs_jobdefinition d
SET next_due_at = u.next_due_at, missed_runs_note = coalesce(u.note, d.missed_runs_note),
    armed_at = coalesce(u.armed_at, d.armed_at)
FROM unnest(%(ids)s::bigint[], %(next_due_ats)s::timestamptz[], %(notes)s::text[],
            %(armed_ats)s::timestamptz[])
     AS u(id, next_due_at, note, armed_at)
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
    overlap_policy: str = sched.DEFAULT_OVERLAP_POLICY


@dataclass
class BatchResult:
    """What one materialiser step did."""

    lease_held: bool = True
    definitions: int = 0
    inserted: int = 0
    bad: list[str] = field(default_factory=list)
    full: bool = False
    # Fire times an overlap policy left without a run, and runs cancel_other cancelled or asked
    # to stop.
    skipped: int = 0
    cancelled: int = 0


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
       latest `missed_cap` (noting the cap; with skip or buffer_one, which run the first
       alone, the first before them), skip none; all are `catch_up` runs.
    2. Times in [max(next_due_at, now - grace), horizon] are ordinary `cron` runs; with an
       overlap policy other than allow_all, horizon is `now` (judged at the fire time).
    3. The next due time is the first fire time after horizon (None if the cron never fires again).
    """
    overlapping = schedule.overlap_policy != sched.DEFAULT_OVERLAP_POLICY
    if overlapping:
        horizon = min(horizon, now)
    start = next_due_at - JUST_BEFORE
    cutoff = now - grace
    slots: list[Slot] = []
    note = None
    if next_due_at < cutoff and schedule.missed_run_policy != "skip":
        keep = 1 if schedule.missed_run_policy == "run_once" else max(missed_cap, 1)
        missed, more = _latest(schedule, start, cutoff - TINY, keep)
        capped = more and schedule.missed_run_policy == "run_all"
        if capped and schedule.overlap_policy in ("skip", "buffer_one"):
            # These run the first missed time alone (it overlaps the rest: keep_slots), past
            # the cap too: it leads the slots.
            missed = firetimes.fire_times_between(schedule, start, cutoff - TINY, 1) + missed
        # Noted where the cap kept runs out: with an overlap policy one run is inserted anyway.
        if capped and missed and not overlapping:
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
    return Plan(tuple(slots), following, schedule.jitter_seconds, note, schedule.overlap_policy)


def keep_slots(
    policy: str, slots: tuple[Slot, ...], *, waiting: bool, leased: bool
) -> tuple[Slot, ...]:
    """Return the slots an overlap policy keeps, given whether the definition has a waiting
    run and a leased one. The slots are judged in order, each seeing the runs the earlier ones
    made (a catch-up after an outage: the first run inserted makes the later times overlap):

    - allow_all: every slot.
    - skip: the first, if no run is waiting or leased; else none.
    - buffer_one: the first, if no run is waiting (a leased one may be running); else none.
    - cancel_other: the last; each would cancel the one before. The caller cancels the
      definition's other waiting runs and asks its leased ones to stop.
    """
    if not slots or policy == "allow_all":
        return slots
    if policy == "skip":
        return () if waiting or leased else slots[:1]
    if policy == "buffer_one":
        return () if waiting else slots[:1]
    if policy == "cancel_other":
        return slots[-1:]
    raise ValueError(f"unknown overlap policy {policy!r}")


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


def _runs_for(definition_id: int, name: str, slots: tuple[Slot, ...], plan: Plan) -> list[NewRun]:
    jitter = timedelta(seconds=sched.jitter_offset(name, plan.jitter_seconds))
    return [
        NewRun(
            definition_id=definition_id,
            trigger=slot.trigger,
            due_at=slot.utc,
            available_at=slot.start or slot.utc + jitter,
            idempotency_key=sched.idempotency_key(name, slot.local_iso),
        )
        for slot in slots
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


def _overlap_kept(
    cursor: CursorWrapper, planned: Sequence[tuple[int, str, Plan]]
) -> dict[int, tuple[Slot, ...]]:
    """Return the slots that skip and buffer_one keep, by definition id (the others keep all:
    cancel_other's are cut by keep_slots alone). One statement (OVERLAPPING) for the batch."""
    judged = {
        definition_id: plan
        for definition_id, _, plan in planned
        if plan.slots and plan.overlap_policy in ("skip", "buffer_one")
    }
    kept = {
        definition_id: keep_slots(plan.overlap_policy, plan.slots, waiting=False, leased=False)
        for definition_id, _, plan in planned
        if plan.slots and plan.overlap_policy == "cancel_other"
    }
    if judged:
        cursor.execute(OVERLAPPING, {"ids": array_literal(sorted(judged))})
        for definition_id, waiting, leased in cursor.fetchall():
            plan = judged[definition_id]
            kept[definition_id] = keep_slots(
                plan.overlap_policy, plan.slots, waiting=waiting, leased=leased
            )
    return kept


def _log_skipped(name: str, plan: Plan, kept: tuple[Slot, ...], result: BatchResult) -> None:
    """Count and log (info) the fire times an overlap policy left without a run."""
    skipped = [slot for slot in plan.slots if slot not in kept]
    if skipped:
        result.skipped += len(skipped)
        log.info(
            "%s: overlapPolicy %s: no run for %s",
            name,
            plan.overlap_policy,
            ", ".join(format_utc(slot.utc) for slot in skipped),
        )


def _cancel_others(
    cursor: CursorWrapper, cancelling: Sequence[tuple[int, str, NewRun]], result: BatchResult
) -> set[int]:
    """cancel_other: cancel each definition's other waiting runs and ask its leased ones to stop,
    in the transaction that inserts its new run; audit one event per definition that had any.

    Return the ids of the definitions left to the next tick (a run of theirs was held by another
    transaction, see LOCK_OTHERS): nothing of theirs is changed or inserted now.
    """
    cursor.execute(
        LOCK_OTHERS,
        {
            "ids": array_literal([definition_id for definition_id, _, _ in cancelling]),
            "keys": array_literal([run.idempotency_key for _, _, run in cancelling]),
        },
    )
    found = cursor.fetchall()
    postponed = {definition_id for definition_id, _, _, held in found if not held}
    chosen = {
        run_id: (definition_id, team_id)
        for definition_id, run_id, team_id, _ in found
        if definition_id not in postponed
    }
    names = {definition_id: (name, run) for definition_id, name, run in cancelling}
    for definition_id in sorted(postponed):
        log.info(
            "%s: overlapPolicy cancel_other found a run held by another transaction; "
            "its fire time is left to the next tick",
            names[definition_id][0],
        )
    if not chosen:
        return postponed
    cursor.execute(CANCEL, {"ids": array_literal(sorted(chosen))})
    changed: dict[int, list[tuple[int, int, str]]] = {}
    for run_id, _, state in cursor.fetchall():
        definition_id, team_id = chosen[run_id]
        changed.setdefault(definition_id, []).append((run_id, team_id, state))
    result.cancelled += sum(len(runs) for runs in changed.values())
    # The audit trail is in the control database, whose transaction is open around this one.
    teams = Team.objects.in_bulk({runs[0][1] for runs in changed.values()})
    for definition_id, runs in sorted(changed.items()):
        name, new_run = names[definition_id]
        run_ids = sorted(run_id for run_id, _, _ in runs)
        cancelled = sum(1 for _, _, state in runs if state == "cancelled")
        log.info(
            "%s: overlapPolicy cancel_other cancelled %d waiting run%s and asked %d leased to "
            "stop, for the run due %s",
            name,
            cancelled,
            "" if cancelled == 1 else "s",
            len(runs) - cancelled,
            format_utc(new_run.due_at),
        )
        record(
            Actor.system("scheduler"),
            "job.overlap_cancel",
            team=teams.get(runs[0][1]),
            target_type="job",
            target=name,
            after={
                "overlapPolicy": "cancel_other",
                "dueAt": format_utc(new_run.due_at),
                "cancelled": cancelled,
                "cancelRequested": len(runs) - cancelled,
                "runIds": [public_run_id(run_id) for run_id in run_ids[:TARGETS_SHOWN]],
            },
        )
    return postponed


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
    2. Lock the due definitions (next_due_at <= now + lookahead; <= now with an overlap policy),
       oldest first, skipping locked ones.
    3. Plan each in Python; a definition whose schedule raises is pushed BAD_DEFINITION_RETRY ahead.
    4. Apply the overlap policies: skip and buffer_one read the definitions' runs (one
       statement), cancel_other cancels the others (two; a definition whose runs another
       transaction holds keeps its next_due_at for the next tick).
    5. Insert every run with one insert_runs call, then advance every next_due_at with one UPDATE.
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
        control.execute(PAUSED_QUEUES)
        queues = control.fetchall()
        paused = [(team, queue) for team, queue, held, _ in queues if held]
        rearmed = [(team, queue, at) for team, queue, held, at in queues if at and not held]
        with (
            shards.using(shards.alias_of_shard(shard)),
            atomic(savepoint=False),
            server_cursor() as cursor,
        ):
            cursor.execute(
                SELECT_DUE,
                {
                    "shard": shard,
                    "now": now,
                    "horizon": horizon,
                    "batch": batch,
                    "paused_teams": [team for team, _ in paused],
                    "paused_queues": [queue for _, queue in paused],
                    "rearm_teams": [team for team, _, _ in rearmed],
                    "rearm_queues": [queue for _, queue, _ in rearmed],
                    "rearm_ats": [at for _, _, at in rearmed],
                },
            )
            rows = cursor.fetchall()
            result.definitions = len(rows)
            result.full = len(rows) == batch
            if not rows:
                return result

            planned: list[tuple[int, str, Plan]] = []
            ids: list[int] = []
            next_due: list[datetime | None] = []
            notes: list[str | None] = []
            armed: list[datetime | None] = []
            retry_at = now + BAD_DEFINITION_RETRY
            due_of: dict[int, datetime] = {}
            for definition_id, name, raw_schedule, due_at, rearm_from in rows:
                armed.append(rearm_from)
                try:
                    if rearm_from is not None:
                        # Its queue resumed while this database was down: restarted from then,
                        # the pause not back-filled (apps/jobs/services.py, _restarted).
                        due_at = initial_next_due_at(json.loads(raw_schedule), rearm_from)
                        if due_at is None or due_at > horizon:
                            ids.append(definition_id)
                            next_due.append(due_at)
                            notes.append(None)
                            continue
                    due_of[definition_id] = due_at
                    plan = plans.plan(name, raw_schedule, due_at)
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
                planned.append((definition_id, name, plan))
                ids.append(definition_id)
                next_due.append(plan.next_due_at)
                notes.append(plan.note)

            kept = _overlap_kept(cursor, planned)
            groups: list[tuple[int, str, list[NewRun]]] = []
            cancelling: list[tuple[int, str, NewRun]] = []
            for definition_id, name, plan in planned:
                try:
                    runs = _runs_for(definition_id, name, kept.get(definition_id, plan.slots), plan)
                except Exception:  # noqa: BLE001 - one bad definition must not stop the shard
                    log.exception(
                        "cannot compute the runs of %s (id %s); next try at %s",
                        name,
                        definition_id,
                        retry_at.isoformat(),
                    )
                    result.bad.append(name)
                    index = ids.index(definition_id)
                    next_due[index], notes[index] = retry_at, None
                    continue
                groups.append((definition_id, name, runs))
                if plan.overlap_policy == "cancel_other" and runs:
                    cancelling.append((definition_id, name, runs[-1]))

            postponed = _cancel_others(cursor, cancelling, result) if cancelling else set()
            if postponed:
                groups = [group for group in groups if group[0] not in postponed]
                for index, definition_id in enumerate(ids):
                    if definition_id in postponed:
                        # Unchanged: the next tick judges this fire time again.
                        next_due[index], notes[index] = due_of[definition_id], None
            for definition_id, name, plan in planned:
                if definition_id in kept and definition_id not in postponed:
                    _log_skipped(name, plan, kept[definition_id], result)

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
                    "armed_ats": array_literal(armed),
                },
            )
    return result
