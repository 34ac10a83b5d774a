"""The critical path: every statement that claims, extends, finishes or reaps a run.

Read top to bottom: insert, claim, heartbeat, complete, fail, reap. Each statement says which index
serves it. Every state change is a conditional UPDATE (`WHERE state = 'leased' AND fencing_token =
…`): when its row count is 0 another process got there first and nothing is changed. Time is the
database's `now()`, never the caller's clock. Workers' calls are batches; a single call is a batch
of one, so both obey the same rules. The statements that lease and end attempts also add to the
per-minute counters the overview reads (apps/runs/counters.py), in the same statement.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, NamedTuple, TypeVar

import orjson
import psycopg
from django.conf import settings
from django.db import DatabaseError, InterfaceError, OperationalError, connections, transaction
from django.db.backends.utils import CursorWrapper
from psycopg import _queries as psycopg_queries
from psycopg.types.datetime import TimestamptzLoader

from apps.runs import counters, fingerprints, logs, metrics, payloads
from apps.runs import shards as placement
from apps.runs.fairness import interleave_teams, slot_priorities
from apps.runs.floors import OLDEST_TRANSACTION, floors
from apps.runs.ids import public_run_id
from apps.runs.logs import run_event
from apps.runs.models import SCHEDULED_TRIGGERS
from apps.runs.shards import ID_SPACE
from scheduler_site.database import CommitRefused

T = TypeVar("T", bound=tuple)

WAITING = "('scheduled', 'ready', 'retrying')"
# A definition `d` with a limit: its runs are `limited` (apps/runs/models.py, Run.limited).
LIMITED = (
    "(d.concurrency IS NOT NULL OR d.concurrency_per_key IS NOT NULL"
    " OR d.rate_limit_count IS NOT NULL)"
)
READY_CHANNEL = "runs_ready"

log = logging.getLogger(__name__)

# psycopg turns a statement's %(name)s placeholders into $n once and caches that, but only for
# statements up to 4 KB (psycopg/_queries.py): the claim's, 10 KB with its comments, was parsed
# again on every claim (87 µs each, measured here). The statements of this module are few and
# fixed; an ORM's long ones stay out of the cache by their number of parameters (over 50).
if getattr(psycopg_queries, "MAX_CACHED_STATEMENT_LENGTH", 0) < 16_384:
    psycopg_queries.MAX_CACHED_STATEMENT_LENGTH = 16_384


def server_cursor() -> CursorWrapper:
    """A cursor on Django's connection to the current shard database (apps/runs/shards.py; same
    transaction, same execute wrappers) that binds parameters on the server, unlike Django's
    own: psycopg then prepares each statement on the connection after its fifth execution, and
    a claim stops paying its planning (twice its execution at batch 100) on every call.
    Timestamps load with psycopg's C loader, not Django's Python one (a fifth of a claim's
    Python time): both give aware UTC datetimes."""
    connection = connections[placement.current()]
    connection.close_if_health_check_failed()
    connection.ensure_connection()
    with connection.wrap_database_errors:
        raw = psycopg.Cursor(connection.connection)
    raw.adapters.register_loader("timestamptz", TimestamptzLoader)
    return connection._prepare_cursor(raw)


def atomic(**kwargs: Any) -> transaction.Atomic:
    """A transaction on the current shard database."""
    return transaction.atomic(using=placement.current(), **kwargs)


def array_literal(values: Sequence[int | str | datetime | None]) -> str:
    """Return a PostgreSQL array literal ("{1,2,NULL}") for ints, texts or aware datetimes.

    psycopg adapts list parameters element by element in Python; one str.join is about three
    times cheaper at 5 000 elements (the materialiser's UPDATE of next_due_at, every batch).
    """
    items = []
    for value in values:
        if value is None:
            items.append("NULL")
        elif isinstance(value, int):
            items.append(str(value))
        elif isinstance(value, datetime):
            items.append(value.isoformat())
        else:
            items.append('"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"')
    return "{" + ",".join(items) + "}"


def _bigints(values: Iterable[int]) -> str:
    """array_literal for integers only, the claim path's ids and tokens: at batch 100 psycopg's
    adaptation of a list took longer than the statement it was sent with."""
    return "{" + ",".join(map(str, values)) + "}"


def _json(value: Any) -> str:
    """A statement's JSON document: orjson (a batch of 1 000 runs: 4.5 ms by json.dumps, under
    1 ms), or the standard library for an integer past 64 bits, which orjson refuses."""
    try:
        return orjson.dumps(value).decode()
    except TypeError:
        return json.dumps(value, separators=(",", ":"))


def _rows(cursor) -> list[dict[str, Any]]:
    names = [col.name for col in cursor.description]
    return [dict(zip(names, row, strict=True)) for row in cursor.fetchall()]


def notify_ready(queues: Iterable[str]) -> None:
    """Wake long-polling claimers of these queues when the transaction commits (one NOTIFY each)."""
    distinct = sorted(set(queues))
    if distinct:
        with server_cursor() as cursor:
            cursor.execute(
                "SELECT pg_notify(%s, q) FROM unnest(%s::text[]) AS q", [READY_CHANNEL, distinct]
            )


# ---------------------------------------------------------------------------------------------
# Insert. Both unique constraints (definition + due time for scheduled runs, definition +
# idempotency key for all) make a repeated insert a no-op: ON CONFLICT DO NOTHING. A batch with
# no scheduled run can conflict on its key alone: naming that index as the only arbiter spares
# a check of the primary key per run (1 000 runs: 0.7-1.4 ms of 19-23, three interleaved series
# of 90 inserts).

_INSERT_RUNS = """
INSERT INTO runs_run (
    id, definition_id, team_id, queue, priority, shard, state, trigger, due_at, available_at,
    attempt, max_attempts, idempotency_key, concurrency_key, lease_seconds, worker_id, dry_run,
    payload, payload_key, created_at, limited
)
-- The id names the run's shard (apps/runs/shards.py).
SELECT nextval('runs_run_id_seq') * {space} + d.shard, i.definition_id, d.team_id, d.queue,
       coalesce(i.priority, d.priority), d.shard, 'scheduled', i.trigger, i.due_at,
       i.available_at, 0, d.retry_max_attempts, i.idempotency_key,
       -- A run given no key takes its payload's field named by concurrencyKeyField, if any
       -- (a cron run's payload is its definition's); an empty value is no key. A value past a
       -- key's 200 characters keeps its first 167 and the digest of the whole, so that two
       -- values sharing a start stay two keys.
       coalesce(i.concurrency_key, CASE WHEN d.concurrency_key_field <> '' THEN (
           SELECT CASE WHEN length(v) <= 200 THEN v ELSE left(v, 167) || '#' || md5(v) END
           FROM nullif((CASE WHEN i.own THEN i.payload ELSE d.payload END)
                       ->> d.concurrency_key_field, '') AS v) END),
       60, '', d.dry_run,
       CASE WHEN i.own THEN i.payload ELSE d.payload END,
       CASE WHEN i.own THEN i.payload_key ELSE d.payload_key END, now(), {limited}
FROM ROWS FROM (
         json_to_recordset(%(rows)s::json)
         AS (definition_id bigint, trigger text, due_at timestamptz, available_at timestamptz,
             idempotency_key text, concurrency_key text, own boolean, payload jsonb,
             payload_key text, priority smallint)
     ) WITH ORDINALITY
     AS i(definition_id, trigger, due_at, available_at, idempotency_key, concurrency_key, own,
          payload, payload_key, priority, n)
