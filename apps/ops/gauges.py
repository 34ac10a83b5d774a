"""The database facts behind the gauges of /metrics, one cheap query each."""

from __future__ import annotations

from dataclasses import dataclass, field

from django.conf import settings
from django.db import connections

from apps.runs import depth, shards
from apps.runs.floors import OLDEST_TRANSACTION
from apps.scheduler import moves
from apps.teams.models import Team


@dataclass
class QueueRow:
    team: str
    queue: str
    priority: int
    depth: int
    oldest_age: float


@dataclass
class ShardDatabase:
    """A shard database's facts: `up` False when it could not be read (the rest are empty)."""

    shards: str  # "0-7"
    up: bool
    depth: int = 0
    oldest_transaction: float = 0.0


@dataclass
class Snapshot:
    queues: list[QueueRow] = field(default_factory=list)
    dlq: dict[str, int] = field(default_factory=dict)
    lag: dict[int, float] = field(default_factory=dict)
    owners: dict[int, str] = field(default_factory=dict)
    moves_unfinished: list[int] = field(default_factory=list)  # shards a dead move left
    nodes: dict[str, float] = field(default_factory=dict)
    # The oldest open transaction, dead row versions and autovacuum: the worst of every database.
    oldest_transaction: float = 0.0
    dead_rows: dict[str, int] = field(default_factory=dict)
    autovacuum: bool = True
    databases: list[ShardDatabase] = field(default_factory=list)
    # Per rate-limited job: (starts within its window, its count).
    rate_limits: dict[str, tuple[int, int]] = field(default_factory=dict)
    # Per rate-limited queue, by (team slug, queue): the same.
    queue_rate_limits: dict[tuple[str, str], tuple[int, int]] = field(default_factory=dict)


# Claimable runs per (team, queue, priority): apps.runs.depth, from the partial index
# run_claimable, which holds only the backlog.
# Dead runs per team (the teams are in the control database): served by run_team_state
# (team_id, state, id).
DLQ = """
SELECT t.id, (SELECT count(*) FROM runs_run r WHERE r.team_id = t.id AND r.state = 'dead')
FROM unnest(%(teams)s::bigint[]) AS t(id)
"""
# The most overdue definition of each of the database's shards: the partial index
# job_due_by_shard (shard, next_due_at), one short scan per shard.
LAG = """
SELECT s.shard, coalesce(extract(epoch FROM now() - (
    SELECT min(next_due_at) FROM jobs_jobdefinition d
    WHERE d.shard = s.shard AND NOT d.paused AND d.next_due_at IS NOT NULL)), 0)
FROM unnest(%(shards)s::int[]) AS s(shard)
"""
# The rate-limited definitions and the starts within their windows: the definitions are few
# (only those with a rate limit), each window read from ratestart_window.
RATE_LIMITS = """
SELECT d.name, d.rate_limit_count,
       (SELECT count(*) FROM runs_ratestart s
        WHERE s.definition_id = d.id
          AND s.started_at > now() - make_interval(secs => d.rate_limit_period_seconds))
FROM jobs_jobdefinition d WHERE d.rate_limit_count IS NOT NULL
"""
# In the control database: the rate-limited queues (few) and their windows (queuestart_window).
QUEUE_RATE_LIMITS = """
SELECT q.team_id, q.name, q.rate_limit_count,
       (SELECT count(*) FROM jobs_queuestart s
        WHERE s.queue_id = q.id
          AND s.started_at > now() - make_interval(secs => q.rate_limit_period_seconds))
FROM jobs_queue q WHERE q.rate_limit_count IS NOT NULL
"""
OWNERS = (
    "SELECT shard, CASE WHEN expires_at > now() THEN owner ELSE '' END FROM scheduler_shardlease"
)
NODES = "SELECT node_id, extract(epoch FROM now() - last_seen_at) FROM scheduler_schedulernode"
# Every claim and completion leaves a dead version of the run (and of its attempt) behind. With
# autovacuum off (some shared or test servers run so) nothing removes them and the claim slows
# as they pile up: the statistics collector's count, and whether autovacuum runs at all.
DEAD_ROWS = """
SELECT relname, n_dead_tup FROM pg_stat_user_tables
WHERE relname IN ('runs_run', 'runs_attempt')
"""
AUTOVACUUM = "SELECT current_setting('autovacuum') = 'on'"


def read() -> Snapshot:
    """Every gauge: the control database's facts, and each shard database's (one that is down
    is reported down and leaves its runs out of the others)."""
    snapshot = Snapshot()
    claimable, depths = depth.claimable_by_database()
    snapshot.queues = [
        QueueRow(lane.team_slug, lane.queue, lane.priority, lane.ready, lane.oldest_age)
        for lane in claimable
    ]
    slugs = dict(Team.objects.using(shards.CONTROL).values_list("pk", "slug"))
    with connections[shards.CONTROL].cursor() as cursor:
        cursor.execute(OWNERS)
        # Every shard, those no scheduler ever leased (no row yet) too: with only the rows, a
        # database no scheduler had run on had no series, and ShardWithoutOwner never fired.
        snapshot.owners = dict.fromkeys(range(settings.SCHEDULER_SHARD_COUNT), "")
        snapshot.owners.update(cursor.fetchall())
        snapshot.moves_unfinished = moves.unfinished()
        cursor.execute(NODES)
        snapshot.nodes = {node: float(age) for node, age in cursor.fetchall()}
        cursor.execute(QUEUE_RATE_LIMITS)
        snapshot.queue_rate_limits = {
            (slugs[team], queue): (used, count) for team, queue, count, used in cursor.fetchall()
        }
        if shards.CONTROL not in shards.databases():
            _health(cursor, snapshot)
    snapshot.dlq = dict.fromkeys(slugs.values(), 0)
    for alias in shards.databases():
        held = ShardDatabase(shards.span(alias), up=False)
        snapshot.databases.append(held)
        try:
            with connections[alias].cursor() as cursor:
                cursor.execute(DLQ, {"teams": list(slugs)})
                for team_id, dead in cursor.fetchall():
                    snapshot.dlq[slugs[team_id]] += dead
                cursor.execute(RATE_LIMITS)
                snapshot.rate_limits.update(
                    (name, (used, count)) for name, count, used in cursor.fetchall()
                )
                cursor.execute(LAG, {"shards": shards.shards_on(alias)})
                snapshot.lag.update(
                    (shard, max(0.0, float(lag))) for shard, lag in cursor.fetchall()
                )
                held.oldest_transaction = _health(cursor, snapshot)
        except shards.UNREADABLE:
            if not shards.physical():
                raise
            connections[alias].close()
            continue
        held.up = True
        held.depth = depths.get(held.shards) or 0
    return snapshot


def _health(cursor, snapshot: Snapshot) -> float:
    """Add a database's open transaction, dead rows and autovacuum to the snapshot; return the
    age of its oldest open transaction."""
    cursor.execute(OLDEST_TRANSACTION)
    oldest = max(0.0, float(cursor.fetchone()[0]))
    snapshot.oldest_transaction = max(snapshot.oldest_transaction, oldest)
    cursor.execute(DEAD_ROWS)
    for table, dead in cursor.fetchall():
        snapshot.dead_rows[table] = snapshot.dead_rows.get(table, 0) + dead
    cursor.execute(AUTOVACUUM)
    snapshot.autovacuum = snapshot.autovacuum and bool(cursor.fetchone()[0])
    return oldest
