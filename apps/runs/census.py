"""The census: every run that is not succeeded, counted by team, queue, priority and stored state
as the dashboard's overview and queues pages show them, and the failed ones by error group as
the grouped failures show them.

Counting is an index-only scan, but it reads one index entry per run: with a backlog of 1.5 M
runs and 1.3 M failures (bench/bigtables.py with the dashboard benchmark's shares) the overview
took 749 ms, the queues page 470 and the grouped failures 414. So the scheduler counts each
shard database every SCHEDULER_CENSUS_SECONDS (`take`, in the scheduler's tick) into
runs_census and runs_failurecensus; a page counts live while its teams have at most
SCHEDULER_LIVE_COUNT_LIMIT runs to count in a database, and reads that database's census above it
(`here`, `failure_groups_here`), saying how old the figures are. A census older than three
periods (a scheduler that stopped) is not used: the page counts live, slow but true.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import NamedTuple

from django.conf import settings
from django.db import transaction

from apps.runs import depth, shards
from apps.runs.models import WAITING_STATES


class Count(NamedTuple):
    team_id: int
    queue: str  # empty for dead and cancelled runs
    priority: int  # 0 for dead and cancelled runs
    state: str  # the stored state
    due: int  # waiting runs whose availableAt has passed; for the other states all of them
    later: int  # waiting runs whose availableAt is still ahead
    oldest_due: datetime | None  # the oldest availableAt among `due`, for waiting runs


# Three scans, each of an index that holds only its states' entries or leads with them:
# 1. waiting runs: depth.DEPTH by state, index-only on the partial index run_claimable;
# 2. leased runs: the partial index run_leased_expiry (leased rows only), queue and priority
#    from the heap (leased runs are as many as the workers hold);
# 3. dead and cancelled runs: index-only on run_team_state (team_id, state, -id), per team.
# Succeeded runs are not counted: the overview shows those of the last 24 hours, from the
# per-minute counters.
COUNT = f"""
{depth.statement([], by_state=True, due_only=False)}
UNION ALL
SELECT team_id, queue, priority, state, count(*), 0, NULL
FROM runs_run
WHERE state = 'leased' AND team_id = ANY(%(teams)s::bigint[])
GROUP BY team_id, queue, priority, state
UNION ALL
SELECT team_id, '', 0, state, count(*), 0, NULL
FROM runs_run
WHERE state IN ('dead', 'cancelled') AND team_id = ANY(%(teams)s::bigint[])
GROUP BY team_id, state
"""

# The census replaced in one statement: readers see the old rows or the new ones, never neither.
# `seconds`, how long the whole census took, is set once both tables are counted (`take`).
TAKE = f"""
WITH gone AS (DELETE FROM runs_census)
INSERT INTO runs_census (team_id, queue, priority, state, due, later, oldest_due, taken_at, seconds)
SELECT c.*, statement_timestamp(), 0
FROM ({COUNT}) AS c(team_id, queue, priority, state, due, later, oldest_due)
"""

# The failed runs by error group, as apps.jobs.triage groups them: an index-only scan of the
# partial index run_failed_by_fingerprint (team_id, error_fingerprint, state, id) INCLUDE
# (definition_id, failed_at).
TAKE_FAILURES = """
WITH gone AS (DELETE FROM runs_failurecensus)
INSERT INTO runs_failurecensus (
    team_id, fingerprint, definition_id, state, n, first_at, last_at, latest, taken_at, seconds
)
SELECT team_id, error_fingerprint, definition_id, state, count(*), min(failed_at),
       max(failed_at), max(id), statement_timestamp(), 0
FROM runs_run
WHERE team_id = ANY(%(teams)s::bigint[]) AND state IN ('retrying', 'dead')
GROUP BY team_id, error_fingerprint, definition_id, state
"""

# The census of some teams, by the index census_team (team_id), with its age by the same clock.
# (Every team's, for the gauges: the whole table.)
READ = """
SELECT team_id, queue, priority, state, due, later, oldest_due, taken_at, seconds,
       extract(epoch FROM now() - taken_at)::float8 AS age
FROM runs_census
{where}
"""


# The same for the failed runs in some states, by failure_census_team (team_id), summed per
# (fingerprint, definition, state) as the live count groups them. The census's time as a
# number: each timestamp read costs the page ~10 µs, and there is a row per group and job.
READ_FAILURES = """
SELECT fingerprint, definition_id, state, sum(n)::bigint, min(first_at), max(last_at),
       max(latest), extract(epoch FROM min(taken_at))::float8, max(seconds),
       extract(epoch FROM now() - min(taken_at))::float8 AS age
