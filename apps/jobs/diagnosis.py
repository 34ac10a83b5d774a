"""Why is this not running? The reasons a waiting run or a definition is held, in plain words."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from apps.jobs import firetimes
from apps.jobs import schedule as sched
from apps.jobs.models import JobDefinition, Queue, database_of
from apps.jobs.queues import rate_window
from apps.runs import shards
from apps.runs.clock import format_utc
from apps.runs.ids import public_run_id
from apps.runs.models import PRIORITY_NAMES, SCHEDULED_TRIGGERS, WAITING_STATES, Run

# A queue that no worker asked for work within this long has "no worker".
WORKER_SILENCE = timedelta(seconds=60)
# Counting runs ahead stops here: "more than 10 000" is as useful as the exact number.
COUNT_CAP = 10_000


@dataclass(frozen=True)
class Reason:
    code: str
    message: str
    detail: dict[str, Any] = field(default_factory=dict)


# How long past its fire time a definition's run may still be unmade before `why` says nothing
# is making it: a few ticks and the materialiser's grace (seconds), with room for a busy one.
NOT_MATERIALISED = timedelta(seconds=30)


def _queue(definition: JobDefinition) -> Queue | None:
    return Queue.objects.filter(team_id=definition.team_id, name=definition.queue).first()


# How many of a limit's holders a reason names; it counts them all, up to the limit (a limit
# above this was never found held: the first 50 were compared with it).
HOLDERS_NAMED = 50


def _holders(definition: JobDefinition, limit: int) -> list[str]:
    """The definition's leased runs, up to `limit`. Served by the partial index
    run_leased_by_def."""
    ids = Run.objects.filter(definition=definition, state="leased").values_list("pk", flat=True)
    return [public_run_id(pk) for pk in ids[: max(limit, 1)]]


def _named(holders: list[str]) -> str:
    more = len(holders) - HOLDERS_NAMED
    return ", ".join(holders[:HOLDERS_NAMED]) + (f" and {more} more" if more > 0 else "")


def _count_ahead(run: Run, now: datetime) -> tuple[int, int]:
    """Return (claimable runs of higher priority, older claimable runs of the same priority)."""
    # Both counts are range scans of the partial index run_claimable, capped.
    with shards.cursor() as cursor:
        cursor.execute(
            """
            SELECT
              (SELECT count(*) FROM (
                  SELECT 1 FROM runs_run
                  WHERE team_id = %(team)s AND queue = %(queue)s AND priority < %(priority)s
                    AND state IN ('scheduled', 'ready', 'retrying') AND available_at <= %(now)s
                  LIMIT %(cap)s) AS higher),
              (SELECT count(*) FROM (
                  SELECT 1 FROM runs_run
                  WHERE team_id = %(team)s AND queue = %(queue)s AND priority = %(priority)s
                    AND state IN ('scheduled', 'ready', 'retrying')
                    AND (available_at, id) < (%(available)s, %(id)s)
                  LIMIT %(cap)s) AS older)
            """,
            {
                "team": run.team_id,
                "queue": run.queue,
                "priority": run.priority,
                "now": now,
                "available": run.available_at,
                "id": run.pk,
                "cap": COUNT_CAP,
            },
        )
        return cursor.fetchone()


# The starts within the definition's rate window, and the one whose leaving the window opens a
# slot: with the window full, the oldest; with more starts in it than the limit (the limit was
# lowered), the one that leaves it below the limit (the oldest said a slot opened 40 s early).
# Served by ratestart_window (definition_id, started_at).
RATE_WINDOW = """
WITH window_starts AS (
    SELECT started_at FROM runs_ratestart
    WHERE definition_id = %(definition)s
      AND started_at > %(now)s - make_interval(secs => %(period)s)
)
SELECT (SELECT count(*) FROM window_starts),
       (SELECT started_at FROM window_starts ORDER BY started_at
        OFFSET greatest((SELECT count(*) FROM window_starts) - %(limit)s, 0) LIMIT 1)
