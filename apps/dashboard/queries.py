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
from apps.runs import counters, depth, shards
from apps.runs.models import (
    FINISHED_STATES,
    PRIORITY_NAMES,
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


def _fetch_everywhere(sql: str, params: dict[str, Any]) -> list[dict[str, Any]]:
    """The rows of `sql` on every shard database, one list."""
    parts, _ = shards.gather(lambda: _fetch(sql, params))
    return [row for part in parts for row in part]


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
# The overview never reads the whole runs heap: finished and leased runs are counted from the
# index run_team_state, waiting runs from the partial index run_claimable, and everything with a
# time window (failures, throughput, latency) from the per-minute counters (apps/runs/counters.py).

# Index-only scan of run_team_state (team_id, state, -id). Succeeded runs are most of the table
# (a million entries took 200 ms to count): the overview shows those of the last 24 hours, from
# the counters.
SETTLED_COUNTS = """
SELECT state, count(*) AS n
FROM runs_run
WHERE team_id = ANY(%(teams)s::bigint[]) AND state IN ('leased', 'dead', 'cancelled')
GROUP BY state
"""

# The backlog (by state for the overview): apps.runs.depth, index-only from the partial index
# run_claimable, which includes the stored state.

# Leased runs: the partial index run_leased_expiry holds only leased rows.
LEASED_BY_QUEUE = """
SELECT team_id, queue, priority, count(*) AS leased
FROM runs_run
WHERE state = 'leased' AND team_id = ANY(%(teams)s::bigint[])
GROUP BY team_id, queue, priority
"""


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


def overview(team_ids: list[int], now: datetime) -> Overview:
    params: dict[str, Any] = {"teams": team_ids}
    counts = {state.value: 0 for state in State}
    for row in _fetch_everywhere(SETTLED_COUNTS, params):
        counts[row["state"]] += row["n"]
    lanes, waiting = _queue_lanes(team_ids, now, by_state=True)
    retrying = 0
    for state, due, later in waiting:
        counts[State.READY] += due
        counts[state] += later if state != State.READY else 0
        retrying += due + later if state == State.RETRYING else 0

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
        queues=lanes,
        latency=latency,
    )


def _queue_lanes(
    team_ids: list[int], now: datetime, *, by_state: bool = False
) -> tuple[list[dict[str, Any]], list[tuple[str, int, int]]]:
    """Per (team, queue, priority): ready, waiting, leased, oldest ready age; busiest first.
    Also (stored state, due, later) per group, for the overview's state counts."""
    lanes: dict[tuple[int, str, int], dict[str, Any]] = {}

    def lane(team_id: int, queue: str, priority: int) -> dict[str, Any]:
        return lanes.setdefault(
            (team_id, queue, priority),
            {
                "team_id": team_id,
                "queue": queue,
                "priority": priority,
                "priority_name": PRIORITY_NAMES[priority],
                "ready": 0,
                "waiting": 0,
                "leased": 0,
                "oldest_ready": None,
                "oldest_age": None,
            },
        )

    waiting = []
    for row in depth.lanes(team_ids, by_state=by_state):
        item = lane(row.team_id, row.queue, row.priority)
        item["ready"] += row.ready
        item["waiting"] += row.waiting
        oldest = row.oldest_ready
        if oldest is not None and (item["oldest_ready"] is None or oldest < item["oldest_ready"]):
            item["oldest_ready"] = oldest
            item["oldest_age"] = (now - oldest).total_seconds()
        waiting.append((row.state, row.ready, row.waiting))
    for row in _fetch_everywhere(LEASED_BY_QUEUE, {"teams": team_ids}):
        lane(row["team_id"], row["queue"], row["priority"])["leased"] += row["leased"]
    ordered = sorted(lanes.values(), key=lambda r: (-r["ready"], r["queue"], r["priority"]))
    return ordered, waiting


def queue_depth(team_ids: list[int], now: datetime) -> list[dict[str, Any]]:
    return _queue_lanes(team_ids, now)[0]


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


def queues(teams: list[Any], now: datetime) -> list[QueueRow]:
    """Every queue of the teams: those with runs, those definitions name, and paused ones."""
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
    for lane in queue_depth(team_ids, now):
        row(lane["team_id"], lane["queue"]).lanes[lane["priority_name"]] = lane
    return sorted(rows.values(), key=lambda r: (r.team.slug, r.name))


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
    """Audit events newest first, keyset on the primary key (ids grow with time)."""
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
        queryset = queryset.filter(pk__lt=before)
    page = list(queryset.order_by("-pk")[: limit + 1])
    more = len(page) > limit
    page = page[:limit]
    return page, (page[-1].pk if more and page else None)


def audit_for_target(team_id: int, target_type: str, target: str, limit: int = 10):
    """Served by audit_target (target_type, target)."""
    return list(
        AuditEvent.objects.filter(team_id=team_id, target_type=target_type, target=target).order_by(
            "-pk"
        )[:limit]
    )