FROM runs_failurecensus
WHERE team_id = ANY(%(teams)s::bigint[]) AND state = ANY(%(states)s::text[])
GROUP BY fingerprint, definition_id, state
"""


def period(seconds: float) -> float:
    """How often a census that took `seconds` is taken: SCHEDULER_CENSUS_SECONDS, or twenty
    times its own length when that is longer, so that counting stays under 5 % of the time."""
    return max(float(settings.SCHEDULER_CENSUS_SECONDS), 20 * seconds)


def take() -> float:
    """Count the current shard database's runs of every team into its census; return the
    seconds the count took."""
    from apps.teams.models import Team

    team_ids = list(Team.objects.using(shards.CONTROL).values_list("pk", flat=True))
    started = time.perf_counter()
    with transaction.atomic(using=shards.current()), shards.cursor() as cursor:
        # Two nodes may both hold the database's first shard for a moment (a handover): the
        # second waits, then its statement's snapshot sees the first's rows and replaces them
        # (without the lock, its DELETE missed them: the counts doubled). Readers never wait.
        cursor.execute("LOCK TABLE runs_census, runs_failurecensus IN EXCLUSIVE MODE")
        cursor.execute(TAKE, {"teams": team_ids})
        cursor.execute(TAKE_FAILURES, {"teams": team_ids})
        # The readers judge the census's age by the period this length gives (`period`).
        seconds = time.perf_counter() - started
        cursor.execute("UPDATE runs_census SET seconds = %s", [seconds])
        cursor.execute("UPDATE runs_failurecensus SET seconds = %s", [seconds])
    return seconds


def _usable(rows: list[tuple], runs: int) -> bool:
    """Whether a census read (taken_at, seconds and age its last three columns) stands in for a
    live count of `runs` runs: fresh, and more runs than a page counts on each load."""
    if not rows:
        return False
    seconds, age = rows[0][-2], rows[0][-1]
    return runs > settings.SCHEDULER_LIVE_COUNT_LIMIT and age <= 3 * period(seconds)


@dataclass(frozen=True)
class Counted:
    counts: list[Count]
    # When the oldest figures were counted (the census's time); None when all were counted now.
    taken_at: datetime | None = None


def _census(team_ids: list[int] | None) -> Counted | None:
    """The census of these teams (every team with None) on the current shard database, when it
    stands in for a live count: fresh, and more than SCHEDULER_LIVE_COUNT_LIMIT runs."""
    where = "" if team_ids is None else "WHERE team_id = ANY(%(teams)s::bigint[])"
    with shards.cursor() as cursor:
        cursor.execute(READ.format(where=where), {"teams": team_ids})
        rows = cursor.fetchall()
    if _usable(rows, sum(row[4] + row[5] for row in rows)):
        return Counted([Count(*row[:7]) for row in rows], rows[0][7])
    return None


def here(team_ids: list[int]) -> Counted:
    """The counts of these teams on the current shard database: from its census when that is
    fresh and holds more than SCHEDULER_LIVE_COUNT_LIMIT runs of them, else counted now."""
    if not team_ids:
        return Counted([])
    counted = _census(team_ids)
    if counted is not None:
        return counted
    with shards.cursor() as cursor:
        cursor.execute(COUNT, {"teams": team_ids})
        return Counted([Count(*row) for row in cursor.fetchall()])


def everywhere(team_ids: list[int]) -> Counted:
    """`here` on every shard database (one that is down is left out, and noted), one list."""
    parts, _ = shards.gather(lambda: here(team_ids))
    taken = [part.taken_at for part in parts if part.taken_at is not None]
    return Counted([count for part in parts for count in part.counts], min(taken, default=None))


def claimable_here() -> list[tuple] | None:
    """Every team's runs claimable now on the current shard database, per (team, queue,
    priority), as depth.DEPTH's rows (state "", waiting 0), from its census when that stands
    in for a count; else None. For the gauges and /readyz: counting 1.1 M claimable runs took
    them 300–500 ms at every scrape and probe."""
    counted = _census(None)
    if counted is None:
        return None
    lanes: dict[tuple[int, str, int], list] = {}
    for count in counted.counts:
        if count.state in WAITING_STATES and count.due:
            lane = lanes.setdefault((count.team_id, count.queue, count.priority), [0, None])
            lane[0] += count.due
            if lane[1] is None or (count.oldest_due is not None and count.oldest_due < lane[1]):
                lane[1] = count.oldest_due
    return [(*key, "", due, 0, oldest) for key, (due, oldest) in lanes.items()]


def failure_groups_here(
    team_ids: list[int], states: list[str]
) -> tuple[list[tuple], datetime] | None:
    """The failed runs of these teams in these states on the current shard database, per
    (fingerprint, definition, state): (fingerprint, definition_id, state, n, first_at, last_at,
    latest), and when they were counted; None when a page should count them itself (few, or
    no fresh census)."""
    with shards.cursor() as cursor:
        cursor.execute(READ_FAILURES, {"teams": team_ids, "states": states})
        rows = cursor.fetchall()
    if not _usable(rows, sum(row[3] for row in rows)):
        return None
    return [row[:7] for row in rows], datetime.fromtimestamp(rows[0][7], UTC)
