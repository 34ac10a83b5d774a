"""Lateness and missed runs, for definitions that set a lateness SLO.

- late: a run whose first lease came more than `latenessSloSeconds` after its availableAt, or
  that has not started that long after it (no worker for its queue, a paused queue: a run stuck
  waiting is news before its lease would have said so);
- missed: a cron time of the window with no successful run by `due + SLO + timeoutSeconds`
  (no run at all, because the scheduler was down, or runs that failed or are still waiting).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from apps.jobs import firetimes
from apps.jobs import schedule as sched
from apps.jobs.models import JobDefinition
from apps.runs import shards
from apps.runs.clock import format_utc
from apps.runs.ids import public_run_id
from apps.runs.models import SCHEDULED_TRIGGERS, Run

WINDOW = timedelta(hours=24)
MAX_TIMES_PER_DEFINITION = 1440


@dataclass(frozen=True)
class Alert:
    kind: str
    definition: JobDefinition
    due_at: datetime
    run_id: str | None = None
    late_by: float | None = None
    state: str = ""  # a missed time's run's state, or "scheduled" for a late run still waiting

    @property
    def message(self) -> str:
        """The alert in plain words."""
        slo = self.definition.lateness_slo_seconds
        if self.kind == "late" and self.state:
            return f"{self.run_id} has not started {self.late_by:.1f} s after it was due (SLO {slo} s)."
        if self.kind == "late":
            return f"{self.run_id} started {self.late_by:.1f} s after it was due (SLO {slo} s)."
        why = f" ({self.run_id} is {self.state})" if self.run_id else " (no run was made)"
        return f"No successful run for the cron time {format_utc(self.due_at)}{why}."

    def as_json(self) -> dict[str, str]:
        """What the alerts page shows beside the alert's own fields: the words, whom to tell, and
        the runbook."""
        return {
            "message": self.message,
            "owner": self.definition.owner,
            "runbookUrl": self.definition.runbook_url,
        }


def alerts_for(team, now: datetime, window: timedelta = WINDOW) -> list[Alert]:
    """Return the late and missed runs of the team's watched definitions within the window,
    from every shard database (one that is down is left out: its alerts wait for it)."""
    found, _ = shards.gather(lambda: _alerts_here(team, now, window))
    return sorted((alert for part in found for alert in part), key=lambda a: a.due_at, reverse=True)


def _alerts_here(team, now: datetime, window: timedelta) -> list[Alert]:
    watched = list(JobDefinition.objects.filter(team=team, lateness_slo_seconds__isnull=False))
    found: list[Alert] = []
    since = now - window
    for definition in watched:
        slo = definition.lateness_slo_seconds
        late = Run.objects.filter(
            definition=definition, started_at__gte=since, late_seconds__gt=slo
        ).values_list("pk", "due_at", "late_seconds")
        found += [
            Alert("late", definition, due, public_run_id(pk), late_by) for pk, due, late_by in late
        ]
        missed = _missed(definition, since, now)
        named = {alert.run_id for alert in missed}
        # Not started yet, its SLO passed: late already (a missed time naming it says so).
        # Index run_waiting_by_def (definition, available_at) WHERE waiting.
        waiting = Run.objects.filter(
            definition=definition,
            state="scheduled",
            started_at__isnull=True,
            available_at__gte=since,
            available_at__lt=now - timedelta(seconds=slo),
        ).values_list("pk", "due_at", "available_at")
        found += [
            Alert("late", definition, due, run_id, (now - at).total_seconds(), state="scheduled")
            for pk, due, at in waiting
            if (run_id := public_run_id(pk)) not in named
        ]
        found += missed
    return found


def _missed(definition: JobDefinition, since: datetime, now: datetime) -> list[Alert]:
    schedule = sched.parse_schedule(definition.schedule)
    if not isinstance(schedule, sched.CronSchedule) or definition.paused:
        return []
    grace = timedelta(seconds=definition.lateness_slo_seconds + definition.timeout_seconds)
    # Only times whose grace has passed can be judged, and none before the definition existed.
    start = max(since, definition.created_at)
    times = firetimes.fire_times_between(schedule, start, now - grace, MAX_TIMES_PER_DEFINITION)
    if not times:
        return []
    # A cron time has one run at most ((definition, due time) is unique): the one a missed
    # time names, when it was made but failed or still waits.
    made = {
        due: (pk, state)
        for due, pk, state in Run.objects.filter(
            definition=definition,
            trigger__in=SCHEDULED_TRIGGERS,
            due_at__in=[t.utc for t in times],
        ).values_list("due_at", "id", "state")
    }
    missed = []
    for t in times:
        pk, state = made.get(t.utc, (None, ""))
        if state != "succeeded":
            run_id = public_run_id(pk) if pk is not None else None
            missed.append(Alert("missed", definition, t.utc, run_id, state=state))
    return missed
