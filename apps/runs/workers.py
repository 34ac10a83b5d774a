"""Workers seen recently: which queues they ask for, the runs they hold, the leases about to lapse.

Read by `GET /api/v1/workers` and the dashboard's `/workers` alike; written from the lease and
heartbeat paths through `apps.runs.activity`, a few times a minute per worker, never per call.

- A `Worker` row (control database) keeps the queues of a worker's latest lease request, when
  it last asked for work and when one of its runs last heartbeated, by the database's clock.
- In flight: the teams' leased runs counted by `worker_id` on every shard database, with the
  lease and the last heartbeat of their current attempts: exact, whichever web process took the
  call. A worker that holds a leased run is listed whenever it was last seen.
- About to expire: leased runs in the last third of their lease. The SDK heartbeats every third,
  so a healthy lease never gets there; a run there missed its heartbeats (or nears its
  `timeoutSeconds`, which caps the lease), and one past its expiry waits for the reaper.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime

from django.db import connections

from apps.runs import shards
from apps.runs.ids import public_run_id

# The window a list may ask for (`minutes`), and how long an idle worker's row is kept: a
# worker id often names a process ("host-1/1234"), so each restart leaves one behind.
MINUTES_DEFAULT = 15
MINUTES_MAX = 24 * 60
FORGET_AFTER_MINUTES = MINUTES_MAX

MINUTES_RULE = f"A whole number of minutes from 1 to {MINUTES_MAX}."
_DIGITS = re.compile(r"[0-9]{1,5}")


def parse_minutes(raw: object) -> int | None:
    """The window of a query string's `minutes` (absent or empty: the default), or None when
    it is not a whole number from 1 to MINUTES_MAX (the API answers 400 with MINUTES_RULE)."""
    if raw is None or raw == "":
        return MINUTES_DEFAULT
    if not isinstance(raw, str) or not _DIGITS.fullmatch(raw):
        return None
    minutes = int(raw)
    return minutes if 1 <= minutes <= MINUTES_MAX else None


# --- writes (control database) -----------------------------------------------------------------

# A lease request: the worker's queues and the time it asked. Conflict target and index:
# worker_team_id_unique (team_id, worker_id). A team deleted meanwhile (its token is cached for
# a few seconds) gets no row.
RECORD_LEASE = """
INSERT INTO runs_worker (team_id, worker_id, queues, last_lease_at)
SELECT %(team_id)s, %(worker_id)s, %(queues)s::varchar[], now()
WHERE EXISTS (SELECT 1 FROM teams_team WHERE id = %(team_id)s)
ON CONFLICT (team_id, worker_id)
DO UPDATE SET queues = EXCLUDED.queues, last_lease_at = EXCLUDED.last_lease_at
"""

# Which workers hold the runs that heartbeated, with the age in seconds of each one's latest
# heartbeat: on each run's shard database, by primary key.
HEARTBEAT_HOLDERS = """
SELECT r.worker_id, min(i.age)
FROM unnest(%(ids)s::bigint[], %(ages)s::float8[]) AS i(id, age)
JOIN runs_run r ON r.id = i.id
WHERE r.team_id = %(team_id)s AND r.worker_id <> ''
GROUP BY r.worker_id
"""

# Their rows' last heartbeat, never moved back (a slower web process may write after a faster
# one). Served by worker_team_id_unique.
RECORD_HEARTBEATS = """
UPDATE runs_worker w
SET last_heartbeat_at = greatest(w.last_heartbeat_at, now() - make_interval(secs => h.age))
FROM unnest(%(workers)s::text[], %(ages)s::float8[]) AS h(worker_id, age)
WHERE w.team_id = %(team_id)s AND w.worker_id = h.worker_id
"""

# Retention: rows of workers idle past the longest window. A sequential scan of a small table
# (the workers of the last day), once per retention round.
FORGET_IDLE = """
DELETE FROM runs_worker
WHERE id IN (
    SELECT id FROM runs_worker
    WHERE greatest(last_lease_at, last_heartbeat_at) < now() - make_interval(mins => %(minutes)s)
    LIMIT %(batch)s
)
"""


def record_lease(team_id: int, queues: Sequence[str], worker_id: str) -> None:
    """Note that a worker asked these queues for work now."""
    with connections[shards.CONTROL].cursor() as cursor:
        cursor.execute(
            RECORD_LEASE, {"team_id": team_id, "worker_id": worker_id, "queues": list(queues)}
        )


def record_heartbeats(team_id: int, ages: Mapping[int, float]) -> None:
    """Note the heartbeats of these runs (run id → seconds since its latest heartbeat) on the
    rows of the workers holding them. A shard database that is down is passed over: its
    workers' heartbeats are noted by the next ones."""
    holders: dict[str, float] = {}
    for alias, ids in shards.runs_by_database(list(ages)).items():
        try:
            with shards.using(alias), shards.cursor() as cursor:
                cursor.execute(
                    HEARTBEAT_HOLDERS,
                    {"team_id": team_id, "ids": ids, "ages": [ages[pk] for pk in ids]},
                )
                rows = cursor.fetchall()
        except shards.DOWN:
            if not shards.physical():
                raise
            continue
        for worker_id, age in rows:
            holders[worker_id] = min(age, holders.get(worker_id, age))
    if not holders:
        return
    with connections[shards.CONTROL].cursor() as cursor:
        cursor.execute(
            RECORD_HEARTBEATS,
            {"team_id": team_id, "workers": list(holders), "ages": list(holders.values())},
        )


