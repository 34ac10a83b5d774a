"""What pages a team: the detectors the scheduler runs every SCHEDULER_NOTIFY_INTERVAL_SECONDS.

None of them touches the claim path: they read what it wrote.

- `run.dead`: the dead runs of each database after its watermark (`dead:<alias>`, by end time
  and id; index notify_run_dead_by_end), a couple of seconds behind the database's clock so a
  run whose transaction commits late is not passed by.
- `job.late`, `job.missed`: apps.jobs.alerts (definitions with a lateness SLO), for the times
  after the first look at the team (`alerts:<team>`), deduplicated by their incidents.
- `dlq.threshold`: a team's dead runs, counted on every database, at or over the threshold.
- `scheduler.shard_unowned`: shard leases expired (or never taken) for longer than
  SCHEDULER_NOTIFY_SHARD_UNOWNED_SECONDS, paged to the teams with jobs in those shards.
- recovery: apps/notify/incidents.py (`review`), with `job_recovered` below.

Detectors run only for teams with an enabled channel that wants the event: a team without
channels costs nothing. One daemon detects at a time (an advisory lock); the incidents' unique
open row holds even without it.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from datetime import datetime, timedelta

import orjson
from django.conf import settings
from django.db import connection, connections
from django.db.models import Count

from apps.jobs import alerts
from apps.jobs.models import JobDefinition, database_of
from apps.notify import incidents, messages
from apps.notify.incidents import Occurrence
from apps.notify.models import Channel, Event, Incident, Watermark
from apps.runs import shards
from apps.runs.clock import format_utc
from apps.runs.ids import public_run_id
from apps.runs.models import Run
from apps.teams.models import Team

log = logging.getLogger(__name__)

# pg_try_advisory_lock key: "one detector at a time" across every scheduler node.
LOCK_KEY = 0x6E6F74696679  # "notify"
# How far behind its database's clock the dead-run detector reads: a failing transaction
# commits within this of the time it stamped on the run.
SETTLE_SECONDS = 2.0
DEAD_BATCH = 500

# The dead runs after the watermark, oldest first (notify_run_dead_by_end), of the teams that
# want them; and the database's clock, less the settling time, as the new watermark.
DEAD_RUNS = """
SELECT r.id, r.team_id, d.name, r.queue, r.finished_at, r.attempt, r.last_error
FROM runs_run r JOIN jobs_jobdefinition d ON d.id = r.definition_id
WHERE r.state = 'dead'
  AND (r.finished_at, r.id) > (%(at)s, %(id)s)
  AND r.finished_at <= %(upto)s
  AND r.team_id = ANY(%(teams)s)
ORDER BY r.finished_at, r.id
LIMIT %(limit)s
"""
SETTLED_NOW = "SELECT now() - make_interval(secs => %s)"

# Shards whose lease has been expired (or never taken) for a while: nobody materialises or
# reaps them. The table is the scheduler's (apps/scheduler/models.py); read here by name, as
# `runs` reads the tables of `jobs`, so the scheduler can run this room's steps.
UNOWNED_SHARDS = """
SELECT shard, expires_at FROM scheduler_shardlease
WHERE shard < %(count)s
  AND (expires_at IS NULL OR expires_at < now() - make_interval(secs => %(grace)s))
ORDER BY shard
"""


def channels_by_event(channels: list[Channel]) -> dict[str, set[int]]:
    """The teams that have an enabled channel wanting each event."""
    teams: dict[str, set[int]] = defaultdict(set)
    for channel in channels:
        if channel.enabled:
            for event in channel.events:
                teams[event].add(channel.team_id)
    return teams


def detect(now: datetime) -> bool:
    """One look for everything, if no other daemon is looking; return True when a batch was
    full (look again at once)."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_try_advisory_lock(%s)", [LOCK_KEY])
        if not cursor.fetchone()[0]:
            return False
    try:
        channels = list(Channel.objects.filter(enabled=True).select_related("team"))
        wanted = channels_by_event(channels)
        teams = {team.pk: team for team in {channel.team for channel in channels}}
        more = False
        if wanted[Event.RUN_DEAD]:
            more = dead_runs(now, wanted[Event.RUN_DEAD], teams, channels)
        late_or_missed = wanted[Event.JOB_LATE] | wanted[Event.JOB_MISSED]
        if late_or_missed:
            late_and_missed(now, late_or_missed, teams, channels)
        if wanted[Event.DLQ_THRESHOLD]:
            dlq_threshold(now, wanted[Event.DLQ_THRESHOLD], teams, channels)
        if wanted[Event.SHARD_UNOWNED]:
            shards_unowned(now, wanted[Event.SHARD_UNOWNED], teams, channels)
        incidents.review(channels, now, job_recovered)
        return more
    finally:
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_advisory_unlock(%s)", [LOCK_KEY])


