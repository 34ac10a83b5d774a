"""Per-minute counts of attempts started and ended (runs_minutecounts), for the overview.

The statements that lease, complete, fail and reap runs (apps/runs/store.py) add to these
counters in the same statement, through the `count_*` CTE steps below: one upsert per
(team, queue, priority) of the batch, not one per run. The overview then sums at most
minutes × slots rows per lane instead of reading every attempt of the last day.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from django.db import transaction
from psycopg.types.datetime import TimestamptzLoader

from apps.runs import shards
from apps.runs.metrics import LATENCY_BUCKETS

# Rows per (minute, team, queue, priority): each database session adds to the one its backend
# pid picks, so batches committing at the same moment rarely wait for one another's row lock.
SLOTS = 8
# Upper bounds (seconds) of the due→start buckets; one more bucket counts everything above.
LATENCY_BOUNDS: tuple[float, ...] = tuple(float(b) for b in LATENCY_BUCKETS)
# Counters older than this are deleted by the retention round: the overview looks back 24 hours.
KEEP_HOURS = 48

_ZEROS = "'{}'::int[]"
# Adds two bucket arrays element by element; either may be shorter (an empty array is none).
_ADD_LATENCY = (
    "(SELECT array_agg(coalesce(x, 0) + coalesce(y, 0) ORDER BY i)"
    " FROM unnest(c.latency, EXCLUDED.latency) WITH ORDINALITY AS u(x, y, i))"
)


def _upsert(source: str, column: str, value: str, latency: str = _ZEROS) -> str:
    # ORDER BY: every statement locks a minute's counter rows in the same order, so two batches
    # with several lanes cannot deadlock on them.
    update = f"{column} = c.{column} + EXCLUDED.{column}"
    if latency != _ZEROS:
        update += f", latency = {_ADD_LATENCY}"
    return f"""
    INSERT INTO runs_minutecounts AS c (minute, team_id, queue, priority, slot, {column}, latency)
    SELECT date_trunc('minute', now()), team_id, queue, priority, mod(pg_backend_pid(), {SLOTS}),
           {value}, {latency}
    FROM {source}
    GROUP BY team_id, queue, priority
    ORDER BY team_id, queue, priority
    ON CONFLICT (minute, team_id, queue, priority, slot) DO UPDATE SET {update}
    """


def _latency_buckets(seconds: str, condition: str) -> str:
    """`ARRAY[…]` of counts per due→start bucket of the rows that meet `condition`."""
    edges = [None, *LATENCY_BOUNDS, None]
    counts = []
    for low, high in zip(edges, edges[1:], strict=False):
        parts = [condition]
        if low is not None:
            parts.append(f"{seconds} > {low}")
        if high is not None:
            parts.append(f"{seconds} <= {high}")
        counts.append(f"(count(*) FILTER (WHERE {' AND '.join(parts)}))::int")
    return f"ARRAY[{', '.join(counts)}]"


def count_started(source: str) -> str:
    """CTE step: leases of `source` (team_id, queue, priority, attempt, late_seconds), with the
    due→start delay of first attempts by bucket."""
    return _upsert(
        source,
        "started",
        "count(*)",
        _latency_buckets("late_seconds", "attempt = 1 AND late_seconds IS NOT NULL"),
    )


def count_succeeded(source: str) -> str:
    """Count the rows of `source` that succeeded (those that ended cancelled count in neither
    column: no attempt failed, and none succeeded)."""
    return _upsert(
        f"(SELECT * FROM {source} WHERE state = 'succeeded') AS ok", "succeeded", "count(*)"
    )


def count_failed(source: str) -> str:
    return _upsert(
        f"(SELECT * FROM {source} WHERE state <> 'cancelled') AS bad", "failed", "count(*)"
    )


# --------------------------------------------------------------------------------------------
# Reading. Served by minute_counts_key (minute, team_id, …): a range of minutes, then the teams.

# Summed per hour, except the minutes since `recent`, one row each: a day's window is some
# eighty rows, not one per minute and lane (twenty thousand at 1 M runs: 100 ms of Python).
WINDOW = """
SELECT CASE WHEN minute >= %(recent)s THEN minute ELSE date_trunc('hour', minute) END,
       sum(succeeded) AS succeeded, sum(failed) AS failed