def forget_idle(batch: int) -> int:
    """Delete up to `batch` rows of workers idle for longer than any list shows; how many."""
    with connections[shards.CONTROL].cursor() as cursor:
        cursor.execute(FORGET_IDLE, {"minutes": FORGET_AFTER_MINUTES, "batch": batch})
        return cursor.rowcount


# --- reads ---------------------------------------------------------------------------------------

# Control database, served by worker_team_id_unique (team_id, …): the teams' rows, then the
# window (a team has the workers of the last day at most, see FORGET_IDLE).
SEEN = """
SELECT team_id, worker_id, queues, last_lease_at, last_heartbeat_at
FROM runs_worker
WHERE team_id = ANY(%(teams)s::bigint[])
  AND greatest(last_lease_at, last_heartbeat_at) >= now() - make_interval(mins => %(minutes)s)
"""

# Each shard database: the teams' leased runs by worker (the partial index run_leased_expiry
# holds the leased runs only), and the attempt of each worker's newest lease (the run with its
# largest fencing token, its attempt by attempt_run_number): when it was leased, and its last
# heartbeat (the SDK beats all of a worker's leases in one call). Reading every run's attempt
# instead took 140 of the page's 220 ms with 20 000 runs leased (bench/dashboard.py, 1 M runs).
# The newest as the largest [token, id, attempt]: hashed by worker, where ordering each
# worker's runs sorted them all (200 000 leased: 438 ms, the sort spilling to disk; now 140).
IN_FLIGHT = """
WITH held AS (
    SELECT r.team_id, r.worker_id, count(*) AS n,
           max(ARRAY[r.fencing_token, r.id, r.attempt]) AS newest
    FROM runs_run r
    WHERE r.team_id = ANY(%(teams)s::bigint[]) AND r.state = 'leased'
    GROUP BY r.team_id, r.worker_id
)
SELECT h.team_id, h.worker_id, h.n, a.leased_at, a.last_heartbeat_at
FROM held h
LEFT JOIN runs_attempt a ON a.run_id = h.newest[2] AND a.number = h.newest[3]
"""

