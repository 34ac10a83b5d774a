"""The dashboard's reads. No page counts the whole runs table per request: lists page by keyset
on indexes, and each statement says which index serves it.

Every function takes the team ids the user may see (from `apps.teams.access`) and reads only those.
Runs and definitions are read from every shard database and merged (`shards.gather`: one that is
down is left out and named in the page's banner); one run or job from its own database.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.db.models import Q, QuerySet

from apps.audit.models import AuditEvent
from apps.jobs.models import JobDefinition, Queue, database_of
from apps.jobs.queues import RateWindow, rate_window
from apps.runs import census, counters, shards
from apps.runs.models import (
    FINISHED_STATES,
    PRIORITY_NAMES,
    WAITING_STATES,
    Run,
    State,
    Trigger,
    reported_state,
)

PAGE_SIZE = 50


def _rows(cursor) -> list[dict[str, Any]]:
    names = [col.name for col in cursor.description]
    return [dict(zip(names, row, strict=True)) for row in cursor.fetchall()]


def _fetch(sql: str, params: dict[str, Any]) -> list[dict[str, Any]]:
    """The rows of `sql` on the current shard database."""
    with shards.cursor() as cursor:
        cursor.execute(sql, params)
        return _rows(cursor)


# --- runs ---------------------------------------------------------------------------------
# The lists (runs, failures, DLQ) are apps.jobs.runlist, which the API's lists share.


def visible_run(team_ids: list[int], pk: int | None) -> Run | None:
    """The run from the database its id names (a 503 page while that is down)."""
    if pk is None:
        return None
    with shards.reaching(shards.alias_of_run(pk)):
        found = shards.with_teams(
            Run.objects.select_related("definition").filter(pk=pk, team_id__in=team_ids)
        )
    return found[0] if found else None


def runs_by_ids(team_ids: list[int], pks: list[int]) -> list[Run]:
    runs = _runs_of(
        pks, lambda runs: runs.select_related("definition").filter(team_id__in=team_ids)
    )
    return sorted(runs, key=lambda run: run.pk)


def runs_elsewhere(team_ids: list[int], pks: list[int]) -> dict[Any, list[str]]:
    """Of these runs, those of other teams than `team_ids`: their public ids by team (an
    attempt on them is recorded; the page answers as for a missing run)."""
    found: dict[Any, list[str]] = {}
    for run in _runs_of(pks, lambda runs: runs.exclude(team_id__in=team_ids)):
        if getattr(run, "team", None) is not None:  # a team deleted meanwhile
            found.setdefault(run.team, []).append(run.run_id)
    return found


def _runs_of(pks: list[int], narrow: Callable[[QuerySet], QuerySet]) -> list[Run]:
    """The runs of these ids that `narrow` keeps, each read from its shard database (a 503
    page while one is down), with their teams."""
    runs: list[Run] = []
    for alias, ids in shards.runs_by_database(pks).items():
        with shards.reaching(alias):
            runs += shards.with_teams(narrow(Run.objects.filter(pk__in=ids)))
    return runs


# --- overview -------------------------------------------------------------------------------
# The overview never reads the whole runs heap: the runs of each state but succeeded are counted
# by apps.runs.census (index scans, or the scheduler's census of them when there are too many to
# count on every load), and everything with a time window (failures, throughput, latency, the
# succeeded runs of the last 24 hours) from the per-minute counters (apps/runs/counters.py).


@dataclass
class Overview:
    counts: dict[str, int]
    dlq: int
    failing: int  # stored retrying or dead: what the failures list shows
    # Of those, the ones to be tried again: backing off (the retrying tile) or due again (they
    # count among ready), so the tiles add up.
    to_retry: int
    failures_24h: int
    failures_by_hour: list[tuple[datetime, int]]
    per_minute: list[tuple[datetime, int, int]]
    queues: list[dict[str, Any]]
    latency: list[dict[str, Any]]
    # When the state counts and queues were counted, if not now (apps.runs.census).
    counted_at: datetime | None = None


def overview(team_ids: list[int], now: datetime) -> Overview:
    counts = {state.value: 0 for state in State}
    counted = census.everywhere(team_ids)
    retrying = 0
    for count in counted.counts:
        if count.state not in WAITING_STATES:
            counts[count.state] += count.due
            continue
        counts[State.READY] += count.due
        counts[count.state] += count.later if count.state != State.READY else 0
        retrying += count.due + count.later if count.state == State.RETRYING else 0

    # The windows come from the per-minute counters (apps/runs/counters.py), by whole minutes.
    hour0 = now.replace(minute=0, second=0, microsecond=0) - timedelta(hours=23)
    minute0 = now.replace(second=0, microsecond=0) - timedelta(minutes=59)
    by_hour: dict[datetime, int] = {}
    by_minute: dict[datetime, tuple[int, int]] = {}
    windows, _ = shards.gather(lambda: counters.window(team_ids, hour0, minute0))
    for row in (row for window in windows for row in window):
        hour = row.minute.replace(minute=0)
        by_hour[hour] = by_hour.get(hour, 0) + row.failed
        counts[State.SUCCEEDED] += row.succeeded
        if row.minute >= minute0:
            ok, failed = by_minute.get(row.minute, (0, 0))
            by_minute[row.minute] = (ok + row.succeeded, failed + row.failed)
    latency = []
    histograms: dict[tuple[str, int], list[int]] = {}
    parts, _ = shards.gather(lambda: counters.latency_histograms(team_ids, minute0))
    for part in parts:
        for lane, buckets in part.items():
            summed = histograms.setdefault(lane, [0] * len(buckets))
            histograms[lane] = [a + b for a, b in zip(summed, buckets, strict=True)]
    for (queue, priority), buckets in histograms.items():
        latency.append(
            {
                "queue": queue,
                "priority": priority,
                "priority_name": PRIORITY_NAMES[priority],
                "n": sum(buckets),
                "p50": counters.quantile(buckets, 0.5),
                "p95": counters.quantile(buckets, 0.95),
                "p99": counters.quantile(buckets, 0.99),
            }
        )
    latency.sort(key=lambda r: (r["queue"], r["priority"]))
    hours = [hour0 + timedelta(hours=i) for i in range(24)]
    minutes = [minute0 + timedelta(minutes=i) for i in range(60)]
    return Overview(
        counts=counts,
        dlq=counts[State.DEAD],
        failing=retrying + counts[State.DEAD],
        to_retry=retrying,
        failures_24h=sum(by_hour.values()),
        failures_by_hour=[(h, by_hour.get(h, 0)) for h in hours],
        per_minute=[(m, *by_minute.get(m, (0, 0))) for m in minutes],
        queues=_queue_lanes(counted.counts, now),
        latency=latency,
        counted_at=counted.taken_at,
    )


def _queue_lanes(counts: list[census.Count], now: datetime) -> list[dict[str, Any]]:
    """Per (team, queue, priority) of these counts: ready, waiting, leased and the oldest ready
    run's age; busiest first."""
    lanes: dict[tuple[int, str, int], dict[str, Any]] = {}
    for count in counts:
        if count.state not in WAITING_STATES and count.state != State.LEASED:
            continue
        lane = lanes.setdefault(
            (count.team_id, count.queue, count.priority),
            {
                "team_id": count.team_id,
                "queue": count.queue,
                "priority": count.priority,
                "priority_name": PRIORITY_NAMES[count.priority],
                "ready": 0,
                "waiting": 0,
                "leased": 0,
                "oldest_ready": None,
                "oldest_age": None,
            },
        )
        if count.state == State.LEASED:
            lane["leased"] += count.due
            continue
        lane["ready"] += count.due
        lane["waiting"] += count.later
        oldest = count.oldest_due
        if oldest is not None and (lane["oldest_ready"] is None or oldest < lane["oldest_ready"]):
            lane["oldest_ready"] = oldest
            lane["oldest_age"] = (now - oldest).total_seconds()
    return sorted(lanes.values(), key=lambda r: (-r["ready"], r["queue"], r["priority"]))


