"""Queue depth: the backlog per (team, queue, priority), read by the queues API, the dashboard
and the /metrics gauges alike.

A lane counts the waiting runs that are claimable now (`ready`: availableAt passed) and those
still in the future (`waiting`), with the oldest claimable run's availableAt and its age in
seconds by the database's clock.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from django.db import connections

from apps.runs import shards
from apps.runs.clock import database_now
from apps.runs.models import WAITING_STATES


@dataclass(frozen=True)
class Lane:
    team_id: int
    team_slug: str
    queue: str
    priority: int
    state: str  # "" (lanes are not split by stored state; the census's counts are)
    ready: int
    waiting: int
    oldest_ready: datetime | None
    oldest_age: float | None


# An index-only scan of the partial index run_claimable
# (team_id, queue, priority, available_at, id) INCLUDE (state) WHERE state is waiting: only the
# backlog is read, never the finished runs, and grouping by state stays index-only.
# Callers that want only what is claimable now also filter available_at in the scan (an index
# condition): the future runs are never aggregated (1 M runs, 150 000 waiting, half of them in
# the future: 4 ms instead of 5.5 for one team, 21-24 ms for all five).
DEPTH = """
SELECT team_id, queue, priority, {state} AS state,
       count(*) FILTER (WHERE available_at <= now()) AS ready,
       count(*) FILTER (WHERE available_at > now()) AS waiting,
       min(available_at) FILTER (WHERE available_at <= now()) AS oldest_ready
FROM runs_run
WHERE state IN {waiting}{teams}{due}
GROUP BY team_id, queue, priority{group_state}
"""


def statement(team_ids: list[int] | None, *, by_state: bool, due_only: bool) -> str:
    """DEPTH for these teams (every team with None), grouped by stored state too or not."""
    return DEPTH.format(
        state="state" if by_state else "''",
        waiting=tuple(WAITING_STATES),
        teams="" if team_ids is None else " AND team_id = ANY(%(teams)s::bigint[])",
        group_state=", state" if by_state else "",
        due=" AND available_at <= now()" if due_only else "",
    )


def lanes(team_ids: list[int] | None = None, *, due_only: bool = False) -> list[Lane]:
    """The backlog of the given teams (every team with None), one lane per (team, queue,
    priority) with any waiting run; with `due_only`, only the lanes with runs claimable now,
    and `waiting` is 0.

    Summed over the shard databases (one that is down is left out, and noted); the age of the
    oldest run is by the control database's clock, the team's slug from the control database."""
    if team_ids is not None and not team_ids:
        return []
    sql = statement(team_ids, by_state=False, due_only=due_only)

    def read() -> list[tuple]:
        with shards.cursor() as cursor:
            cursor.execute(sql, {"teams": team_ids})
            return cursor.fetchall()

    parts, _ = shards.gather(read)
    return _merge(parts)


def _merge(parts: list[list[tuple]]) -> list[Lane]:
    """One lane per key from the shard databases' groups: counts summed, the oldest kept."""
    summed: dict[tuple[int, str, int, str], list] = {}
    for team_id, queue, priority, state, ready, waiting, oldest in (r for p in parts for r in p):
        lane = summed.setdefault((team_id, queue, priority, state), [0, 0, None])
        lane[0] += ready
        lane[1] += waiting
        if oldest is not None and (lane[2] is None or oldest < lane[2]):
            lane[2] = oldest
    teams = shards.teams_by_id({key[0] for key in summed})
    now = database_now()
    return [
        Lane(
            team_id=team_id,
            team_slug=teams[team_id].slug,
            queue=queue,
            priority=priority,
            state=state,
            ready=ready,
            waiting=waiting,
            oldest_ready=oldest,
            oldest_age=None if oldest is None else (now - oldest).total_seconds(),
        )
        for (team_id, queue, priority, state), (ready, waiting, oldest) in summed.items()
        if team_id in teams  # a team deleted meanwhile
    ]


def claimable(team_ids: list[int] | None = None) -> list[Lane]:
    """The lanes with runs claimable now (what a worker's lease could take)."""
    return lanes(team_ids, due_only=True)


def claimable_by_database() -> tuple[list[Lane], dict[str, int | None]]:
    """Every team's claimable lanes, and the claimable runs of each shard database by its
    shards ("0-7"), None for one that could not be read (the /metrics gauges and /readyz).
    Above SCHEDULER_LIVE_COUNT_LIMIT runs in a database, its census's figures
    (apps/runs/census.py)."""
    from apps.runs import census  # it builds its count from this module's statement

    sql = statement(None, by_state=False, due_only=True)
    parts: list[list[tuple]] = []
    per_database: dict[str, int | None] = {}
    for alias in shards.databases():
        try:
            with shards.using(alias), shards.cursor() as cursor:
                rows = census.claimable_here()  # at a big backlog; else counted now
                if rows is None:
                    cursor.execute(sql)
                    rows = cursor.fetchall()
        except shards.UNREADABLE:
            if not shards.physical():
                raise
            connections[alias].close()
            per_database[shards.span(alias)] = None
            continue
        parts.append(rows)
        per_database[shards.span(alias)] = sum(row[4] for row in rows)
    return _merge(parts), per_database
