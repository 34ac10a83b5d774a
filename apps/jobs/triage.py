"""Failures grouped by error: the dashboard's grouped failures and dead-letter queue.

A group is the runs whose last error has one fingerprint (apps/runs/fingerprints.py, stored by
the fail and reap statements): how many, the first and last failure, the jobs affected, and the
newest run as a sample. The runs are read from every shard database and merged.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from apps.jobs.models import JobDefinition
from apps.runs import census, fingerprints, shards
from apps.runs.filters import BulkFilter
from apps.runs.models import Run

# Groups shown on a page, most runs first (a page that lists them all would be its own incident).
GROUPS_SHOWN = 100

# Per (group, definition) of the teams' failed runs: an index-only scan of the partial index
# run_failed_by_fingerprint (team_id, error_fingerprint, state, id) INCLUDE (definition_id,
# failed_at), hashed by group and job; the other filters (queue, due window, error text) read
# the rows they test. EXPLAIN ANALYZE with 1 M runs, 130 000 of them failed (bench/dashboard.py's
# data, 5 teams, 7 errors), warm cache: five teams 52 ms (Parallel Index Only Scan, Heap
# Fetches: 0, 2 265 buffers), one team's 26 000 in 11.5 ms; the same grouping from the table
# (run_team_state, then the heap) read 8 530 buffers in 93 ms. The pages (`bench dashboard`):
# grouped failures 92 ms median for a superuser of the five teams, 24 ms for one team.
GROUPS = """
SELECT r.error_fingerprint AS fingerprint, r.definition_id, r.state, count(*) AS n,
       min(r.failed_at) AS first_at, max(r.failed_at) AS last_at, max(r.id) AS latest
FROM runs_run r
WHERE r.team_id = ANY(%(teams)s::bigint[]) AND r.state = ANY(%(states)s::text[]) AND {where}
GROUP BY r.error_fingerprint, r.definition_id, r.state
"""


@dataclass
class Group:
    """The failed runs of one error fingerprint (None: runs that failed before fingerprints)."""

    fingerprint: int | None
    count: int = 0
    first_at: datetime | None = None
    last_at: datetime | None = None
    latest: int = 0  # the newest run's id
    jobs: dict[str, int] = field(default_factory=dict)  # job name → runs
    # (team id, state) → runs: what an action may change is counted by team and state.
    shares: dict[tuple[int, str], int] = field(default_factory=dict)
    sample: Run | None = None

    def count_in(self, team_ids: Iterable[int], states: Iterable[str] | None = None) -> int:
        """The group's runs that belong to `team_ids` (those a user may act on, say), and
        are in `states` when given (those an action accepts)."""
        teams, wanted = set(team_ids), None if states is None else set(states)
        return sum(
            n
            for (team_id, state), n in self.shares.items()
            if team_id in teams and (wanted is None or state in wanted)
        )

    @property
    def key(self) -> str:
        """The group in a URL (`?group=…`): 16 hex digits; empty for runs without one."""
        return fingerprints.to_hex(self.fingerprint) if self.fingerprint is not None else ""

    @property
    def label(self) -> str:
        """The error as the group reads, placeholders for what varies."""
        error = self.sample.last_error if self.sample is not None else None
        if not error:
            return "(no error recorded)"
        return fingerprints.normalise(str(error.get("type") or ""), str(error.get("message") or ""))

    @property
    def job_names(self) -> list[str]:
        return sorted(self.jobs, key=lambda name: (-self.jobs[name], name))


@dataclass
class Grouping:
    groups: list[Group]  # the largest GROUPS_SHOWN
    total_groups: int
    total_runs: int
    # When the groups were counted, if not now (apps.runs.census: a page without filters).
    counted_at: datetime | None = None


def _earliest(a: datetime | None, b: datetime | None) -> datetime | None:
    return b if a is None or (b is not None and b < a) else a


def _latest(a: datetime | None, b: datetime | None) -> datetime | None:
    return b if a is None or (b is not None and b > a) else a


def _here(
    params: dict[str, Any], sql: str | None
) -> tuple[list[tuple[Any, str, int, str, int, Any, Any, int]], datetime | None]:
    """This shard database's rows, each with its definition's name and team, and when they were
    counted if not now. Without `sql` (no filter), from the census when it stands in for a
    count (apps.runs.census)."""
    counted = None if sql else census.failure_groups_here(params["teams"], params["states"])
    if counted is not None:
        rows, taken_at = counted
    else:
        with shards.cursor() as cursor:
            cursor.execute(sql or GROUPS.format(where="true"), params)
            rows, taken_at = cursor.fetchall(), None
    owners = {
        pk: (name, team_id)
        for pk, name, team_id in JobDefinition.objects.filter(
            pk__in={row[1] for row in rows}
        ).values_list("pk", "name", "team_id")
    }
    return [
        (fingerprint, *owners.get(definition, ("?", 0)), state, n, first, last, latest)
        for fingerprint, definition, state, n, first, last, latest in rows
    ], taken_at


def groups(
    team_ids: Sequence[int], states: Sequence[str], flt: BulkFilter, *, limit: int = GROUPS_SHOWN
) -> Grouping:
    """The failed runs of `team_ids` in `states` that `flt` selects, grouped by error, the
    largest groups first (then the latest failure), each with its newest run as a sample."""
    if not team_ids or not states:
        return Grouping([], 0, 0)
    where, params = flt.where()
    params = {**params, "teams": list(team_ids), "states": list(states)}
    sql = None if flt.everything else GROUPS.format(where=where)
    parts, _ = shards.gather(lambda: _here(params, sql))
    by_key: dict[int | None, Group] = {}
    for fingerprint, job, team_id, state, n, first, last, latest in (
        row for part, _ in parts for row in part
    ):
        group = by_key.setdefault(fingerprint, Group(fingerprint))
        group.count += n
        group.shares[team_id, state] = group.shares.get((team_id, state), 0) + n
        group.first_at = _earliest(group.first_at, first)
        group.last_at = _latest(group.last_at, last)
        group.latest = max(group.latest, latest)
        group.jobs[job] = group.jobs.get(job, 0) + n
    ordered = sorted(
        by_key.values(),
        key=lambda g: (-g.count, -(g.last_at.timestamp() if g.last_at else 0), g.latest),
    )
    shown = ordered[:limit]
    samples: dict[int, Run] = {}
    for alias, ids in shards.runs_by_database([group.latest for group in shown]).items():
        with shards.using(alias):
            samples.update(Run.objects.only("id", "last_error").in_bulk(ids))
    for group in shown:
        group.sample = samples.get(group.latest)
    taken = [taken_at for _, taken_at in parts if taken_at is not None]
    return Grouping(
        shown, len(ordered), sum(group.count for group in ordered), min(taken, default=None)
    )