@dataclass
class QueueRow:
    team: Any
    name: str
    paused: bool
    lanes: dict[str, dict[str, Any]]
    rate: RateWindow | None = None

    @property
    def ready(self) -> int:
        return sum(lane["ready"] for lane in self.lanes.values())

    @property
    def leased(self) -> int:
        return sum(lane["leased"] for lane in self.lanes.values())

    @property
    def oldest_age(self) -> float | None:
        ages = [lane["oldest_age"] for lane in self.lanes.values() if lane["oldest_age"]]
        return max(ages) if ages else None


def queues(teams: list[Any], now: datetime) -> tuple[list[QueueRow], datetime | None]:
    """Every queue of the teams: those with runs, those definitions name, and paused ones; and
    when their runs were counted, if not now (apps.runs.census)."""
    by_id = {team.pk: team for team in teams}
    team_ids = list(by_id)
    rows: dict[tuple[int, str], QueueRow] = {}

    def row(team_id: int, name: str) -> QueueRow:
        return rows.setdefault((team_id, name), QueueRow(by_id[team_id], name, False, {}))

    named, _ = shards.gather(
        lambda: list(
            JobDefinition.objects.filter(team_id__in=team_ids)
            .values_list("team_id", "queue")
            .distinct()
        )
    )
    for team_id, name in (pair for part in named for pair in part):
        row(team_id, name)
    for queue in Queue.objects.filter(team_id__in=team_ids):
        found = row(queue.team_id, queue.name)
        found.paused = queue.paused
        found.rate = rate_window(queue, now)
    counted = census.everywhere(team_ids)
    for lane in _queue_lanes(counted.counts, now):
        if lane["team_id"] in by_id:
            row(lane["team_id"], lane["queue"]).lanes[lane["priority_name"]] = lane
    return sorted(rows.values(), key=lambda r: (r.team.slug, r.name)), counted.taken_at