JOIN jobs_jobdefinition d ON d.id = i.definition_id
-- Repeating the ids as a filter lets the planner probe the definitions' primary key instead of
-- walking the whole index.
WHERE d.id = ANY(%(definition_ids)s::bigint[]) AND NOT d.deleting
-- One order for every inserter: two batches naming the same keys in different orders would
-- otherwise each wait on the other's uncommitted row (a deadlock). A key given twice in one
-- batch is its first item's run (`n`, the item's place): PostgreSQL's sort keeps no order
-- among equal keys, and the later item's payload was stored in some batches of 7 to 12.
ORDER BY i.definition_id, i.idempotency_key, i.n
-- The key-share lock makes `limited` exact: a change of the definition's limits (under the
-- edit's FOR UPDATE, which rewrites its runs' flags: MARK_LIMITED) waits for this insert to
-- commit, or this insert for it, and then reads the definition as changed. The scheduler's own
-- lock on the definition (NO KEY UPDATE) does not conflict with it. It also stands for the
-- foreign key the database does not check (apps/runs/models.py): a definition is deleted only
-- after its inserts commit, and then with their runs.
FOR KEY SHARE OF d
ON CONFLICT {arbiter} DO NOTHING
RETURNING id, queue, available_at <= now() AS ready_now, definition_id, idempotency_key{more}
"""
# The columns a new run's representation needs, answered so that a batch created through the
# API is answered without reading its runs back (1 000 runs read through the ORM took 60 ms,
# more than their insert).
_WHOLE_RUN = (
    ", team_id, priority, state, trigger, due_at, available_at, attempt, max_attempts,"
    " dry_run, payload::text AS payload, payload_key, concurrency_key, created_at"
)
# (answering whole runs, no scheduled run among them): the statement.
_INSERTS = {
    (whole, keyed): _INSERT_RUNS.format(
        more=_WHOLE_RUN if whole else "",
        arbiter="(definition_id, idempotency_key)" if keyed else "",
        space=ID_SPACE,
        limited=LIMITED,
    )
    for whole in (False, True)
    for keyed in (False, True)
}
INSERT_RUNS = _INSERTS[False, False]


class NewRun(NamedTuple):
    """A run to insert. This and the other values made once per run (Lease, Outcome, and
    enqueue's Wanted and Enqueued) are named tuples: as immutable as a frozen dataclass, whose
    __init__ sets each field through object.__setattr__ and cost 1.7 µs against 0.3 µs for
    eight fields (4.2 against 2.0 µs for a lease's sixteen, by keyword; measured here)."""

    definition_id: int
    trigger: str
    due_at: datetime
    available_at: datetime
    idempotency_key: str
    payload: Any = None  # None: the definition's payload
    priority: int | None = None  # None: the definition's priority
    concurrency_key: str | None = None


def insert_runs(runs: Sequence[NewRun]) -> list[int]:
    """Insert runs, skipping any that already exist; return the ids of the new ones, in the
    order of `runs` (the statement inserts them in key order)."""
    keyed = insert_keyed(runs)
    names = dict.fromkeys((run.definition_id, run.idempotency_key) for run in runs)
    return [keyed[name] for name in names if name in keyed]


def insert_keyed(runs: Sequence[NewRun], *, full: bool = False) -> dict[tuple[int, str], Any]:
    """Insert runs, skipping any that already exist; the new ones' ids (with `full`, their
    columns as a dict) by (definition id, idempotency key), in the order the statement
    returned them.

    A payload over 4 KB goes to object storage first and the run keeps its key. Runs already
    claimable wake the queue's waiting workers with one NOTIFY per queue.
    """
    if not runs:
        return {}
    # One JSON document instead of eight arrays: serialised in C (orjson, _json), while adapting
    # arrays element by element in Python took longer than the insert itself. Scheduled runs share a
    # few due times (a fleet's "0 * * * *"), so each distinct time is formatted once.
    iso: dict[datetime, str] = {}

    def text(moment: datetime) -> str:
        formatted = iso.get(moment)
        if formatted is None:
            formatted = iso[moment] = moment.isoformat()
        return formatted

    rows = []
    for run, (inline, key) in zip(
        runs, payloads.place_all(run.payload for run in runs), strict=True
    ):
        rows.append(
            {
                "definition_id": run.definition_id,
                "trigger": run.trigger,
                "due_at": text(run.due_at),
                "available_at": text(run.available_at),
                "idempotency_key": run.idempotency_key,
                "concurrency_key": run.concurrency_key,
                "own": run.payload is not None,
                "payload": inline,
                "payload_key": key,
                "priority": run.priority,
            }
        )
    params = {
        "rows": _json(rows),
        "definition_ids": sorted({run.definition_id for run in runs}),
    }
    # Inside a caller's transaction (enqueue audits in it), no savepoint: two round trips
    # fewer, and a failed insert fails the caller's transaction all the same.
    with atomic(savepoint=False), server_cursor() as cursor:
        keyed = not any(run.trigger in SCHEDULED_TRIGGERS for run in runs)
        cursor.execute(_INSERTS[full, keyed], params)
        inserted = _rows(cursor)
        notify_ready(row["queue"] for row in inserted if row["ready_now"])
    return {
        (row["definition_id"], row["idempotency_key"]): row if full else row["id"]
        for row in inserted
    }


# ---------------------------------------------------------------------------------------------
# Claim, step 1: lock candidates. One "lane" per (team, asked queue, priority) that is not
# paused; for each lane, the oldest claimable runs of unpaused definitions, served by the
# partial index run_claimable (team_id, queue, priority, available_at) WHERE state is waiting.
# SKIP LOCKED lets concurrent claimers take the next rows instead of queueing behind ours.
# The tick (a shared sequence) places this claim in the priority pattern and the team rotation.

# The lanes, read from the teams and queue settings of the same database (every shard on the
# control database)…
LANES_HERE = """
    SELECT t.id AS team_id, q.name AS queue, p.priority, room.n AS room,
           fl.at AS floor_at, fl.id AS floor_id
    FROM teams_team t
    CROSS JOIN unnest(%(queues)s::text[]) AS q(name)
    CROSS JOIN (VALUES (0), (1), (2)) AS p(priority)
    LEFT JOIN unnest(%(room_teams)s::bigint[], %(room_queues)s::text[], %(rooms)s::int[])
         AS room(team_id, queue, n) ON room.team_id = t.id AND room.queue = q.name
    LEFT JOIN unnest(%(floor_teams)s::bigint[], %(floor_queues)s::text[],
                     %(floor_priorities)s::int[], %(floor_ats)s::timestamptz[],
                     %(floor_ids)s::bigint[]) AS fl(team_id, queue, priority, at, id)
         ON fl.team_id = t.id AND fl.queue = q.name AND fl.priority = p.priority
    WHERE (%(team_ids)s::bigint[] IS NULL OR t.id = ANY(%(team_ids)s::bigint[]))
      AND coalesce(room.n, 1) > 0
      AND NOT EXISTS (
          SELECT 1 FROM jobs_queue jq WHERE jq.team_id = t.id AND jq.name = q.name AND jq.paused
      )"""
# … or, on a shard database of its own, from the control database's answer (control_lanes):
# the teams, and the paused queues as (team, queue) pairs. Both join the room left in each
# rate-limited queue's window (queue_rooms, taken before the claim): a lane without room is left
# out, one with room gives at most that many candidates. Both join the lanes' claim floors
# (apps/runs/floors.py: given only while another session holds an old snapshot).
LANES_GIVEN = """
    SELECT t.id AS team_id, q.name AS queue, p.priority, room.n AS room,
           fl.at AS floor_at, fl.id AS floor_id
    FROM unnest(%(team_ids)s::bigint[]) AS t(id)
    CROSS JOIN unnest(%(queues)s::text[]) AS q(name)
    CROSS JOIN (VALUES (0), (1), (2)) AS p(priority)
    LEFT JOIN unnest(%(room_teams)s::bigint[], %(room_queues)s::text[], %(rooms)s::int[])
         AS room(team_id, queue, n) ON room.team_id = t.id AND room.queue = q.name
    LEFT JOIN unnest(%(floor_teams)s::bigint[], %(floor_queues)s::text[],
                     %(floor_priorities)s::int[], %(floor_ats)s::timestamptz[],
                     %(floor_ids)s::bigint[]) AS fl(team_id, queue, priority, at, id)
         ON fl.team_id = t.id AND fl.queue = q.name AND fl.priority = p.priority
    WHERE coalesce(room.n, 1) > 0
      AND NOT EXISTS (
        SELECT 1 FROM unnest(%(paused_teams)s::bigint[], %(paused_queues)s::text[]) AS x(t, q)
        WHERE x.t = t.id AND x.q = q.name
    )"""

# How long a claim on a shard database of its own waits for a lock (CLAIM_LOCK_TIMEOUT, below).
CLAIM_LOCK_WAIT = "200ms"

_CLAIM_CANDIDATES = f"""
WITH lane AS ({{lanes}}
), candidate AS (
    -- Runs of definitions without a limit: the lane's oldest, up to max, read from the part of
    -- run_claimable where `limited` is false (runs of limited definitions are not in that range).
    -- Runs of paused definitions (and of those being deleted) are filtered out row by row, so a
    -- large backlog of theirs at the head of the lane is scanned past on every claim (a known
    -- cost, see the README); so are the runs inserted before their definition got a limit and
    -- not yet marked (none: the change marks them in its transaction). A lane with a floor
    -- starts past it: a bound of the index scan (row comparison on its last two columns), not a
    -- walk.
    SELECT c.* FROM lane
    CROSS JOIN LATERAL (
        SELECT r.id, r.team_id, r.queue, r.priority, r.definition_id, NULL::int AS concurrency,
               NULL::int AS per_key, NULL::text AS concurrency_key, NULL::int AS rate_count,
               NULL::int AS rate_period, r.available_at
        FROM runs_run r
        JOIN jobs_jobdefinition d ON d.id = r.definition_id
        WHERE r.team_id = lane.team_id AND r.queue = lane.queue AND r.priority = lane.priority
          AND NOT r.limited AND r.state IN {WAITING} AND r.available_at <= now()
          AND (r.available_at, r.id)
              > (coalesce(lane.floor_at, '-infinity'), coalesce(lane.floor_id, 0))
          AND NOT d.paused AND NOT d.deleting AND d.concurrency IS NULL AND d.concurrency_per_key IS NULL
          AND d.rate_limit_count IS NULL
          AND (%(jobs)s::text[] IS NULL OR d.name = ANY(%(jobs)s::text[]))
          AND (%(shards)s::int[] IS NULL OR d.shard = ANY(%(shards)s::int[]))
        ORDER BY r.available_at, r.id
        LIMIT least(lane.room, %(max)s)
        FOR UPDATE OF r SKIP LOCKED
    ) AS c
    UNION ALL
    -- Runs of each definition of the lane with a concurrency or rate limit (and none per key),
    -- at most its limit of them, so a definition at its limit cannot crowd the lane's other
    -- definitions out of the batch. Served by the definitions' team index and the partial
    -- index run_waiting_by_def.
    SELECT c.* FROM lane
    JOIN jobs_jobdefinition d
      ON d.team_id = lane.team_id AND NOT d.paused AND NOT d.deleting
     AND d.concurrency_per_key IS NULL
     AND (d.concurrency IS NOT NULL OR d.rate_limit_count IS NOT NULL)
     -- A spent rate window (set by the claim that found it full) skips the definition whole.
     AND (d.rate_blocked_until IS NULL OR d.rate_blocked_until <= now())
     AND (%(jobs)s::text[] IS NULL OR d.name = ANY(%(jobs)s::text[]))
     AND (%(shards)s::int[] IS NULL OR d.shard = ANY(%(shards)s::int[]))
    CROSS JOIN LATERAL (
        -- A run keeps the queue and priority it was created with, so match the lane's.
        SELECT r.id, r.team_id, r.queue, r.priority, r.definition_id, d.concurrency,
               NULL::int AS per_key, r.concurrency_key,
               d.rate_limit_count AS rate_count, d.rate_limit_period_seconds AS rate_period,
               r.available_at
        FROM runs_run r
        WHERE r.definition_id = d.id AND r.queue = lane.queue AND r.priority = lane.priority
          AND r.state IN {WAITING} AND r.available_at <= now()
        ORDER BY r.available_at, r.id
        LIMIT least(d.concurrency, d.rate_limit_count, lane.room, %(max)s)
        FOR UPDATE OF r SKIP LOCKED
    ) AS c
    UNION ALL
    -- Runs of each definition with a limit per key of the lanes' teams, from
    -- run_waiting_limited, in the lanes. Its keys with waiting runs are visited one index
    -- probe each, in key order from the one after where this process's last visit of it ended
    -- (`after`: the last key its previous visit reached), wrapping round, at most %(keys)s of
    -- them: every key is reached in turn, however many there are. A key at its limit costs one count of its leased runs
    -- (run_leased_by_key), never a scan of its backlog; one with room gives its oldest runs, as
    -- many as that room. Then the runs without a key, held by the definition's own limits
    -- only. Once per definition, not per lane: the visit is the costly part (a definition
    -- with 1 000 keys all at their limit: bench/README.md, "Flow control").
    SELECT c.* FROM jobs_jobdefinition d
    LEFT JOIN unnest(%(after_ids)s::bigint[], %(after_keys)s::text[]) AS after(id, key)
      ON after.id = d.id
    CROSS JOIN LATERAL (
        WITH RECURSIVE visit(key, n, wrapped, first) AS (
            SELECT coalesce(f.next, f.first)::text, 1, f.next IS NULL, f.first::text
            FROM (SELECT
                (SELECT k.concurrency_key FROM runs_run k
                 WHERE k.definition_id = d.id AND k.state IN {WAITING} AND k.limited
                   AND k.concurrency_key > coalesce(after.key, '')
                 ORDER BY k.concurrency_key LIMIT 1) AS next,
                (SELECT k.concurrency_key FROM runs_run k
                 WHERE k.definition_id = d.id AND k.state IN {WAITING} AND k.limited
                   AND k.concurrency_key IS NOT NULL
                 ORDER BY k.concurrency_key LIMIT 1) AS first
            ) AS f
            UNION ALL
            SELECT coalesce(s.next, CASE WHEN NOT v.wrapped THEN v.first END)::text, v.n + 1,
                   v.wrapped OR s.next IS NULL, v.first
            FROM visit v
            CROSS JOIN LATERAL (
                SELECT (SELECT k.concurrency_key FROM runs_run k
                        WHERE k.definition_id = d.id AND k.state IN {WAITING} AND k.limited
                          AND k.concurrency_key > v.key
                        ORDER BY k.concurrency_key LIMIT 1) AS next
            ) AS s
            WHERE v.key IS NOT NULL AND v.n < %(keys)s
              AND NOT (v.wrapped AND v.key >= coalesce(after.key, ''))
        ), reached AS (
            SELECT key, n FROM visit
            WHERE key IS NOT NULL AND NOT (wrapped AND key > coalesce(after.key, ''))
        )
        SELECT * FROM (
        SELECT r.* FROM reached v
        CROSS JOIN LATERAL (
            SELECT r.id, r.team_id, r.queue, r.priority, r.definition_id, d.concurrency,
                   d.concurrency_per_key AS per_key, r.concurrency_key,
                   d.rate_limit_count AS rate_count,
                   d.rate_limit_period_seconds AS rate_period, r.available_at
            FROM runs_run r
            WHERE r.definition_id = d.id AND r.concurrency_key = v.key
              AND r.state IN {WAITING} AND r.limited AND r.available_at <= now()
              AND EXISTS (SELECT 1 FROM lane WHERE lane.team_id = r.team_id
                          AND lane.queue = r.queue AND lane.priority = r.priority)
            ORDER BY r.available_at, r.id
            LIMIT greatest(0, d.concurrency_per_key - (
                SELECT count(*) FROM runs_run l
                WHERE l.definition_id = d.id AND l.concurrency_key = v.key
                  AND l.state = 'leased'))
            FOR UPDATE OF r SKIP LOCKED
        ) AS r
        UNION ALL
        SELECT * FROM (
            SELECT r.id, r.team_id, r.queue, r.priority, r.definition_id, d.concurrency,
                   d.concurrency_per_key AS per_key, r.concurrency_key,
                   d.rate_limit_count AS rate_count,
                   d.rate_limit_period_seconds AS rate_period, r.available_at
            FROM runs_run r
            WHERE r.definition_id = d.id AND r.concurrency_key IS NULL
              AND r.state IN {WAITING} AND r.limited AND r.available_at <= now()
              AND EXISTS (SELECT 1 FROM lane WHERE lane.team_id = r.team_id
                          AND lane.queue = r.queue AND lane.priority = r.priority)
            -- The key first (NULL throughout): run_waiting_limited's order, so that index is
            -- read, not run_waiting_by_def past every keyed run of the definition.
            ORDER BY r.concurrency_key, r.available_at, r.id
            LIMIT least(d.concurrency, d.rate_limit_count, %(max)s)
            FOR UPDATE OF r SKIP LOCKED
        ) AS unkeyed
        LIMIT least(d.concurrency, d.rate_limit_count, %(max)s)
        ) AS found
        UNION ALL
        -- A marker (no run): the last key reached, where this process's next visit starts, so
        -- that keys past a stretch of full ones are reached too; in `concurrency`, 1 when the
        -- visit stopped at its count of keys (more are left), else 0.
        SELECT NULL, d.team_id, NULL, NULL, d.id,
               ((SELECT max(n) FROM visit) >= %(keys)s)::int, d.concurrency_per_key,
               (SELECT key FROM reached ORDER BY n DESC LIMIT 1), NULL, NULL, NULL
    ) AS c
    WHERE d.team_id IN (SELECT team_id FROM lane) AND NOT d.paused AND NOT d.deleting
      AND d.concurrency_per_key IS NOT NULL
      AND (d.rate_blocked_until IS NULL OR d.rate_blocked_until <= now())
      AND (%(jobs)s::text[] IS NULL OR d.name = ANY(%(jobs)s::text[]))
      AND (%(shards)s::int[] IS NULL OR d.shard = ANY(%(shards)s::int[]))
){{bounded}}
SELECT id, team_id, queue, priority, definition_id, concurrency, per_key, concurrency_key,
       rate_count, rate_period, available_at, (SELECT nextval('runs_claim_tick')) AS tick
FROM candidate{{bounded_join}}
ORDER BY priority, available_at, id
"""
CLAIM_CANDIDATES = _CLAIM_CANDIDATES.format(lanes=LANES_HERE, bounded="", bounded_join="")
# On a shard database of its own, the statement also bounds the lock waits of the rest of the
# claim's transaction (CLAIM_LOCK_TIMEOUT: step 2's definition locks, the lease's counter row),
# in its own round trip rather than one more; read only when there is a candidate, as the rest
# of the claim is.
CLAIM_CANDIDATES_GIVEN_LANES = _CLAIM_CANDIDATES.format(
    lanes=LANES_GIVEN,
    bounded=(
        ", bounded AS MATERIALIZED (\n"
        f"    SELECT set_config('lock_timeout', '{CLAIM_LOCK_WAIT}', true) AS lock_timeout\n)"
    ),
    bounded_join=" CROSS JOIN bounded",
)


@dataclass(frozen=True)
class Lanes:
    """What a claim on a shard database of its own needs from the control database."""

    team_ids: list[int]
    paused: list[tuple[int, str]]  # (team, queue)

    def params(self) -> dict[str, Any]:
        return {
            "team_ids": _bigints(self.team_ids),
            "paused_teams": _bigints(team for team, _ in self.paused),
            "paused_queues": array_literal([queue for _, queue in self.paused]),
        }


# The control database's part of a claim with shards on databases of their own: the teams
# (served by the primary key) and the paused queues (a sequential scan of the queue rows: a few
# per team, read once a second per process, apps/runs/leasing.py `control_state`).
CONTROL_TEAMS = "SELECT id FROM teams_team ORDER BY id"
CONTROL_PAUSED = "SELECT team_id, name FROM jobs_queue WHERE paused"


# A claim on one shard database holds its row locks (the leased runs, a minute-counter row)
# while the same request claims on the next database, and two requests taking the databases in
# different orders can each wait for the other's counter row: a deadlock across databases, which
# no single server can see. So such a claim waits for a lock this long at most, then gives that
# database up for the request (its part rolls back; the runs stay claimable). Without it, eight
# claimers on three databases (tests/runs/test_shard_databases.py) hung for good in one run of
# four.
CLAIM_LOCK_TIMEOUT = f"SET LOCAL lock_timeout = '{CLAIM_LOCK_WAIT}'"


def limit_lock_waits() -> None:
    """Bound the lock waits of the current shard database's transaction (CLAIM_LOCK_TIMEOUT)."""
    with server_cursor() as cursor:
        cursor.execute(CLAIM_LOCK_TIMEOUT)


def control_lanes() -> tuple[list[int], list[tuple[int, str]]]:
    """Every team's id, and every paused queue as (team, queue), from the control database."""
    with placement.using(placement.CONTROL), server_cursor() as cursor:
        cursor.execute(CONTROL_TEAMS)
        team_ids = [row[0] for row in cursor.fetchall()]
        cursor.execute(CONTROL_PAUSED)
        return team_ids, [tuple(row) for row in cursor.fetchall()]


# Before the claim, only when a rate-limited queue is asked: its room. A queue's row and its starts
# (jobs_queuestart) live in the control database, so one window holds for the queue across every
# shard database (a share per database would cut a queue whose jobs sit in one shard to a third
# of its rate on three). The lease request (apps/runs/leasing.py) locks the queues' rows there
# before it claims anywhere: queue locks always come first, so they cannot close a cycle with
# the shard databases' locks. It counts the starts in the window in a new statement (whose
# snapshot sees every start committed before the lock was granted), claims at most the room,
# records its starts, and commits the control database before the shard databases: a claim that
# then fails to commit leaves starts counted that never happened (the window under-used), never
# the reverse. Cost: one round trip to the control database per request that asks such a queue
# (two with one database, lock and count), and requests for it wait for each other.
# The rate-limited queues: read every second at most per process (leasing.py caches them).
LIMITED_QUEUES = """
SELECT id, team_id, name, rate_limit_count, rate_limit_period_seconds FROM jobs_queue
WHERE rate_limit_count IS NOT NULL
"""
LOCK_QUEUES = "SELECT id FROM jobs_queue WHERE id = ANY(%(ids)s::bigint[]) ORDER BY id FOR UPDATE"
# The starts within each window of these (definitions or queues), and when the oldest leaves it
# (an instant, and seconds from now() on this server's clock); the starts past the window are
# deleted first.
_COUNT_WINDOW = """
WITH window_of AS (
    SELECT * FROM unnest(%(ids)s::bigint[], %(periods)s::int[]) AS w({key}, period)
), forgotten AS (
    DELETE FROM {starts} s USING window_of w
    WHERE s.{key} = w.{key} AND s.started_at <= now() - make_interval(secs => w.period)
)
SELECT w.{key}, count(s.id), min(s.started_at) + make_interval(secs => w.period),
       extract(epoch FROM min(s.started_at) + make_interval(secs => w.period) - now())::float8
FROM window_of w
LEFT JOIN {starts} s ON s.{key} = w.{key}
 AND s.started_at > now() - make_interval(secs => w.period)
GROUP BY w.{key}, w.period
"""
# A queue's window is counted at this transaction's now(), and its starts stamped when recorded
# (clock_timestamp()): now() is no later than any start this request makes (its claims begin
# after it, in this transaction or, with shard databases of their own, in theirs), the record
# no earlier than any of them (made after the claims). Stamped with now() too, a start with
# shard databases of their own was back-dated by the wait for the queue's lock and the claims
# before it, left the window early, and a window of the runs' start times let more through (13
# in 1.97 s for a limit of 10 in 2 s). Served by queuestart_window (queue_id, started_at).
COUNT_QUEUE_WINDOW = _COUNT_WINDOW.format(starts="jobs_queuestart", key="queue_id")
RECORD_QUEUE_STARTS = """
INSERT INTO jobs_queuestart (queue_id, started_at)
SELECT q, clock_timestamp() FROM unnest(%(ids)s::bigint[]) AS q
"""


@dataclass(frozen=True)
class LimitedQueue:
    id: int
    team_id: int
    name: str
    count: int
    period_seconds: int


def limited_queues() -> list[LimitedQueue]:
    """Every queue with a rate limit (few: only those given one)."""
    with placement.using(placement.CONTROL), server_cursor() as cursor:
        cursor.execute(LIMITED_QUEUES)
        return [LimitedQueue(*row) for row in cursor.fetchall()]


def queue_rooms(queues: Sequence[LimitedQueue]) -> dict[int, tuple[int, float | None]]:
    """Lock these queues' rows and answer, by queue id, the leases each may still start in its
    window and in how many seconds its oldest start leaves it. In the caller's control-database
    transaction, which must record the starts (`record_queue_starts`) and commit before the
    claims do."""
    ids = sorted(queue.id for queue in queues)
    periods = {queue.id: queue.period_seconds for queue in queues}
    with placement.using(placement.CONTROL), server_cursor() as cursor:
        cursor.execute(LOCK_QUEUES, {"ids": _bigints(ids)})
        cursor.execute(
            COUNT_QUEUE_WINDOW,
            {"ids": _bigints(ids), "periods": _bigints(periods[i] for i in ids)},
        )
        started = {i: (n, frees_in) for i, n, _, frees_in in cursor.fetchall()}
    return {
        queue.id: (queue.count - started[queue.id][0], started[queue.id][1]) for queue in queues
    }


def record_queue_starts(queue_ids: Sequence[int]) -> None:
    """One start per lease of a rate-limited queue, in the transaction that locked it."""
    if queue_ids:
        with placement.using(placement.CONTROL), server_cursor() as cursor:
            cursor.execute(RECORD_QUEUE_STARTS, {"ids": _bigints(queue_ids)})


# A definition's limits came or went: its unfinished runs' `limited` follows, in the transaction
# that changed the definition (its row locked: inserts of its runs wait, FOR SHARE above). Dead
# runs too, so that a requeued one is taken by the right part of the claim. Served by
# run_definition_recent (definition_id, -id). Locked in id order first, as a batch of results
# or heartbeats locks its runs (leased_targets): in any other order, a worker's batch and the
# edit could each hold a run the other waits for.
MARK_LIMITED = """
UPDATE runs_run SET limited = %(limited)s
WHERE id IN (
    SELECT id FROM runs_run
    WHERE definition_id = %(definition)s AND limited <> %(limited)s
      AND state IN ('scheduled', 'ready', 'retrying', 'leased', 'dead')
    ORDER BY id FOR UPDATE
)
"""


def mark_limited(definition_id: int, limited: bool) -> None:
    """Set `limited` on the definition's unfinished runs (on the current shard database)."""
    with server_cursor() as cursor:
        cursor.execute(MARK_LIMITED, {"definition": definition_id, "limited": limited})


# Claim, step 2, only when a candidate's definition has a limit: take those definitions' claim
# locks (in key order, so claimers cannot deadlock), then count in new statements, whose
# snapshots see every lease committed before the lock was granted: their leased runs (the
# partial index run_leased_by_def), the leased runs of each candidate's key (run_leased_by_key),
# and the leases started within each rate window (runs_ratestart, by ratestart_window; the
# starts past the window go first).
# An advisory lock per definition, not its row: an edit of the definition locks the row and
# then rewrites its runs' `limited` (MARK_LIMITED), while the claim has locked some of those
# runs (step 1) when it takes this lock. With the row, each waited for the other until the
# deadlock detector failed one (a 503 to the edit or to the worker). The claims only need to
# exclude each other: the limits they apply are the ones step 1 read, as before. Two
# definitions may share a key (the id modulo 2^31 - 1): they are then counted one claim at a
# time, which costs a wait, never a wrong count.
CLAIM_LOCKS = 0x636C6D  # "clm": the lock space of these keys (two-key advisory locks)
CLAIM_LOCK_KEYS = 2147483647
LOCK_LIMITED_DEFINITIONS = f"""
SELECT pg_advisory_xact_lock({CLAIM_LOCKS}, k)
FROM (SELECT DISTINCT (id %% {CLAIM_LOCK_KEYS})::int AS k
      FROM unnest(%(ids)s::bigint[]) AS id) AS keys
ORDER BY k
"""


def claim_lock_key(definition_id: int) -> tuple[int, int]:
    """The two keys of a definition's claim lock (LOCK_LIMITED_DEFINITIONS), for whatever must
    hold it from outside a claim."""
    return CLAIM_LOCKS, definition_id % CLAIM_LOCK_KEYS


COUNT_LEASED = """
SELECT definition_id, count(*) FROM runs_run
WHERE state = 'leased' AND definition_id = ANY(%(ids)s::bigint[])
GROUP BY definition_id
"""
COUNT_LEASED_BY_KEY = """
SELECT r.definition_id, r.concurrency_key, count(*)
FROM unnest(%(ids)s::bigint[], %(keys)s::text[]) AS k(definition_id, concurrency_key)
JOIN runs_run r ON r.definition_id = k.definition_id AND r.concurrency_key = k.concurrency_key
WHERE r.state = 'leased'
GROUP BY r.definition_id, r.concurrency_key
"""
COUNT_RATE_WINDOW = _COUNT_WINDOW.format(starts="runs_ratestart", key="definition_id")
# A window this claim fills (or found full): no claim looks at the definition again before its
# oldest start leaves the window (its claim lock is this claim's). A hint, so a row an edit has
# locked is left as it is: waiting for it while holding runs would be the deadlock above.
BLOCK_RATE = """
UPDATE jobs_jobdefinition d SET rate_blocked_until = b.until
FROM unnest(%(ids)s::bigint[], %(untils)s::timestamptz[]) AS b(id, until)
WHERE d.id = b.id
  AND d.id IN (SELECT id FROM jobs_jobdefinition WHERE id = ANY(%(ids)s::bigint[])
               FOR NO KEY UPDATE SKIP LOCKED)
"""
# After the lease: one start per leased run of a rate-limited definition.
RECORD_RATE_STARTS = """
INSERT INTO runs_ratestart (definition_id, started_at)
SELECT d, now() FROM unnest(%(ids)s::bigint[]) AS d
"""

# Claim, step 3: lease the chosen runs. Each gets a fencing token from one sequence; the lease is
# bounded by the definition's timeout, which is also the attempt's hard deadline. Step 1 locked
# them while waiting, so no state test: with one the planner may read run_claimable whole (its
# predicate matches) instead of the primary key, and that index keeps the entries of every run
# claimed while an old transaction stays open.
LEASE_CHOSEN = f"""
WITH leased AS (
    UPDATE runs_run r
    SET state = 'leased',
        attempt = r.attempt + 1,
        fencing_token = nextval('runs_fencing_token'),
        worker_id = %(worker_id)s,
        lease_seconds = %(lease_seconds)s,
        timeout_at = now() + make_interval(secs => d.timeout_seconds),
        lease_expires_at = least(now() + make_interval(secs => %(lease_seconds)s),
                                 now() + make_interval(secs => d.timeout_seconds)),
        started_at = coalesce(r.started_at, now()),
        late_seconds = coalesce(r.late_seconds, extract(epoch FROM now() - r.available_at))
    FROM jobs_jobdefinition d
    WHERE r.id = ANY(%(ids)s::bigint[]) AND d.id = r.definition_id
    RETURNING r.id, r.attempt, r.max_attempts, r.fencing_token, r.lease_expires_at,
              r.idempotency_key, r.payload, r.payload_key, r.due_at, r.available_at, r.dry_run, r.queue,
              r.priority, r.team_id, d.name AS job, now() AS leased_at,
              r.late_seconds, d.lateness_slo_seconds
), attempts AS (
    INSERT INTO runs_attempt (run_id, number, fencing_token, worker_id, leased_at, outcome,
                              error_message, error_type)
    SELECT id, attempt, fencing_token, %(worker_id)s, now(), '', '', '' FROM leased
), counted AS ({counters.count_started("leased")})
-- Lease's fields in its order, then the payload's storage key: a row is a Lease as it comes.
SELECT id, job, queue, priority, attempt, max_attempts, idempotency_key, fencing_token,
       lease_expires_at, due_at, available_at, leased_at, dry_run, team_id,
       payload::text AS payload, attempt = 1 AND late_seconds > lateness_slo_seconds AS late,
       payload_key
FROM leased ORDER BY priority, available_at, id
"""


class Lease(NamedTuple):
    # In LEASE_CHOSEN's column order, which claim() reads a row in.
    id: int
    job: str
    queue: str
    priority: int
    attempt: int
    max_attempts: int
    idempotency_key: str
    fencing_token: int
    lease_expires_at: datetime
    due_at: datetime
    available_at: datetime
    leased_at: datetime
    dry_run: bool
    team_id: int
    payload: orjson.Fragment | None  # its JSON text, written into the answer as it is
    late: bool = False  # started later than its definition's lateness SLO


Bucket = tuple  # ("definition", id) | ("key", definition id, key) | ("queue", team id, queue)


def _buckets(row: dict[str, Any]) -> tuple[Bucket, ...]:
    """The limits a candidate counts against, where they have one (`capacity` below)."""
    return (
        ("definition", row["definition_id"]),
        ("key", row["definition_id"], row["concurrency_key"]),
        ("queue", row["team_id"], row["queue"]),
    )


def _choose(
    candidates: list[dict[str, Any]], capacity: dict[Bucket, int], max_runs: int
) -> list[int]:
    """Pick up to `max_runs` candidates: weighted across priorities, round-robin across teams.

    1. Order each priority's candidates round-robin across teams (rotated by the tick).
    2. Give each slot of the claim its preferred priority from the 70/25/5 pattern; a slot whose
       priority has nothing left goes to the most urgent priority that has.
    3. Skip candidates with a limit that has no room left (`capacity`, by bucket: a
       definition's concurrency or rate, a concurrency key's, a queue's rate).
    """
    if not candidates:
        return []
    tick = candidates[0]["tick"]
    lanes: dict[int, list[dict[str, Any]]] = {}
    for row in candidates:
        lanes.setdefault(row["priority"], []).append(row)
    ordered = {
        prio: interleave_teams(rows, lambda row: row["team_id"], tick)
        for prio, rows in lanes.items()
    }
    if len(ordered) == 1 and not capacity:
        # One priority, no limits: every slot falls back to the one lane.
        (rows,) = ordered.values()
        return [row["id"] for row in rows[:max_runs]]
    positions = dict.fromkeys(ordered, 0)
    capacity = dict(capacity)

    def next_from(prio: int) -> int | None:
        rows = ordered.get(prio, [])
        while positions.get(prio, 0) < len(rows):
            row = rows[positions[prio]]
            positions[prio] += 1
            limits = [bucket for bucket in _buckets(row) if bucket in capacity]
            if any(capacity[bucket] <= 0 for bucket in limits):
                continue
            for bucket in limits:
                capacity[bucket] -= 1
            return row["id"]
        return None

    chosen: list[int] = []
    for preferred in slot_priorities(tick, max_runs):
        picked = next_from(preferred)
        for fallback in sorted(ordered):
            if picked is not None:
                break
            picked = next_from(fallback)
        if picked is None:
            break
        chosen.append(picked)
    return chosen


def _room_of_limited(cursor: CursorWrapper, candidates: list[dict[str, Any]]) -> dict[Bucket, int]:
    """Step 2: the room of each limited definition among the candidates (the least of its
    concurrency and rate room), and of each limited key, by bucket; empty when none is limited
    (no statement then)."""
    # The unlimited branch of the candidates answers NULL limits: one test per row.
    limited = {
        row["definition_id"]: row
        for row in candidates
        if row["concurrency"] is not None
        or row["per_key"] is not None
        or row["rate_count"] is not None
    }
    if not limited:
        return {}
    ids = sorted(limited)
    cursor.execute(LOCK_LIMITED_DEFINITIONS, {"ids": _bigints(ids)})
    room: dict[int, int] = {}
    with_limit = [i for i in ids if limited[i]["concurrency"] is not None]
    if with_limit:
        cursor.execute(COUNT_LEASED, {"ids": _bigints(with_limit)})
        leased_now = dict(cursor.fetchall())
        for i in with_limit:
            room[i] = limited[i]["concurrency"] - leased_now.get(i, 0)
    rated = [i for i in ids if limited[i]["rate_count"] is not None]
    if rated:
        periods = [limited[i]["rate_period"] for i in rated]
        cursor.execute(COUNT_RATE_WINDOW, {"ids": _bigints(rated), "periods": _bigints(periods)})
        started = {i: (n, frees_at) for i, n, frees_at, _ in cursor.fetchall()}
        full = {}
        for i in rated:
            n, frees_at = started.get(i, (0, None))
            left = limited[i]["rate_count"] - n
            room[i] = min(room.get(i, left), left)
            if left <= 0 and frees_at is not None:
                full[i] = frees_at
        if full:
            cursor.execute(
                BLOCK_RATE,
                {"ids": _bigints(full), "untils": array_literal(list(full.values()))},
            )
    capacity: dict[Bucket, int] = {("definition", i): left for i, left in room.items()}
    keys = sorted(
        {
            (row["definition_id"], row["concurrency_key"])
            for row in candidates
            if row["per_key"] is not None and row["concurrency_key"] is not None
        }
    )
    if keys:
        cursor.execute(
            COUNT_LEASED_BY_KEY,
            {"ids": _bigints(i for i, _ in keys), "keys": array_literal([k for _, k in keys])},
        )
        leased_by_key = {(i, k): n for i, k, n in cursor.fetchall()}
        for i, k in keys:
            capacity[("key", i, k)] = limited[i]["per_key"] - leased_by_key.get((i, k), 0)
    return capacity


# Per definition with a limit per key: the last key this process's last visit of its keys
# reached (the candidates' markers), where the next visit starts, wrapping round: every key is
# reached in turn, past any stretch of keys at their limit. At most this many more keys are
# visited than the batch asks for: those at their limit are passed over.
KEYS_SPARE = 16
_key_after: dict[int, str] = {}


# A claim that found nothing while some visit stopped short looks again from where it stopped,
# at most this many times (a definition whose keys are all at their limit: 2.5 ms a look at
# batch 100).
KEY_LOOKS = 8


# No floors (no old snapshot held, the usual case): every lane from its head, built once.
NO_FLOORS = {
    "floor_teams": "{}",
    "floor_queues": "{}",
    "floor_priorities": "{}",
    "floor_ats": "{}",
    "floor_ids": "{}",
}


def _floor_params(given: dict[str, list[Any]]) -> dict[str, str]:
    """The claim statement's floor arrays."""
    return {
        "floor_teams": _bigints(given["teams"]),
        "floor_queues": array_literal(given["queues"]),
        "floor_priorities": _bigints(given["priorities"]),
        "floor_ats": array_literal(given["ats"]),
        "floor_ids": _bigints(given["ids"]),
    }


def _without_markers(rows: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], bool]:
    """The candidates with their markers (id NULL) taken out and noted in `_key_after`, and
    whether some visit of keys stopped short (more keys left to look at)."""
    if all(row["id"] is not None for row in rows):
        return rows, False
    if len(_key_after) > 1_000:  # definitions come and go: forget them all now and then
        _key_after.clear()
    short = False
    for row in rows:
        if row["id"] is None:
            short = short or row["concurrency"] == 1
            if row["concurrency_key"] is None:
                _key_after.pop(row["definition_id"], None)
            else:
                _key_after[row["definition_id"]] = row["concurrency_key"]
    return [row for row in rows if row["id"] is not None], short


def claim(
    *,
    queues: Sequence[str],
    max_runs: int,
    worker_id: str,
    lease_seconds: int,
    team_ids: Sequence[int] | None = None,
    jobs: Sequence[str] | None = None,
    lanes: Lanes | None = None,
    queue_room: dict[tuple[int, str], int] | None = None,
) -> list[Lease]:
    """Lease up to `max_runs` claimable runs of the given queues (and jobs), in one transaction
    on the current shard database; on one of its own, `lanes` from the control database
    (apps/runs/leasing.py `control_state`). At most `queue_room[(team, queue)]` of a
    rate-limited queue (from `queue_rooms`).

    Called inside a transaction (apps/runs/leasing.py builds the answer in it), the claim joins
    it without a savepoint, which would cost two more round trips per claim."""
    params = {
        "queues": array_literal(queues),
        "team_ids": _bigints(team_ids) if team_ids is not None else None,
        "jobs": array_literal(jobs) if jobs else None,
        "max": max_runs,
        "keys": max_runs + KEYS_SPARE,
        "room_teams": _bigints(team for team, _ in queue_room or ()),
        "room_queues": array_literal([queue for _, queue in queue_room or ()]),
        "rooms": _bigints((queue_room or {}).values()),
    }
    if lanes is not None:
        params.update(lanes.params())
    alias = placement.current()
    # Once a shard has moved, only the shards placed here (a dead move's rows elsewhere are a
    # copy); NULL otherwise, a filter that costs nothing.
    shards_here = placement.claimed_here(alias)
    params["shards"] = _bigints(shards_here) if shards_here is not None else None
    with atomic(savepoint=False), server_cursor() as cursor:
        if floors.due_check(alias):
            cursor.execute(OLDEST_TRANSACTION)
            floors.checked(alias, cursor.fetchone()[0])
        floored = floors.active(alias)
        params.update(_floor_params(floors.params(alias)) if floored else NO_FLOORS)
        for _ in range(KEY_LOOKS):
            after = list(_key_after.items())  # one copy: other threads' claims update it
            params["after_ids"] = _bigints(definition for definition, _ in after)
            params["after_keys"] = array_literal([key for _, key in after])
            cursor.execute(
                CLAIM_CANDIDATES if lanes is None else CLAIM_CANDIDATES_GIVEN_LANES, params
            )
            candidates, short = _without_markers(_rows(cursor))
            if candidates or not short:
                break
        if not candidates:
            return []
        capacity = _room_of_limited(cursor, candidates)
        for (team, queue), left in (queue_room or {}).items():
            capacity[("queue", team, queue)] = left
        chosen = _choose(candidates, capacity, max_runs)
        if floored:
            floors.advance(alias, candidates, set(chosen))
        if not chosen:
            return []
        cursor.execute(
            LEASE_CHOSEN,
            {"ids": _bigints(chosen), "worker_id": worker_id, "lease_seconds": lease_seconds},
        )
        rows = cursor.fetchall()
        if capacity:  # some run is limited: record the starts of rate-limited definitions
            rated = {row["id"]: row["definition_id"] for row in candidates if row["rate_count"]}
            starts = [rated[run_id] for run_id in chosen if run_id in rated]
            if starts:
                cursor.execute(RECORD_RATE_STARTS, {"ids": _bigints(starts)})
    # Large payloads are read from storage after the claim's statements. Made from the row's
    # values in order, not a dict of them by name: 1-9 µs (median 4) of the web process's 63-79
    # a run leased (in-process, 100 a request, six alternating pairs).
    leases = []
    unreadable = []
    for *fields, payload, late, key in rows:
        try:
            # Django reads jsonb as text on raw cursors; the ::text cast makes that explicit.
            document = payloads.document(payload, key)
        except payloads.Unavailable as exc:
            unreadable.append((Lease(*fields, payload=None), exc))
            continue
        leases.append(Lease(*fields, payload=document, late=bool(late)))
    if unreadable:
        _unreadable(unreadable)
    # Counted and logged once the claim commits: the caller may still roll it back.
    transaction.on_commit(lambda: _claimed(leases, worker_id), using=placement.current())
    return leases


def _unreadable(leases: list[tuple[Lease, payloads.Unavailable]]) -> None:
    """Fail, in the claim's transaction, the runs whose payload cannot be read: retryable, so a
    storage outage costs them an attempt and a blob that is gone sends them to the dead-letter
    queue with its reason, rather than fail every claim of their queue (a 5xx each time) and
    hold its other runs back."""
    fail(
        [
            (
                lease.id,
                lease.fencing_token,
                {"type": "PayloadUnavailable", "message": str(exc)},
                True,
            )
            for lease, exc in leases
        ],
        team_ids=sorted({lease.team_id for lease, _ in leases}),
    )
    log.warning("%d leased runs failed: their payload cannot be read", len(leases))


def _claimed(leases: list[Lease], worker_id: str) -> None:
    metrics.observe_claim(leases)
    for lease in leases if logs.runs_logged() else ():
        run_event(
            "run leased",
            run_id=public_run_id(lease.id),
            job=lease.job,
            attempt=lease.attempt,
            fencing_token=lease.fencing_token,
            queue=lease.queue,
            worker_id=worker_id,
        )


# Long-poll helper: when the next run of these queues becomes claimable (for a run waiting on its
# availableAt, nobody sends a NOTIFY at that moment, so the waiter sets its own alarm). Runs that
# are already due but held (paused, at a concurrency limit) are left out: they would wake the
# waiter at once, again and again; their release sends a NOTIFY or is caught by the re-check.
_NEXT_AVAILABLE = f"""
SELECT min(n.available_at)
FROM {{teams}}
CROSS JOIN unnest(%(queues)s::text[]) AS q(name)
CROSS JOIN (VALUES (0), (1), (2)) AS p(priority)
CROSS JOIN (VALUES (false), (true)) AS l(limited)
CROSS JOIN LATERAL (
    -- the lane's next run by the clock: the first entry of run_claimable past now(), among the
    -- runs of definitions without limits and among the others (the index's two ranges)
    SELECT r.available_at FROM runs_run r
    WHERE r.team_id = t.id AND r.queue = q.name AND r.priority = p.priority
      AND r.limited = l.limited AND r.state IN {WAITING} AND r.available_at > now()
    ORDER BY r.available_at
    LIMIT 1
) AS n
WHERE %(team_ids)s::bigint[] IS NULL OR t.id = ANY(%(team_ids)s::bigint[])
"""
NEXT_AVAILABLE = _NEXT_AVAILABLE.format(teams="teams_team t")
# On a shard database of its own, the teams are the control database's (control_lanes).
NEXT_AVAILABLE_GIVEN_TEAMS = _NEXT_AVAILABLE.format(teams="unnest(%(team_ids)s::bigint[]) AS t(id)")


# Lease activity per (team, queue): an upsert served by the unique (team_id, name) index. The
# caller throttles it, so it is a few writes a minute per web process, not one per claim. Only
# queues that exist for the team (a definition uses it, or it has a row) are recorded: a worker
# may name any queue, and rows for made-up names would fill every queue list (the team's
# definitions are found by job_team_name).
RECORD_LEASE_ACTIVITY = """
INSERT INTO jobs_queue (team_id, name, paused, updated_at, last_leased_at, last_worker_id)
SELECT %(team_id)s, q, false, now(), now(), %(worker_id)s FROM unnest(%(queues)s::text[]) AS q
WHERE q = ANY(%(used)s::text[])
   OR EXISTS (SELECT 1 FROM jobs_jobdefinition d WHERE d.team_id = %(team_id)s AND d.queue = q)
   OR EXISTS (SELECT 1 FROM jobs_queue jq WHERE jq.team_id = %(team_id)s AND jq.name = q)
ON CONFLICT (team_id, name)
DO UPDATE SET last_leased_at = now(), last_worker_id = EXCLUDED.last_worker_id
"""
# With shards on databases of their own, the queues the team's definitions use are read from
# each of them first (served by job_team_name).
QUEUES_IN_USE = """
SELECT DISTINCT queue FROM jobs_jobdefinition
WHERE team_id = %(team_id)s AND queue = ANY(%(queues)s::text[])
"""


def record_lease_activity(team_id: int, queues: Sequence[str], worker_id: str) -> None:
    asked = sorted(set(queues))
    used: set[str] = set()
    for alias in placement.databases() if placement.physical() else ():
        if alias != placement.CONTROL:
            try:
                with placement.using(alias), server_cursor() as cursor:
                    cursor.execute(QUEUES_IN_USE, {"team_id": team_id, "queues": asked})
                    used.update(row[0] for row in cursor.fetchall())
            except (OperationalError, InterfaceError):
                continue  # a shard database that is down: its queues are noted next time
    with placement.using(placement.CONTROL), server_cursor() as cursor:
        cursor.execute(
            RECORD_LEASE_ACTIVITY,
            {"team_id": team_id, "queues": asked, "worker_id": worker_id, "used": sorted(used)},
        )


def next_available_at(queues: Sequence[str], team_ids: Sequence[int] | None) -> datetime | None:
    with server_cursor() as cursor:
        cursor.execute(NEXT_AVAILABLE, _lanes(queues, team_ids))
        return cursor.fetchone()[0]


# A definition whose rate window a claim found full is skipped until its oldest start leaves it
# (`rate_blocked_until`, BLOCK_RATE): that moment wakes the waiter too. Left to the re-check, a
# window of one second was looked at every two (half its rate). Served by job_rate_blocked.
_NEXT_RATE_SLOT = """
SELECT min(d.rate_blocked_until) FROM jobs_jobdefinition d
WHERE d.rate_limit_count IS NOT NULL AND d.queue = ANY(%(queues)s::text[])
  AND d.rate_blocked_until > now()
  AND (%(team_ids)s::bigint[] IS NULL OR d.team_id = ANY(%(team_ids)s::bigint[]))
"""
SECONDS_UNTIL_AVAILABLE = (
    f"SELECT extract(epoch FROM least(({NEXT_AVAILABLE}), ({_NEXT_RATE_SLOT})) - now())::float8"
)
SECONDS_UNTIL_AVAILABLE_GIVEN_TEAMS = (
    "SELECT extract(epoch FROM "
    f"least(({NEXT_AVAILABLE_GIVEN_TEAMS}), ({_NEXT_RATE_SLOT})) - now())::float8"
)


def seconds_until_available(
    queues: Sequence[str], team_ids: Sequence[int] | None, lanes: Lanes | None = None
) -> float | None:
    """Seconds from the current shard database's now() to its next available run of these
    lanes, or to the next slot of a rate-limited definition's full window, in one statement (on
    a database of its own, with the control database's `lanes`)."""
    with server_cursor() as cursor:
        if lanes is None:
            cursor.execute(SECONDS_UNTIL_AVAILABLE, _lanes(queues, team_ids))
        else:
            cursor.execute(SECONDS_UNTIL_AVAILABLE_GIVEN_TEAMS, _lanes(queues, lanes.team_ids))
        return cursor.fetchone()[0]


def _lanes(queues: Sequence[str], team_ids: Sequence[int] | None) -> dict[str, Any]:
    return {
        "queues": array_literal(queues),
        "team_ids": _bigints(team_ids) if team_ids is not None else None,
    }


# The leased runs a batch names, each found by its primary key and locked, with the state and
# token tested on the locked row. Written as a join on `state = 'leased'`, the planner could
# serve the batch from the partial indexes on leased runs (run_leased_by_def,
# run_leased_expiry), read whole: they keep the entries of every lease taken while an old
# transaction stays open, so every completion read more of them (the soak, bench/README.md).
def leased_targets(extra: str = "") -> str:
    # Locked in id order, as MARK_LIMITED locks a definition's runs: two statements that lock
    # some of the same runs in different orders deadlock.
    return f"""target AS (
    SELECT i.* FROM (SELECT * FROM input ORDER BY id) AS i
    CROSS JOIN LATERAL (
        -- OFFSET 0 keeps the state and token tests below out of this scan, so the primary key
        -- is the only index that can serve it.
        SELECT team_id, state, fencing_token, lease_expires_at, cancel_requested FROM runs_run
        WHERE id = i.id OFFSET 0 FOR UPDATE
    ) AS r
    WHERE r.team_id = ANY(%(team_ids)s::bigint[]) AND r.state = 'leased'
      AND r.fencing_token = i.token{extra}
)"""


# ---------------------------------------------------------------------------------------------
# Heartbeat: extend live leases held with the current token, never past the attempt's deadline.
# A lease that has already expired is not revived: the reaper may be about to hand it on. One
# whose run someone asked to cancel is extended too, but left out of the answer, so its worker
# is told to stop (`_diagnose`): a handler that runs on to its end is still reported (the run
# ends cancelled), and holds its run (its concurrency slot) while it runs. Not extended, it lost
# the run at the lease's end, its result refused, and the run's error said its lease expired
# "without a heartbeat".
# Served by the primary key; the attempt by attempt_run_number (run, number).

HEARTBEAT = f"""
WITH input AS (
    SELECT * FROM unnest(%(ids)s::bigint[], %(tokens)s::bigint[]) AS i(id, token)
), {leased_targets(" AND r.lease_expires_at > now()")}, extended AS (
    UPDATE runs_run r
    SET lease_expires_at = least(now() + make_interval(secs => r.lease_seconds), r.timeout_at)
    FROM target t
    WHERE r.id = t.id
    RETURNING r.id, r.attempt, r.lease_expires_at, r.cancel_requested
), beats AS (
    UPDATE runs_attempt a SET last_heartbeat_at = now()
    FROM extended e WHERE a.run_id = e.id AND a.number = e.attempt
)
SELECT id, lease_expires_at FROM extended WHERE NOT cancel_requested
"""

# ---------------------------------------------------------------------------------------------
# Complete: leased with the current token → succeeded (cancelled, when someone asked to cancel
# it meanwhile: the result is kept, the run does not count as succeeded). A lease past its
# expiry that the reaper has not yet taken still completes: no one else holds the run, and the
# token is still current.

COMPLETE = f"""
WITH input AS (
    SELECT * FROM unnest(%(ids)s::bigint[], %(tokens)s::bigint[], %(results)s::jsonb[])
        AS i(id, token, result)
), {leased_targets()}, done AS (
    UPDATE runs_run r
    SET state = CASE WHEN r.cancel_requested THEN 'cancelled' ELSE 'succeeded' END,
        result = t.result, finished_at = now(), lease_expires_at = NULL
    FROM target t
    WHERE r.id = t.id
    RETURNING r.id, r.attempt, r.queue, r.team_id, r.priority, r.state
), ended AS (
    UPDATE runs_attempt a SET ended_at = now(), outcome = done.state
    FROM done WHERE a.run_id = done.id AND a.number = done.attempt
), counted AS ({counters.count_succeeded("done")})
SELECT id, state, NULL::timestamptz AS available_at, queue, attempt FROM done
"""

# ---------------------------------------------------------------------------------------------
# Fail (and reap): with attempts left and a retryable error the run waits out a full-jitter
# backoff, a uniform random delay in [0, min(maxSeconds, baseSeconds * 2^(n-1))] before retry n;
# otherwise it is dead (the DLQ). The exponent is capped so 2^(n-1) cannot overflow.

# A run someone asked to cancel while it was leased ends cancelled, never retried.
NEXT_STATE = (
    "CASE WHEN r.cancel_requested THEN 'cancelled'"
    " WHEN {retryable} AND r.attempt < r.max_attempts THEN 'retrying' ELSE 'dead' END"
)
BACKOFF_UNTIL = (
    "now() + make_interval(secs => random() * least(d.retry_max_seconds::float8,"
    " d.retry_base_seconds * power(2::float8, least(r.attempt - 1, 40))))"
)

# The error's fingerprint (its group on the failures page) comes with each item, computed in
# Python by `fail` (apps/runs/fingerprints.py: 10 µs for a short message, 50 µs at the longest
# head it reads, measured here); it and the failure time are what the partial index
# run_failed_by_fingerprint holds. The attempt keeps the worker's stack trace.
FAIL = f"""
WITH input AS (
    SELECT * FROM unnest(%(ids)s::bigint[], %(tokens)s::bigint[], %(errors)s::jsonb[],
                         %(retryables)s::boolean[], %(fingerprints)s::bigint[])
        AS i(id, token, error, retryable, fingerprint)
), {leased_targets()}, failed AS (
    UPDATE runs_run r
    SET state = {NEXT_STATE.format(retryable="t.retryable")},
        available_at = CASE WHEN t.retryable AND r.attempt < r.max_attempts
                                 AND NOT r.cancel_requested
                            THEN {BACKOFF_UNTIL} ELSE r.available_at END,
        finished_at = CASE WHEN t.retryable AND r.attempt < r.max_attempts
                                AND NOT r.cancel_requested
                           THEN NULL ELSE now() END,
        last_error = t.error,
        error_fingerprint = t.fingerprint,
        failed_at = now(),
        lease_expires_at = NULL
    FROM target t, jobs_jobdefinition d
    WHERE r.id = t.id AND d.id = r.definition_id
    RETURNING r.id, r.attempt, r.state, r.available_at, r.last_error, r.queue, r.team_id,
              r.priority, d.name AS job
), ended AS (
    UPDATE runs_attempt a
    SET ended_at = now(), outcome = CASE WHEN f.state = 'cancelled' THEN 'cancelled' ELSE 'failed' END,
        error_message = left(coalesce(f.last_error->>'message', ''), 10000),
        error_type = left(coalesce(f.last_error->>'type', ''), 200),
        error_stack = coalesce(f.last_error->>'stack', '')
    FROM failed f WHERE a.run_id = f.id AND a.number = f.attempt
), counted AS ({counters.count_failed("failed")})
SELECT id, state, available_at, queue, attempt, job FROM failed
"""

# Reap: leases past their expiry become failed attempts, `timed_out` when the attempt's deadline
# has passed and `lease_expired` otherwise. Served by the partial index run_leased_expiry. The
# UPDATE repeats the conditions, so a completion that committed after the SELECT wins. The two
# reasons' fingerprints are parameters (REAPED_FINGERPRINTS), as the fail statement's are.
REAP = f"""
WITH expired AS (
    SELECT id FROM runs_run
    WHERE state = 'leased' AND lease_expires_at <= now()
      AND (%(shards)s::int[] IS NULL OR shard = ANY(%(shards)s::int[]))
    ORDER BY lease_expires_at
    LIMIT %(batch)s
    FOR UPDATE SKIP LOCKED
), reaped AS (
    UPDATE runs_run r
    SET state = {NEXT_STATE.format(retryable="true")},
        available_at = CASE WHEN r.attempt < r.max_attempts AND NOT r.cancel_requested
                            THEN {BACKOFF_UNTIL} ELSE r.available_at END,
        finished_at = CASE WHEN r.attempt < r.max_attempts AND NOT r.cancel_requested
                           THEN NULL ELSE now() END,
        last_error = CASE WHEN r.timeout_at <= now()
            THEN jsonb_build_object('type', 'timed_out', 'message',
                 format('attempt %%s ran past timeoutSeconds (%%s s)', r.attempt, d.timeout_seconds))
            ELSE jsonb_build_object('type', 'lease_expired', 'message',
                 format('lease of worker %%s expired without a heartbeat', r.worker_id))
        END,
        error_fingerprint = CASE WHEN r.timeout_at <= now() THEN %(timed_out)s::bigint
                                 ELSE %(lease_expired)s::bigint END,
        failed_at = now(),
        lease_expires_at = NULL
    FROM expired e, jobs_jobdefinition d
    WHERE r.id = e.id AND d.id = r.definition_id
      AND r.state = 'leased' AND r.lease_expires_at <= now()
    RETURNING r.id, r.attempt, r.state, r.queue, r.available_at, r.last_error, r.team_id,
              r.priority, d.name AS job
), ended AS (
    UPDATE runs_attempt a
    SET ended_at = now(), outcome = rp.last_error->>'type', error_message = rp.last_error->>'message',
        error_type = rp.last_error->>'type'
    FROM reaped rp WHERE a.run_id = rp.id AND a.number = rp.attempt
), counted AS ({counters.count_failed("reaped")})
SELECT id, state, queue, available_at, last_error->>'type' AS outcome, attempt, job FROM reaped
"""


class Outcome(NamedTuple):
    """What one item of a worker's batch came to."""

    id: int
    status: int  # 200, 404 (no such run for this team) or 409 (stale token / not leased)
    state: str | None = None
    lease_expires_at: datetime | None = None
    available_at: datetime | None = None
    queue: str = ""
    detail: str = ""
    attempt: int | None = None  # of a changed run (for its log line)
    job: str = ""  # of a failed run (its statement joins the definition; a completion's not)
    denied_team_id: int | None = None  # set when the run exists but belongs to another team
    code: str = ""  # the problem type of a 409: "cancelled" when a cancel was asked for
    # A 409 for the run's current token on a run whose lease its worker's outcome ended: the
    # holder may learn the state it ended in (an outcome sent again after it was recorded).
    ended: bool = False


# Only for the items a batch did not change: tell "not yours" (404) from "not any more" (409),
# and whether the run's current attempt was ended by its worker's outcome (attempt_run_number:
# a run's few attempts).
DIAGNOSE = """
SELECT r.id, r.team_id, r.state, r.fencing_token, r.lease_expires_at <= now() AS expired,
       r.cancel_requested,
       EXISTS (SELECT 1 FROM runs_attempt a
               WHERE a.run_id = r.id AND a.fencing_token = r.fencing_token
                 AND a.outcome IN ('succeeded', 'failed', 'cancelled')) AS reported
FROM runs_run r WHERE r.id = ANY(%(ids)s::bigint[])
"""


def _diagnose(
    cursor, items: Sequence[tuple[int, int]], team_ids: Sequence[int]
) -> dict[int, Outcome]:
    cursor.execute(DIAGNOSE, {"ids": _bigints(run_id for run_id, _ in items)})
    found = {row[0]: row for row in cursor.fetchall()}
    outcomes: dict[int, Outcome] = {}
    for run_id, token in items:
        row = found.get(run_id)
        if row is None or row[1] not in team_ids:
            denied = row[1] if row is not None else None
            outcomes[run_id] = Outcome(run_id, 404, detail="no such run", denied_team_id=denied)
            continue
        _, _, state, current, expired, cancel_requested, reported = row
        code = ""
        # The current token is never disclosed: it is what a lease holder proves itself with.
        if state == "leased" and token == current and cancel_requested:
            detail = "the run was cancelled: stop, then report (it ends cancelled)"
            code = "cancelled"
        elif current is None:
            detail = f"fencing token {token} is stale; the run is not leased"
        elif token < current:
            # Not "leased again since": the token may never have been this run's at all.
            detail = f"fencing token {token} is stale: the run's current lease is newer"
        elif token > current:
            detail = f"fencing token {token} is not this run's current token"
        elif state != "leased":
            detail = f"the run is {state}, not leased"
        elif expired:
            # Not taken yet: its result is still taken until the reaper takes the run.
            detail = "the lease has expired; a result is still taken until the run is reaped"
            code = "lease-expired"
        else:
            detail = "the lease could not be updated"
        ended = token == current and state != "leased" and reported
        outcomes[run_id] = Outcome(run_id, 409, state, detail=detail, code=code, ended=ended)
    return outcomes


def _apply(
    sql: str,
    params_of: Callable[[Sequence[T]], dict[str, Any]],
    items: Sequence[T],
    team_ids: Sequence[int],
) -> list[Outcome]:
    """Run a batch statement on each database that holds some of the items' runs (one
    transaction each); one Outcome per item, in order. A database that cannot be reached, or
    fails at its commit (any database error), answers 503 for its items alone: the others'
    changes stand (a 500 answered over them)."""
    groups = placement.runs_by_database([item[0] for item in items])
    outcomes: dict[int, Outcome] = {}
    for alias, run_ids in groups.items():
        wanted = set(run_ids)
        part = [item for item in items if item[0] in wanted] if len(groups) > 1 else items
        try:
            with placement.using(alias):
                outcomes.update(_apply_on(sql, params_of(part), part, team_ids))
        except DatabaseError as exc:
            if not placement.physical():
                raise
            if not isinstance(exc, OperationalError | InterfaceError):
                log.warning("batch not applied on %s", alias, exc_info=True)
            detail = unavailable(alias, exc)
            outcomes.update((run_id, Outcome(run_id, 503, detail=detail)) for run_id in run_ids)
    return [outcomes[item[0]] for item in items]


def unavailable(alias: str, exc: DatabaseError) -> str:
    """What a request is told about a shard database that failed its part (a 503)."""
    if isinstance(exc, CommitRefused):
        return (
            f"the database of shards {placement.span(alias)} refused the change at its commit"
            f" ({exc.kind}); nothing of it was written"
        )
    return (
        f"shards {placement.span(alias)} are unavailable (their database cannot be reached:"
        f" {type(exc).__name__})"
    )


def _apply_on(
    sql: str, params: dict[str, Any], items: Sequence[tuple], team_ids: Sequence[int]
) -> dict[int, Outcome]:
    with atomic(), server_cursor() as cursor:
        cursor.execute(sql, {**params, "team_ids": _bigints(team_ids)})
        changed = {row["id"]: row for row in _rows(cursor)}
        missing = [(item[0], item[1]) for item in items if item[0] not in changed]
        diagnosed = _diagnose(cursor, missing, team_ids) if missing else {}
    outcomes = {}
    for item in items:
        run_id = item[0]
        row = changed.get(run_id)
        if row is None:
            outcomes[run_id] = diagnosed[run_id]
        else:
            outcomes[run_id] = Outcome(
                run_id,
                200,
                state=row.get("state", "leased"),
                lease_expires_at=row.get("lease_expires_at"),
                available_at=row.get("available_at"),
                queue=row.get("queue", ""),
                attempt=row.get("attempt"),
                job=row.get("job", ""),
            )
    return outcomes


def _log_outcomes(outcomes: Sequence[Outcome], items: Sequence[tuple]) -> None:
    if not logs.runs_logged():
        return
    tokens = {item[0]: item[1] for item in items}
    for outcome in outcomes:
        verb = (
            f"run {outcome.state}"
            if outcome.status == 200
            else f"refused ({outcome.status}): {outcome.detail}"
        )
        run_event(
            verb,
            run_id=public_run_id(outcome.id),
            fencing_token=tokens.get(outcome.id),
            state=outcome.state,
            queue=outcome.queue or None,
            job=outcome.job or None,
            attempt=outcome.attempt,
        )


def heartbeat(items: Sequence[tuple[int, int]], *, team_ids: Sequence[int]) -> list[Outcome]:
    """Extend the leases of (run id, fencing token) pairs; one Outcome per item, in order."""
    outcomes = _apply(HEARTBEAT, _heartbeat_params, items, team_ids)
    metrics.observe_results(outcomes, "heartbeat")
    return outcomes


def _heartbeat_params(items: Sequence[tuple[int, int]]) -> dict[str, Any]:
    return {"ids": _bigints(i for i, _ in items), "tokens": _bigints(t for _, t in items)}


def complete(items: Sequence[tuple[int, int, Any]], *, team_ids: Sequence[int]) -> list[Outcome]:
    """Mark (run id, fencing token, result) items succeeded; one Outcome per item, in order."""
    outcomes = _apply(COMPLETE, _complete_params, items, team_ids)
    metrics.observe_results(outcomes, "complete")
    _log_outcomes(outcomes, items)
    return outcomes


def _complete_params(items: Sequence[tuple[int, int, Any]]) -> dict[str, Any]:
    results = [None if r is None else _json(r) for _, _, r in items]
    return {
        "ids": _bigints(i for i, _, _ in items),
        "tokens": _bigints(t for _, t, _ in items),
        # No results at all (the common case): a NULL array, which unnest pads with NULLs.
        "results": results if any(r is not None for r in results) else None,
    }


def fail(
    items: Sequence[tuple[int, int, dict[str, Any], bool]], *, team_ids: Sequence[int]
) -> list[Outcome]:
    """Fail (run id, fencing token, error, retryable) items: retrying with backoff, or dead."""
    outcomes = _apply(FAIL, _fail_params, items, team_ids)
    metrics.observe_results(outcomes, "fail")
    _log_outcomes(outcomes, items)
    return outcomes


def _fail_params(items: Sequence[tuple[int, int, dict[str, Any], bool]]) -> dict[str, Any]:
    return {
        "ids": _bigints(i for i, _, _, _ in items),
        "tokens": _bigints(t for _, t, _, _ in items),
        "errors": [_json(e) for _, _, e, _ in items],
        "retryables": [bool(r) for _, _, _, r in items],
        "fingerprints": _bigints(fingerprints.of_error(e) for _, _, e, _ in items),
    }


# The groups of the reaper's two reasons (their messages name the worker or the attempt, their
# groups do not: apps/runs/fingerprints.py).
REAPED_FINGERPRINTS = {
    reason: fingerprints.of(reason, "") for reason in ("timed_out", "lease_expired")
}


@dataclass(frozen=True)
class Reaped:
    id: int
    state: str
    queue: str
    outcome: str
    attempt: int
    job: str


def reap(*, shards: Sequence[int] | None = None, batch: int = 500) -> list[Reaped]:
    """Turn up to `batch` expired leases of these shards (all: None) into failed attempts, in
    one transaction on each of their databases; return what was reaped."""
    owned = range(settings.SCHEDULER_SHARD_COUNT) if shards is None else shards
    reaped: list[Reaped] = []
    for alias in placement.databases():
        mine = [n for n in placement.shards_on(alias) if n in owned]
        if not mine:
            continue
        # Every shard of a database: no filter, as before shards had databases of their own.
        held = None if shards is None else mine
        try:
            with placement.using(alias), atomic(), server_cursor() as cursor:
                cursor.execute(REAP, {"shards": held, "batch": batch, **REAPED_FINGERPRINTS})
                reaped += [
                    Reaped(
                        row["id"],
                        row["state"],
                        row["queue"],
                        row["outcome"],
                        row["attempt"],
                        row["job"],
                    )
                    for row in _rows(cursor)
                ]
        except DatabaseError as exc:
            # Down, or failed at its commit (any error): the other databases are reaped all
            # the same, and this one's leases wait for it (one that raised at its commit held
            # back every database's reap, and the scheduler's whole tick, until it stopped).
            if not placement.physical():
                raise
            log.warning("reap: %s", unavailable(alias, exc), exc_info=True)
            connections[alias].close()
    metrics.observe_reaped(reaped)
    for item in reaped if logs.runs_logged() else ():
        run_event(
            f"run reaped: {item.outcome}",
            run_id=public_run_id(item.id),
            outcome=item.outcome,
            state=item.state,
            queue=item.queue,
            job=item.job,
            attempt=item.attempt,
        )
    return reaped
