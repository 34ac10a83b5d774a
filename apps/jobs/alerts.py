"""Lateness and missed runs, for definitions that set a lateness SLO.

- late: a run whose first lease came more than `latenessSloSeconds` after its availableAt, or
  that has not started that long after it (no worker for its queue, a paused queue: a run stuck
  waiting is news before its lease would have said so);
- missed: a cron time of the window with no successful run by `due + SLO + timeoutSeconds`
  (no run at all, because the scheduler was down, or runs that failed or are still waiting).

Alerts are ordered newest first by (due time, job, kind, run), and read a page at a time: each
watched definition gives its newest alerts past the page's start, at most a page of them, and
the pages of all are merged (40 000 runs of one job waiting made a list of 41 000 alerts, read
whole on each look).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from django.db.models import Q, QuerySet

from apps.jobs import firetimes
from apps.jobs import schedule as sched
from apps.jobs.models import JobDefinition
from apps.runs import filters, shards
from apps.runs.clock import format_utc
from apps.runs.ids import public_run_id
from apps.runs.models import SCHEDULED_TRIGGERS, Run, Trigger, reported_state

WINDOW = timedelta(hours=24)
MAX_TIMES_PER_DEFINITION = 1440


@dataclass(frozen=True, order=True)
class Position:
    """An alert's place in the order (newest first: a greater position comes first), and the
    cursor of a page that ended at it. A missed time without a run has run 0."""

    due_at: datetime
    job: str
    kind: str
    run_pk: int

    def as_cursor(self) -> str:
        # To the microsecond (a run's due time has them; answers show milliseconds), and the
        # job last: whatever its name holds, the fields before it split off cleanly.
        due = self.due_at.astimezone(UTC).isoformat(timespec="microseconds")
        return f"{due.removesuffix('+00:00')}Z|{self.kind}|{self.run_pk}|{self.job}"

    @classmethod
    def from_cursor(cls, raw: str) -> Position | None:
        """The position a cursor names, or None for text no page gave."""
        due, kind, run, job = (raw.split("|", 3) + ["", "", ""])[:4]
        due_at = filters.parse_instant(due)
        if due_at is None or kind not in ("late", "missed") or not job:
            return None
        if not (run.isascii() and run.isdigit() and len(run) <= 18):
            return None
        return cls(due_at, job, kind, int(run))


@dataclass(frozen=True)
class Alert:
    kind: str
    definition: JobDefinition
    due_at: datetime
    run_pk: int | None = None
    late_by: float | None = None
    state: str = ""  # a missed time's run's state, or "scheduled" for a late run still waiting
    shown_state: str = ""  # that state as the API and dashboard name it (`ready` once due)

    @property
    def run_id(self) -> str | None:
        return public_run_id(self.run_pk) if self.run_pk is not None else None

    @property
    def position(self) -> Position:
        return Position(self.due_at, self.definition.name, self.kind, self.run_pk or 0)

    @property
    def message(self) -> str:
        """The alert in plain words."""
        slo = self.definition.lateness_slo_seconds
        if self.kind == "late" and self.state:
            return f"{self.run_id} has not started {self.late_by:.1f} s after it was due to start (SLO {slo} s)."
        if self.kind == "late":
            return f"{self.run_id} started {self.late_by:.1f} s after it was due to start (SLO {slo} s)."
        shown = self.shown_state or self.state
        why = f" ({self.run_id} is {shown})" if self.run_id else " (no run was made)"
        return f"No successful run for the cron time {format_utc(self.due_at)}{why}."

    def as_json(self) -> dict[str, str]:
        """What the alerts page shows beside the alert's own fields: the words, whom to tell, and
        the runbook."""
        return {
            "message": self.message,
            "owner": self.definition.owner,
            "runbookUrl": self.definition.runbook_url,
        }


@dataclass(frozen=True)
class Found:
    """A page of alerts, newest first, and how many the window holds in all."""

    alerts: list[Alert]
    total: int


def alerts_for(
    team, now: datetime, *, limit: int, after: Position | None = None, window: timedelta = WINDOW
) -> Found:
    """The team's newest `limit` late and missed runs of the window (those past `after`, the
    position a previous page ended at), from every shard database (one that is down is left
    out: its alerts wait for it), and how many there are in all."""
    found, _ = shards.gather(lambda: _alerts_here(team, now, window, limit, after))
    merged = sorted(
        (alert for part, _ in found for alert in part), key=lambda a: a.position, reverse=True
    )
    return Found(merged[:limit], sum(total for _, total in found))


def newest_by_job(team, now: datetime, window: timedelta = WINDOW) -> list[Alert]:
    """The newest late and the newest missed alert of each of the team's watched definitions
    (what the notifier pages)."""
    found, _ = shards.gather(lambda: _alerts_here(team, now, window, 1, None)[0])
    return [alert for part in found for alert in part]


def _alerts_here(
    team, now: datetime, window: timedelta, keep: int, after: Position | None
) -> tuple[list[Alert], int]:
    """Each watched definition's newest `keep` alerts of each kind past `after`, and the count
    of all of them."""
    watched = JobDefinition.objects.filter(team=team, lateness_slo_seconds__isnull=False)
    found: list[Alert] = []
    total = 0
    since = now - window
    for definition in watched:
        slo = definition.lateness_slo_seconds
        missed = _missed(definition, since, now)
        named = [alert.run_pk for alert in missed if alert.run_pk is not None]
        # A backfilled run is never late: it was asked for past times on purpose (each was
        # listed, and paged as job.late, its lateness counted from its past due time).
        late = Run.objects.filter(
            definition=definition, started_at__gte=since, late_seconds__gt=slo
        ).exclude(trigger=Trigger.BACKFILL)
        # Not started yet, its SLO passed: late already (a missed time naming it says so).
        # Index run_waiting_by_def (definition, available_at) WHERE waiting.
        waiting = (
            Run.objects.filter(
                definition=definition,
                state="scheduled",
                started_at__isnull=True,
                available_at__gte=since,
                available_at__lt=now - timedelta(seconds=slo),
            )
            .exclude(pk__in=named)
            .exclude(trigger=Trigger.BACKFILL)
        )
        total += late.count() + waiting.count() + len(missed)
        found += [
            Alert("late", definition, due, pk, late_by)
            for pk, due, late_by in _newest(late, definition, after, keep).values_list(
                "pk", "due_at", "late_seconds"
            )
        ]
        found += [
            Alert("late", definition, due, pk, (now - at).total_seconds(), state="scheduled")
            for pk, due, at in _newest(waiting, definition, after, keep).values_list(
                "pk", "due_at", "available_at"
            )
        ]
        found += _newest_of(missed, after, keep)
    return found, total


def _newest(runs: QuerySet, definition: JobDefinition, after: Position | None, keep: int):
    """The `keep` newest late runs of the definition below `after` in the alerts' order."""
    if after is not None:
        # Within a due time, a job's alerts stand below those of jobs named after it; within a
        # job, late alerts below missed ones, then by run, highest first.
        if definition.name < after.job:
            runs = runs.filter(due_at__lte=after.due_at)
        elif definition.name > after.job or after.kind == "late":
            below = Q(due_at__lt=after.due_at)
            if definition.name == after.job:
                below |= Q(due_at=after.due_at, pk__lt=after.run_pk)
            runs = runs.filter(below)
        else:
            runs = runs.filter(due_at__lte=after.due_at)
    return runs.order_by("-due_at", "-pk")[:keep]