def queue_known(team: Any, name: str) -> bool:
    """Whether the team has a queue of that name: one a definition names, or one leased from or
    paused before (what the queues page lists, runs aside: a run's queue is its definition's)."""
    if Queue.objects.filter(team=team, name=name).exists():
        return True
    named, _ = shards.gather(lambda: JobDefinition.objects.filter(team=team, queue=name).exists())
    return any(named)


# --- definitions ----------------------------------------------------------------------------

# For each definition on the page: its newest finished run, from run_definition_recent
# (definition_id, -id), stopping at the first finished row.
LAST_OUTCOMES = f"""
SELECT d.id AS definition_id, r.id, r.state, r.finished_at
FROM unnest(%(ids)s::bigint[]) AS d(id)
CROSS JOIN LATERAL (
    SELECT id, state, finished_at FROM runs_run
    WHERE definition_id = d.id AND state IN {tuple(FINISHED_STATES)}
    ORDER BY id DESC LIMIT 1
) AS r
"""


def definitions_page(
    team_ids: list[int], *, search: str, after: str, limit: int = PAGE_SIZE
) -> tuple[list[JobDefinition], str | None]:
    """Definitions by name, keyset on the unique name index, with their last outcome: a page
    from each shard database, merged by name."""

    def page_here() -> list[JobDefinition]:
        queryset: QuerySet = JobDefinition.objects.filter(team_id__in=team_ids)
        if search:
            queryset = queryset.filter(name__icontains=search)
        if after:
            queryset = queryset.filter(name__gt=after)
        found = shards.with_teams(queryset.order_by("name")[: limit + 1])
        outcomes = {
            row["definition_id"]: row
            for row in _fetch(LAST_OUTCOMES, {"ids": [d.pk for d in found]})
        }
        for definition in found:
            definition.last_outcome = outcomes.get(definition.pk)
        return found

    parts, _ = shards.gather(page_here)
    page = sorted((d for part in parts for d in part), key=lambda d: d.name)
    more = len(page) > limit
    page = page[:limit]
    return page, (page[-1].name if more and page else None)