# Each shard database: the teams' leased runs in the last third of their lease, soonest first.
# The inner scan reads run_leased_expiry (lease_expires_at) in order and stops after `limit`
# rows; among runs leased together (one expiry) which ones make the cut is the index's order.
# Ordering by (lease_expires_at, id) there sorted every leased run instead (200 000 leased, all
# expired: 197 ms, now 0.3). With none in their last third it still reads each leased run
# once: they are as many as the workers hold. The limit is written into the statement: a
# generic plan (plan_cache_mode) does not know a parameter's, and sorted them all again.
EXPIRING = """
SELECT r.id, r.team_id, d.name, r.queue, r.worker_id, r.attempt, r.lease_seconds,
       r.lease_expires_at, extract(epoch FROM r.lease_expires_at - now())::float8
FROM (
    SELECT id, team_id, definition_id, queue, worker_id, attempt, lease_seconds,
           lease_expires_at
    FROM runs_run
    WHERE team_id = ANY(%(teams)s::bigint[]) AND state = 'leased'
      AND lease_expires_at < now() + make_interval(secs => lease_seconds / 3.0)
    ORDER BY lease_expires_at
    LIMIT {limit:d}
) AS r
JOIN jobs_jobdefinition d ON d.id = r.definition_id
ORDER BY r.lease_expires_at, r.id
LIMIT {limit:d}
"""


@dataclass(frozen=True)
class SeenWorker:
    team_id: int
    worker_id: str
    queues: list[str]
    in_flight: int
    last_lease_at: datetime | None
    last_heartbeat_at: datetime | None


@dataclass(frozen=True)
class ExpiringLease:
    pk: int
    team_id: int
    job: str
    queue: str
    worker_id: str
    attempt: int
    lease_seconds: int
    lease_expires_at: datetime
    seconds_left: float  # negative: expired, not yet reaped

    @property
    def run_id(self) -> str:
        return public_run_id(self.pk)

    @property
    def expired(self) -> bool:
        return self.seconds_left <= 0


@dataclass
class Workers:
    workers: list[SeenWorker]
    expiring: list[ExpiringLease] = field(default_factory=list)
    unavailable: list[str] = field(default_factory=list)  # shards ("5-10") not read


def seen(team_ids: Sequence[int], minutes: int, *, expiring: int = 0) -> Workers:
    """The teams' workers seen in the last `minutes` or holding a leased run, by team and
    worker id, and (given `expiring` > 0) up to that many leases about to expire, soonest
    first. A shard database that is down leaves its runs out and is named in `unavailable`."""
    if not team_ids:
        return Workers([])
    teams = list(team_ids)
    with connections[shards.CONTROL].cursor() as cursor:
        cursor.execute(SEEN, {"teams": teams, "minutes": minutes})
        rows = cursor.fetchall()

    def read() -> tuple[list[tuple], list[tuple]]:
        with shards.cursor() as cursor:
            cursor.execute(IN_FLIGHT, {"teams": teams})
            held = cursor.fetchall()
            soon = []
            if expiring > 0:
                cursor.execute(EXPIRING.format(limit=expiring), {"teams": teams})
                soon = cursor.fetchall()
        return held, soon

    parts, unavailable = shards.gather(read)
    workers = _merge(rows, [row for held, _ in parts for row in held])
    soon = sorted(
        (ExpiringLease(*row) for _, part in parts for row in part),
        key=lambda lease: (lease.lease_expires_at, lease.pk),
    )
    return Workers(workers, soon[:expiring], unavailable)


def _merge(rows: list[tuple], held: list[tuple]) -> list[SeenWorker]:
    """One worker per (team, worker id): its row's queues and times, its runs in flight summed
    over the databases, and the later of each time."""
    merged: dict[tuple[int, str], list] = {
        (team_id, worker_id): [queues, 0, leased, beat]
        for team_id, worker_id, queues, leased, beat in rows
    }
    for team_id, worker_id, count, leased, beat in held:
        entry = merged.setdefault((team_id, worker_id), [[], 0, None, None])
        entry[1] += count
        entry[2] = _later(entry[2], leased)
        entry[3] = _later(entry[3], beat)
    return [
        SeenWorker(team_id, worker_id, sorted(queues), count, leased, beat)
        for (team_id, worker_id), (queues, count, leased, beat) in sorted(merged.items())
    ]


def _later(a: datetime | None, b: datetime | None) -> datetime | None:
    if a is None or b is None:
        return a or b
    return max(a, b)