def _newest_of(alerts: Iterable[Alert], after: Position | None, keep: int) -> list[Alert]:
    below = [alert for alert in alerts if after is None or alert.position < after]
    return sorted(below, key=lambda a: a.position, reverse=True)[:keep]


def _missed(definition: JobDefinition, since: datetime, now: datetime) -> list[Alert]:
    schedule = sched.parse_schedule(definition.schedule)
    if not isinstance(schedule, sched.CronSchedule) or definition.paused:
        return []
    # Counted from when its run may start, as lateness is: its cron time plus its jitter. From
    # the cron time alone, a job whose jitter passed its SLO and timeout was paged missed (then
    # recovered) at every fire time, though each of its runs started on time.
    jitter = sched.jitter_offset(definition.name, schedule.jitter_seconds)
    grace = timedelta(seconds=jitter + definition.lateness_slo_seconds + definition.timeout_seconds)
    # Only times whose grace has passed can be judged, and none before its schedule took
    # effect: after a pause or a change of schedule, the times before it were reported missed
    # (and paged), though the job restarts from the next fire time by design.
    start = max(since, definition.created_at, definition.armed_at or definition.created_at)
    times = firetimes.fire_times_between(schedule, start, now - grace, MAX_TIMES_PER_DEFINITION)
    if not times:
        return []
    # A cron time has one run at most ((definition, due time) is unique): the one a missed
    # time names, when it was made but failed or still waits.
    made = {
        due: (pk, state, reported_state(state, available, now))
        for due, pk, state, available in Run.objects.filter(
            definition=definition,
            trigger__in=SCHEDULED_TRIGGERS,
            due_at__in=[t.utc for t in times],
        ).values_list("due_at", "id", "state", "available_at")
    }
    missed = []
    for t in times:
        pk, state, shown = made.get(t.utc, (None, "", ""))
        if state != "succeeded":
            missed.append(Alert("missed", definition, t.utc, pk, state=state, shown_state=shown))
    return missed