FROM runs_minutecounts
WHERE minute >= %(since)s AND team_id = ANY(%(teams)s::bigint[])
GROUP BY 1
"""
LATENCY = """
SELECT queue, priority, latency
FROM runs_minutecounts
WHERE minute >= %(since)s AND team_id = ANY(%(teams)s::bigint[]) AND latency <> '{}'
"""


@dataclass(frozen=True)
class Minute:
    minute: datetime  # an hour's start for the hours before `recent`
    succeeded: int
    failed: int


def window(team_ids: list[int], since: datetime, recent: datetime) -> list[Minute]:
    """Attempts ended since `since` (a minute boundary), summed over lanes and slots: per hour,
    and per minute from `recent` on, from the current shard database."""
    with shards.cursor() as cursor:
        # psycopg's C loader of the times, not Django's Python one (a fifth of the overview's
        # time at 1 M runs when it read a row per minute and lane).
        cursor.cursor.adapters.register_loader("timestamptz", TimestamptzLoader)
        cursor.execute(WINDOW, {"teams": team_ids, "since": since, "recent": recent})
        return [Minute(*row) for row in cursor.fetchall()]


def latency_histograms(team_ids: list[int], since: datetime) -> dict[tuple[str, int], list[int]]:
    """Due→start bucket counts of first attempts started since `since`, per (queue, priority),
    from the current shard database."""
    sums: dict[tuple[str, int], list[int]] = {}
    with shards.cursor() as cursor:
        cursor.execute(LATENCY, {"teams": team_ids, "since": since})
        for queue, priority, counts in cursor.fetchall():
            total = sums.setdefault((queue, priority), [0] * (len(LATENCY_BOUNDS) + 1))
            for i, n in enumerate(counts[: len(total)]):
                total[i] += n
    return sums


def quantile(counts: list[int], q: float) -> float | None:
    """The q-quantile of a bucketed distribution, interpolated within its bucket (as
    Prometheus's histogram_quantile does); above the last bound, that bound."""
    total = sum(counts)
    if not total:
        return None
    rank = q * total
    seen = 0
    for i, n in enumerate(counts):
        if n and seen + n >= rank:
            if i == len(LATENCY_BOUNDS):
                return LATENCY_BOUNDS[-1]
            low = LATENCY_BOUNDS[i - 1] if i else 0.0
            high = LATENCY_BOUNDS[i]
            return low + (high - low) * max(0.0, rank - seen) / n
        seen += n
    return LATENCY_BOUNDS[-1]  # not reached: the ranks stop at the total


# --------------------------------------------------------------------------------------------
# Maintenance.

# The counters of the last `hours` rebuilt from the attempts themselves, in slot 0: the
# migration that adds the table runs it, so the overview keeps its history across the upgrade.
REBUILD = f"""
WITH ended AS (
    SELECT r.team_id, r.queue, r.priority, date_trunc('minute', a.ended_at) AS minute,
           count(*) FILTER (WHERE a.outcome = 'succeeded') AS succeeded,
           count(*) FILTER (WHERE a.outcome NOT IN ('', 'succeeded')) AS failed
    FROM runs_attempt a JOIN runs_run r ON r.id = a.run_id
    WHERE a.ended_at >= now() - make_interval(hours => %(hours)s)
    GROUP BY 1, 2, 3, 4
), started AS (
    SELECT r.team_id, r.queue, r.priority, date_trunc('minute', a.leased_at) AS minute,
           count(*) AS started,
           {_latency_buckets("r.late_seconds", "a.number = 1 AND r.late_seconds IS NOT NULL")}
               AS latency
    FROM runs_attempt a JOIN runs_run r ON r.id = a.run_id
    WHERE a.leased_at >= now() - make_interval(hours => %(hours)s)
    GROUP BY 1, 2, 3, 4
)
INSERT INTO runs_minutecounts (minute, team_id, queue, priority, slot, started, succeeded,
                               failed, latency)
SELECT minute, team_id, queue, priority, 0, coalesce(s.started, 0), coalesce(e.succeeded, 0),
       coalesce(e.failed, 0), coalesce(s.latency, {_ZEROS})
FROM ended e FULL JOIN started s USING (minute, team_id, queue, priority)
ON CONFLICT (minute, team_id, queue, priority, slot) DO UPDATE
SET started = EXCLUDED.started, succeeded = EXCLUDED.succeeded, failed = EXCLUDED.failed,
    latency = EXCLUDED.latency
"""

DELETE_OLD = """
DELETE FROM runs_minutecounts WHERE minute < now() - make_interval(hours => %(hours)s)
"""


def rebuild(hours: int = KEEP_HOURS) -> int:
    """Recount the last `hours` from the attempts (slot 0); return the counter rows written."""
    with transaction.atomic(using=shards.current()), shards.cursor() as cursor:
        cursor.execute(REBUILD, {"hours": hours})
        return cursor.rowcount


def delete_old() -> int:
    with shards.cursor() as cursor:
        cursor.execute(DELETE_OLD, {"hours": KEEP_HOURS})
        return cursor.rowcount