def recent_runs(definition: JobDefinition, now: datetime, limit: int = 20) -> list[Run]:
    """The definition's newest runs, from run_definition_recent (definition_id, -id)."""
    with shards.reaching(database_of(definition.name)):
        runs = list(Run.objects.filter(definition=definition).order_by("-pk")[:limit])
    for run in runs:
        run.definition = definition
        run.shown_state = reported_state(run.state, run.available_at, now)
    return runs


def next_scheduled_run(definition: JobDefinition, now: datetime) -> Run | None:
    """The earliest run the scheduler has created ahead of a cron time of the definition that
    is still to come (the partial index run_waiting_by_def: definition_id, available_at)."""
    with shards.reaching(database_of(definition.name)):
        return (
            Run.objects.filter(
                definition=definition,
                state=State.SCHEDULED,
                trigger__in=[Trigger.CRON, Trigger.CATCH_UP],
                available_at__gt=now,
            )
            .order_by("available_at", "id")
            .first()
        )


# --- audit ----------------------------------------------------------------------------------


@dataclass
class AuditFilter:
    team_ids: list[int]
    include_teamless: bool = False
    actor: str = ""
    action: str = ""
    target: str = ""
    source: str = ""
    since: datetime | None = None


def audit_page(
    flt: AuditFilter, *, before: int | None, limit: int = PAGE_SIZE
) -> tuple[list[AuditEvent], int | None]:
    """Audit events newest first by their time, keyset on (time, id) from the event whose id
    the cursor names. Not by id alone: an event kept with its rows in a shard database gets
    its id when it is relayed to the trail, after events written meanwhile."""
    scope = Q(team_id__in=flt.team_ids)
    if flt.include_teamless:
        scope |= Q(team__isnull=True)
    queryset = AuditEvent.objects.filter(scope).select_related("team")
    if flt.actor:
        queryset = queryset.filter(actor__icontains=flt.actor)
    if flt.action:
        queryset = queryset.filter(action=flt.action)
    if flt.target:
        queryset = queryset.filter(target__icontains=flt.target)
    if flt.source:
        queryset = queryset.filter(source=flt.source)
    if flt.since is not None:
        queryset = queryset.filter(created_at__gte=flt.since)
    if before is not None:
        at = queryset.filter(pk=before).values_list("created_at", flat=True).first()
        if at is None:  # gone since (retention): ids still grow with time, nearly
            queryset = queryset.filter(pk__lt=before)
        else:
            queryset = queryset.filter(Q(created_at__lt=at) | Q(created_at=at, pk__lt=before))
    page = list(queryset.order_by("-created_at", "-pk")[: limit + 1])
    more = len(page) > limit
    page = page[:limit]
    return page, (page[-1].pk if more and page else None)


def audit_for_target(team_id: int, target_type: str, target: str, limit: int = 10):
    """Served by audit_target (target_type, target)."""
    return list(
        AuditEvent.objects.filter(team_id=team_id, target_type=target_type, target=target).order_by(
            "-created_at", "-pk"
        )[:limit]
    )


def paused_by(team_id: int, target_type: str, target: str, paused: bool) -> AuditEvent | None:
    """The newest event of the target that left it paused (or running) as it is, whatever made
    it (a pause, an edit, a sync, a queue's settings): to say who did what a stale page asked
    for again. Served by audit_target (target_type, target)."""
    changed = Q(before__isnull=True) | ~Q(before__has_key="paused") | Q(before__paused=not paused)
    return (
        AuditEvent.objects.filter(
            changed, team_id=team_id, target_type=target_type, target=target, after__paused=paused
        )
        .order_by("-created_at", "-pk")
        .first()
    )
