"""The database facts behind the gauges of /metrics, one cheap query each."""

from __future__ import annotations

from dataclasses import dataclass, field

from django.db import connection

from apps.runs import depth


@dataclass
class QueueRow:
    team: str
    queue: str
    priority: int
    depth: int
    oldest_age: float


@dataclass
class Snapshot:
    queues: list[QueueRow] = field(default_factory=list)
    dlq: dict[str, int] = field(default_factory=dict)
    lag: dict[int, float] = field(default_factory=dict)
    owners: dict[int, str] = field(default_factory=dict)
    nodes: dict[str, float] = field(default_factory=dict)
    oldest_transaction: float = 0.0
    dead_rows: dict[str, int] = field(default_factory=dict)
    autovacuum: bool = True


# Claimable runs per (team, queue, priority): apps.runs.depth, from the partial index
# run_claimable, which holds only the backlog.
# Dead runs per team: served by run_team_state (team_id, state, id).
DLQ = """
SELECT t.slug, (SELECT count(*) FROM runs_run r WHERE r.team_id = t.id AND r.state = 'dead')
FROM teams_team t
"""
# Overdue definitions per shard: the partial index job_due_by_shard.
LAG = """
SELECT s.shard, coalesce(extract(epoch FROM now() - (
    SELECT min(next_due_at) FROM jobs_jobdefinition d
    WHERE d.shard = s.shard AND NOT d.paused AND d.next_due_at IS NOT NULL)), 0)
FROM scheduler_shardlease s
"""
OWNERS = (
    "SELECT shard, CASE WHEN expires_at > now() THEN owner ELSE '' END FROM scheduler_shardlease"
)
NODES = "SELECT node_id, extract(epoch FROM now() - last_seen_at) FROM scheduler_schedulernode"
# The oldest transaction any other session of this database holds open: while it lasts, vacuum
# cannot remove the versions every claim and completion leaves behind, and claims slow down (to
# a quarter of the rate in the 10-minute soak, bench/README.md).
OLDEST_TRANSACTION = """
SELECT coalesce(extract(epoch FROM now() - min(xact_start)), 0) FROM pg_stat_activity
WHERE datname = current_database() AND pid <> pg_backend_pid() AND backend_type = 'client backend'
"""

# Every claim and completion leaves a dead version of the run (and of its attempt) behind. With
# autovacuum off (some shared or test servers run so) nothing removes them and the claim slows
# as they pile up: the statistics collector's count, and whether autovacuum runs at all.
DEAD_ROWS = """
SELECT relname, n_dead_tup FROM pg_stat_user_tables
WHERE relname IN ('runs_run', 'runs_attempt')
"""
AUTOVACUUM = "SELECT current_setting('autovacuum') = 'on'"


def read() -> Snapshot:
    snapshot = Snapshot()
    snapshot.queues = [
        QueueRow(lane.team_slug, lane.queue, lane.priority, lane.ready, lane.oldest_age)
        for lane in depth.claimable()
    ]
    with connection.cursor() as cursor:
        cursor.execute(DLQ)
        snapshot.dlq = dict(cursor.fetchall())
        cursor.execute(LAG)
        snapshot.lag = {shard: max(0.0, float(lag)) for shard, lag in cursor.fetchall()}
        cursor.execute(OWNERS)
        snapshot.owners = dict(cursor.fetchall())
        cursor.execute(NODES)
        snapshot.nodes = {node: float(age) for node, age in cursor.fetchall()}
        cursor.execute(OLDEST_TRANSACTION)
        snapshot.oldest_transaction = max(0.0, float(cursor.fetchone()[0]))
        cursor.execute(DEAD_ROWS)
        snapshot.dead_rows = dict(cursor.fetchall())
        cursor.execute(AUTOVACUUM)
        snapshot.autovacuum = bool(cursor.fetchone()[0])
    return snapshot