# --- run.dead ---------------------------------------------------------------------------------


def dead_runs(now: datetime, team_ids: set[int], teams: dict, channels: list[Channel]) -> bool:
    """Page the dead runs found after each database's watermark; True when a batch was full."""
    more = False
    for alias in shards.databases():
        try:
            rows, upto = _dead_after_watermark(alias, sorted(team_ids))
        except shards.DOWN:
            if not shards.physical():
                raise
            continue  # its dead runs wait for it: the watermark stays
        more |= len(rows) == DEAD_BATCH
        groups: dict[tuple[int, str], list[tuple]] = defaultdict(list)
        for row in rows:
            groups[(row[1], row[2])].append(row)
        for (team_id, job), found in groups.items():
            incidents.occurred(_dead_occurrence(teams[team_id], job, found), channels, now)
        last = rows[-1] if len(rows) == DEAD_BATCH else None
        Watermark.objects.update_or_create(
            key=f"dead:{alias}",
            defaults={
                "position_at": last[4] if last else upto,
                "position_id": last[0] if last else 0,
            },
        )
    return more


def _dead_after_watermark(alias: str, team_ids: list[int]) -> tuple[list[tuple], datetime]:
    mark = Watermark.objects.filter(key=f"dead:{alias}").first()
    with connections[alias].cursor() as cursor:
        cursor.execute(SETTLED_NOW, [SETTLE_SECONDS])
        upto = cursor.fetchone()[0]
        if mark is None:
            start = (upto - timedelta(seconds=settings.SCHEDULER_NOTIFY_LOOKBACK_SECONDS), 0)
        else:
            start = (mark.position_at, mark.position_id)
        cursor.execute(
            DEAD_RUNS,
            {
                "at": start[0],
                "id": start[1],
                "upto": upto,
                "teams": team_ids,
                "limit": DEAD_BATCH,
            },
        )
        return cursor.fetchall(), upto


def _dead_occurrence(team: Team, job: str, rows: list[tuple]) -> Occurrence:
    pk, _, _, queue, finished_at, attempt, error = rows[-1]
    run_id = public_run_id(pk)
    if isinstance(error, str):  # Django's connections read jsonb as text
        error = orjson.loads(error)
    error = error if isinstance(error, dict) else {}
    reason = ": ".join(str(part) for part in (error.get("type"), error.get("message")) if part)
    attempts = f"{attempt} attempt{'s' if attempt != 1 else ''}"
    summary = f"{job}: run {run_id} is dead after {attempts}"
    if len(rows) > 1:
        summary = f"{job}: {len(rows)} runs died; the latest, {run_id}, after {attempts}"
    summary += f" ({reason[:300]})." if reason else "."
    return Occurrence(
        team=team,
        event=Event.RUN_DEAD,
        subject=job,
        job=job,
        queue=queue,
        at=finished_at,
        summary=summary,
        run_id=run_id,
        count=len(rows),
    )


# --- job.late, job.missed ---------------------------------------------------------------------


def late_and_missed(now: datetime, team_ids: set[int], teams: dict, channels) -> None:
    """Page the late runs and missed cron times of the teams' watched definitions."""
    lookback = timedelta(seconds=settings.SCHEDULER_NOTIFY_LOOKBACK_SECONDS)
    for team_id in sorted(team_ids):
        team = teams[team_id]
        # The first look at a team goes back the lookback only: older alerts were never news.
        mark, _ = Watermark.objects.get_or_create(
            key=f"alerts:{team_id}", defaults={"position_at": now - lookback}
        )
        latest: dict[tuple[str, str], alerts.Alert] = {}
        for alert in alerts.newest_by_job(team, now):
            if alert.due_at < mark.position_at:
                continue
            key = ("job.late" if alert.kind == "late" else "job.missed", alert.definition.name)
            if key not in latest or alert.due_at > latest[key].due_at:
                latest[key] = alert
        for (event, job), alert in latest.items():
            incidents.occurred(
                Occurrence(
                    team=team,
                    event=event,
                    subject=job,
                    job=job,
                    queue=alert.definition.queue,
                    at=alert.due_at,
                    summary=f"{job}: {alert.message}",
                    run_id=alert.run_id or "",
                    # A run still waiting is late (or its time missed) for as long as it waits:
                    # each look keeps the incident open, and its quiet time counts from the
                    # last (a recovery said "no job.late for 36 s" of a run started 3 s before).
                    # A later run late in its turn is another occurrence, the one messages name.
                    waiting=alert.state == "scheduled",
                ),
                channels,
                now,
            )


# --- dlq.threshold ----------------------------------------------------------------------------