"""
# The leased runs of one concurrency key: the partial index run_leased_by_key.
KEY_HOLDERS = """
SELECT id FROM runs_run
WHERE definition_id = %(definition)s AND concurrency_key = %(key)s AND state = 'leased'
ORDER BY id LIMIT %(limit)s
"""

# The keys of a definition whose limit is held while runs of theirs are ready to start: leased
# runs by key from the partial index run_leased_by_key, each key's ready runs looked up in
# run_waiting_limited (definition_id, concurrency_key, available_at, id: a definition with a
# per-key limit has its runs `limited`).
KEYS_HELD = """
SELECT h.concurrency_key, array_agg(h.id ORDER BY h.id)
FROM runs_run h
WHERE h.definition_id = %(definition)s AND h.state = 'leased' AND h.concurrency_key IS NOT NULL
GROUP BY h.concurrency_key
HAVING count(*) >= %(limit)s AND EXISTS (
    SELECT 1 FROM runs_run w
    WHERE w.definition_id = %(definition)s AND w.concurrency_key = h.concurrency_key
      AND w.state IN ('scheduled', 'ready', 'retrying') AND w.limited
      AND w.available_at <= %(now)s)
ORDER BY h.concurrency_key
LIMIT %(keys)s
"""
# How many held keys a job's `why` names.
KEYS_SHOWN = 10


def _rate_limited(definition: JobDefinition, now: datetime) -> list[Reason]:
    count, period = definition.rate_limit_count, definition.rate_limit_period_seconds
    with shards.cursor() as cursor:
        cursor.execute(
            RATE_WINDOW, {"definition": definition.pk, "now": now, "period": period, "limit": count}
        )
        started, leaving = cursor.fetchone()
    if started < count:
        return []
    opens = max(0.0, (leaving + timedelta(seconds=period) - now).total_seconds())
    return [
        Reason(
            "rate_limit",
            f"Rate limit: {count}/{period} s, all used; the next slot opens in {opens:.0f} s.",
            {"count": count, "periodSeconds": period, "nextSlotInSeconds": round(opens, 3)},
        )
    ]


def _queue_rate_limited(queue: Queue, now: datetime) -> list[Reason]:
    window = rate_window(queue, now)
    if window is None or not window.full:
        return []
    opens = window.next_slot_in or 0.0
    return [
        Reason(
            "rate_limit",
            f"Rate limit of the queue {queue.name}: {window.count}/{window.period_seconds} s, "
            f"all used; the next slot opens in {opens:.0f} s.",
            {
                "queue": queue.name,
                "count": window.count,
                "periodSeconds": window.period_seconds,
                "nextSlotInSeconds": round(opens, 3),
            },
        )
    ]


def _key_held(run: Run) -> list[Reason]:
    definition = run.definition
    if definition.concurrency_per_key is None or run.concurrency_key is None:
        return []
    with shards.cursor() as cursor:
        cursor.execute(
            KEY_HOLDERS,
            {
                "definition": definition.pk,
                "key": run.concurrency_key,
                "limit": definition.concurrency_per_key,
            },
        )
        holders = [public_run_id(row[0]) for row in cursor.fetchall()]
    if len(holders) < definition.concurrency_per_key:
        return []
    return [
        Reason(
            "key_concurrency_limit",
            f"The limit of {definition.concurrency_per_key} per key is held for the key "
            f"{run.concurrency_key!r} by {_named(holders)}.",
            {
                "limit": definition.concurrency_per_key,
                "key": run.concurrency_key,
                "heldBy": holders[:HOLDERS_NAMED],
            },
        )
    ]


def _keys_held(definition: JobDefinition, now: datetime) -> list[Reason]:
    """The job's keys whose limit holds back ready runs (its `why`; a run's names its own)."""
    limit = definition.concurrency_per_key
    if limit is None:
        return []
    with shards.cursor() as cursor:
        cursor.execute(
            KEYS_HELD, {"definition": definition.pk, "limit": limit, "now": now, "keys": KEYS_SHOWN}
        )
        held = {key: [public_run_id(pk) for pk in ids] for key, ids in cursor.fetchall()}
    if not held:
        return []
    named = ", ".join(f"{key!r} (by {', '.join(ids)})" for key, ids in held.items())
    return [
        Reason(
            "key_concurrency_limit",
            f"The limit of {limit} per key is held, with runs ready behind it, for {named}"
            + (" (and maybe more)." if len(held) >= KEYS_SHOWN else "."),
            {"limit": limit, "keys": [{"key": k, "heldBy": ids} for k, ids in held.items()]},
        )
    ]


def _holds_of_definition(
    definition: JobDefinition, queue: Queue | None, now: datetime
) -> list[Reason]:
    reasons = []
    if definition.paused:
        reasons.append(Reason("definition_paused", f"The job {definition.name} is paused."))
    if queue is not None and queue.paused:
        reasons.append(Reason("queue_paused", f"The queue {definition.queue} is paused."))
    if definition.concurrency is not None:
        holders = _holders(definition, definition.concurrency)
        if len(holders) >= definition.concurrency:
            reasons.append(
                Reason(
                    "concurrency_limit",
                    f"The job's concurrency limit ({definition.concurrency}) is held by "
                    f"{_named(holders)}.",
                    {"limit": definition.concurrency, "heldBy": holders[:HOLDERS_NAMED]},
                )
            )
    if definition.rate_limit_count is not None:
        reasons += _rate_limited(definition, now)
    if queue is not None:
        reasons += _queue_rate_limited(queue, now)
    if queue is None or queue.last_leased_at is None or now - queue.last_leased_at > WORKER_SILENCE:
        last = queue.last_leased_at if queue is not None else None
        reasons.append(
            Reason(
                "no_worker",
                f"No worker has asked the queue {definition.queue} for work in the last minute"
                + (f" (last at {format_utc(last)})." if last else " (never)."),
                {"lastLeasedAt": format_utc(last)},
            )
        )
    return reasons


def why_run(run: Run, now: datetime) -> list[Reason]:
    """Return what holds a run; an empty list means nothing does (it is about to be claimed)."""
    with shards.reaching(shards.alias_of_run(run.pk)):
        return _why_run(run, now)


def _why_run(run: Run, now: datetime) -> list[Reason]:
    if run.state == "leased":
        return [
            Reason(
                "running",
                f"Leased by {run.worker_id} until {format_utc(run.lease_expires_at)} (attempt {run.attempt}).",
                {"workerId": run.worker_id, "leaseExpiresAt": format_utc(run.lease_expires_at)},
            )
        ]
    if run.state not in WAITING_STATES:
        return [
            Reason("finished", f"The run is {run.state}; it will not run again unless retried.")
        ]
    definition = run.definition
    if definition.deleting:
        return [
            Reason(
                "job_deleted",
                f"The job {definition.name} is being deleted: the run will not be claimed, and "
                "goes with the job's other runs.",
            )
        ]
    reasons = []
    if run.available_at > now:
        code, what = (
            ("backoff", "Backing off after a failure")
            if run.state == "retrying"
            else ("scheduled", "Scheduled")
        )
        reasons.append(
            Reason(
                code,
                f"{what} until {format_utc(run.available_at)}.",
                {"until": format_utc(run.available_at)},
            )
        )
    reasons += _holds_of_definition(definition, _queue(definition), now)
    reasons += _key_held(run)
    if run.available_at <= now:
        higher, older = _count_ahead(run, now)
        if higher:
            reasons.append(
                Reason(
                    "behind_higher_priority",
                    f"{higher}{'+' if higher >= COUNT_CAP else ''} runs of higher priority than "
                    f"{PRIORITY_NAMES[run.priority]} are ready in the queue {run.queue}.",
                    {"count": higher},
                )
            )
        if older:
            reasons.append(
                Reason(
                    "queued",
                    f"{older}{'+' if older >= COUNT_CAP else ''} older runs of the same priority are ahead of it.",
                    {"count": older},
                )
            )
    return reasons


def why_definition(definition: JobDefinition, now: datetime) -> list[Reason]:
    """Return what keeps a definition from producing or running runs."""
    queue = _queue(definition)
    with shards.reaching(database_of(definition.name)):
        reasons = _holds_of_definition(definition, queue, now)
        reasons += _keys_held(definition, now)
        # The materialiser makes runs up to a minute ahead, and moves next_due_at past them:
        # the next fire time is the earliest such run's, if there is one (as the job page says).
        # Served by run_definition_due_unique (definition_id, due_at) of scheduled triggers.
        made = (
            Run.objects.filter(
                definition=definition,
                trigger__in=SCHEDULED_TRIGGERS,
                state__in=WAITING_STATES,
                due_at__gt=now,
            )
            .order_by("due_at")
            .values_list("due_at", flat=True)
            .first()
        )
    known = [t for t in (made, definition.next_due_at) if t is not None]
    next_due = min(known) if known else None
    cron = _cron_schedule(definition.schedule)
    if not definition.schedule:
        reasons.append(
            Reason("no_schedule", "The job has no schedule: it runs only when triggered.")
        )
    elif cron is not None and cron.end_at is not None and _ended(definition, cron, now):
        end = format_utc(cron.end_at)
        message = (
            f"The schedule ended at {end} (endAt)."
            if cron.end_at <= now
            else f"The schedule ends at {end} (endAt) and has no fire time left before then."
        )
        reasons.append(Reason("schedule_ended", message, {"endAt": end}))
    elif cron is not None and cron.start_at is not None and cron.start_at > now:
        start, first = format_utc(cron.start_at), format_utc(definition.next_due_at)
        then = f"; its first fire time is {first}." if first and not definition.paused else "."
        reasons.append(
            Reason(
                "schedule_not_started",
                f"The schedule starts at {start} (startAt){then}",
                {"startAt": start, "nextDueAt": first},
            )
        )
    elif definition.next_due_at is None and not definition.paused:
        reasons.append(Reason("schedule_done", "The schedule has no more fire times."))
    elif (
        definition.next_due_at is not None
        and definition.next_due_at <= now - NOT_MATERIALISED
        and not definition.paused
        and not (queue is not None and queue.paused)
    ):
        # No run for a fire time long past: nothing makes this shard's runs (no scheduler owns
        # it, or the one that does is stuck), else the materialiser would have moved past it.
        due, late = format_utc(definition.next_due_at), now - definition.next_due_at
        reasons.append(
            Reason(
                "not_materialised",
                f"Its fire time {due} passed {late.total_seconds():.0f} s ago and no run was made"
                f" for it: no scheduler is making the runs of shard {definition.shard}, or the"
                " one that owns it is behind (/readyz names the shards nobody owns).",
                {"nextDueAt": due, "shard": definition.shard},
            )
        )
    elif next_due is not None and next_due > now and not definition.paused:
        # A paused job fires at none: its resume restarts from the next fire time then.
        reasons.append(
            Reason(
                "next_fire",
                f"The next fire time is {format_utc(next_due)}.",
                {"nextDueAt": format_utc(next_due)},
            )
        )
    return reasons


def _cron_schedule(schedule_json: dict) -> sched.CronSchedule | None:
    """The definition's cron schedule (None for other kinds or an unreadable schedule)."""
    try:
        parsed = sched.parse_schedule(schedule_json)
    except sched.ScheduleError:
        return None
    return parsed if isinstance(parsed, sched.CronSchedule) else None


def _ended(definition: JobDefinition, schedule: sched.CronSchedule, now: datetime) -> bool:
    """Whether the schedule has no fire time left before its endAt.

    A due time still waiting for the scheduler (at or before endAt) is not over yet; a paused
    definition's next_due_at is stale, so the schedule alone decides.
    """
    if definition.next_due_at is not None and not definition.paused:
        return False
    return not firetimes.next_fire_times(schedule, now, 1)