def dlq_threshold(now: datetime, team_ids: set[int], teams: dict, channels) -> None:
    """Page the teams whose dead-letter queue holds at least the threshold."""
    threshold = settings.SCHEDULER_NOTIFY_DLQ_THRESHOLD
    found, _ = shards.gather(
        lambda: dict(
            Run.objects.filter(state="dead", team_id__in=team_ids)
            .values("team_id")
            .annotate(n=Count("id"))
            .values_list("team_id", "n")
        )
    )
    sizes: dict[int, int] = defaultdict(int)
    for part in found:
        for team_id, count in part.items():
            sizes[team_id] += count
    for team_id, size in sizes.items():
        if size < threshold:
            continue
        incidents.occurred(
            Occurrence(
                team=teams[team_id],
                event=Event.DLQ_THRESHOLD,
                subject="dlq",
                at=now,
                summary=f"The dead-letter queue holds {size} runs (threshold {threshold}).",
                condition=True,
            ),
            channels,
            now,
        )


# --- scheduler.shard_unowned ------------------------------------------------------------------


def shards_unowned(now: datetime, team_ids: set[int], teams: dict, channels) -> None:
    """Page the teams with jobs in shards that no scheduler has held for a while."""
    with connection.cursor() as cursor:
        cursor.execute(
            UNOWNED_SHARDS,
            {
                "count": settings.SCHEDULER_SHARD_COUNT,
                "grace": settings.SCHEDULER_NOTIFY_SHARD_UNOWNED_SECONDS,
            },
        )
        since = dict(cursor.fetchall())  # shard → when its lease expired (None: never taken)
    unowned = list(since)
    if not unowned:
        return
    found, _ = shards.gather(
        lambda: list(
            JobDefinition.objects.filter(shard__in=unowned, team_id__in=team_ids)
            .values_list("team_id", "shard")
            .distinct()
        )
    )
    affected: dict[int, set[int]] = defaultdict(set)
    for part in found:
        for team_id, shard in part:
            affected[team_id].add(shard)
    grace = settings.SCHEDULER_NOTIFY_SHARD_UNOWNED_SECONDS
    for team_id, held in affected.items():
        names = ", ".join(str(shard) for shard in sorted(held))
        plural = "s" if len(held) > 1 else ""
        # Since when, so that the page and its resolution tell the whole gap: the first
        # scheduler back after an outage is the one that sees it.
        expired = [since[shard] for shard in held if since[shard] is not None]
        gap = (
            f"since {format_utc(min(expired))} ({messages.age(now - min(expired))})"
            if len(expired) == len(held)
            else f"for over {grace} s"
        )
        incidents.occurred(
            Occurrence(
                team=teams[team_id],
                event=Event.SHARD_UNOWNED,
                subject="shards",
                at=now,
                summary=(
                    f"Shard{plural} {names} of the team's jobs ha{'ve' if plural else 's'} had no "
                    f"scheduler {gap}: their cron runs are not created and their expired "
                    "leases are not reaped."
                ),
                condition=True,
            ),
            channels,
            now,
        )


# --- recovery ---------------------------------------------------------------------------------

# The runs whose outcome decides a recovery: the job's latest, by id (run_definition_recent).
RECENT_RUNS = 20


def job_recovered(incident: Incident) -> bool | None:
    """Whether the incident's job has recovered: its latest finished run (succeeded or dead)
    succeeded, after the incident's latest occurrence, and no run died since that occurrence;
    for a late or missed time, a run of that time (or a later one) succeeded. None when the
    job is gone."""
    name = incident.job
    try:
        with shards.using(database_of(name)):
            definition = JobDefinition.objects.named(name).filter(team_id=incident.team_id).first()
            if definition is None:
                return None
            recent = list(
                Run.objects.filter(definition=definition)
                .order_by("-id")
                .values_list("state", "finished_at", "due_at")[:RECENT_RUNS]
            )
    except shards.DOWN:
        if not shards.physical():
            raise
        return False  # cannot tell: stays open until its database is back
    finished = [
        (at, state, due) for state, at, due in recent if state in ("succeeded", "dead") and at
    ]
    if not finished:
        return False
    if any(state == "dead" and at > incident.last_event_at for at, state, _ in finished):
        # A death the detector has not read yet (it reads up to a settled time, a batch at a
        # time): it belongs to this incident, which stays open until it is counted, rather
        # than recovering now and opening a second incident for it a moment later.
        return False
    at, state, _ = max(finished)
    if state != "succeeded" or at <= incident.last_event_at:
        return False
    if incident.event in (Event.JOB_LATE, Event.JOB_MISSED):
        # The occurrence is a due time: the run of an earlier time that finished after it
        # (12:44's, done at 12:45:06) is no answer to 12:45's, which may still be missed.
        return any(
            state == "succeeded" and due >= incident.last_event_at for _, state, due in finished
        )
    return True
