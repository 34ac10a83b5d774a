"""Shard leases and node liveness: which scheduler node materialises which shard.

Every statement uses the database clock. A lease is held by (owner, epoch) until `expires_at`;
the epoch grows on every acquisition, so a node that slept through its expiry and lost the shard
can neither renew it nor write for it (see materialiser.LOCK_LEASE). Each change is a conditional
UPDATE whose RETURNING rows say what this node now holds; a row missing from them means another
node won. The tables are tiny (one row per shard, one per node): no index beyond the keys.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from django.db import connection, transaction

# Shards are rows from the start, so acquiring is always an UPDATE and never races an INSERT.
ENSURE_SHARDS = """
INSERT INTO scheduler_shardlease (shard, owner, epoch, expires_at)
SELECT s, '', 0, NULL FROM generate_series(0, %(count)s - 1) AS s
ON CONFLICT (shard) DO NOTHING
"""

ANNOUNCE = """
INSERT INTO scheduler_schedulernode (node_id, started_at, last_seen_at)
VALUES (%(node)s, now(), now())
ON CONFLICT (node_id) DO UPDATE SET last_seen_at = now()
"""

# A node is live while its last announcement is younger than one lease TTL. Announcing and
# renewing in the same transaction (same now()) makes a silent node stop counting exactly when
# its leases run out, so the others grow their fair share just as its shards become free.
LIVE_NODES = """
SELECT count(*) FROM scheduler_schedulernode
WHERE last_seen_at > now() - make_interval(secs => %(ttl)s)
"""

# Rows of nodes that died without a clean shutdown: kept an hour so an operator can see which
# node went silent and when, then dropped (a few rows: cheap to run on every announcement).
FORGET_DEAD_NODES = """
DELETE FROM scheduler_schedulernode WHERE last_seen_at < now() - interval '1 hour'
"""

# Renewal succeeds only for the current owner with the current epoch, and only before expiry: an
# expired lease may already be being taken, so its old holder must treat it as lost.
RENEW = """
UPDATE scheduler_shardlease l
SET expires_at = now() + make_interval(secs => %(ttl)s)
FROM unnest(%(shards)s::int[], %(epochs)s::bigint[]) AS h(shard, epoch)
WHERE l.shard = h.shard AND l.epoch = h.epoch AND l.owner = %(node)s AND l.expires_at > now()
RETURNING l.shard, l.epoch
"""

# Take up to `room` free shards (never held, released, or expired). SKIP LOCKED: a shard whose
# row another node is taking or materialising (FOR SHARE) is not waited for, it is tried next tick.
ACQUIRE = """
WITH free AS (
    SELECT shard FROM scheduler_shardlease
    WHERE shard < %(count)s AND (expires_at IS NULL OR expires_at <= now())
    ORDER BY shard
    LIMIT %(room)s
    FOR UPDATE SKIP LOCKED
)
UPDATE scheduler_shardlease l
SET owner = %(node)s, epoch = l.epoch + 1, expires_at = now() + make_interval(secs => %(ttl)s)
FROM free
WHERE l.shard = free.shard
RETURNING l.shard, l.epoch
"""

# Give shards back so that another node can take them at once (expires_at in the past).
RELEASE = """
UPDATE scheduler_shardlease l
SET owner = '', expires_at = now() - interval '1 second'
FROM unnest(%(shards)s::int[], %(epochs)s::bigint[]) AS h(shard, epoch)
WHERE l.shard = h.shard AND l.epoch = h.epoch AND l.owner = %(node)s
RETURNING l.shard
"""

RELEASE_ALL = """
UPDATE scheduler_shardlease SET owner = '', expires_at = now() - interval '1 second'
WHERE owner = %(node)s
"""

LEAVE = "DELETE FROM scheduler_schedulernode WHERE node_id = %(node)s"


def fair_share(shard_count: int, live_nodes: int) -> int:
    """Return how many shards one node may hold: ceil(shards / live nodes)."""
    return math.ceil(shard_count / max(live_nodes, 1))


def ensure_shards(shard_count: int) -> None:
    """Create the lease rows of shards 0 … shard_count - 1 that do not exist yet."""
    with connection.cursor() as cursor:
        cursor.execute(ENSURE_SHARDS, {"count": shard_count})


def _pairs(held: Mapping[int, int]) -> dict[str, list[int]]:
    shards = sorted(held)
    return {"shards": shards, "epochs": [held[s] for s in shards]}


def announce_and_renew(node: str, held: Mapping[int, int], ttl: int) -> tuple[int, dict[int, int]]:
    """Say this node is alive and renew its leases; return (live nodes, leases still held)."""
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute(ANNOUNCE, {"node": node})
        cursor.execute(FORGET_DEAD_NODES)
        cursor.execute(LIVE_NODES, {"ttl": ttl})
        live = cursor.fetchone()[0]
        renewed: dict[int, int] = {}
        if held:
            cursor.execute(RENEW, {"node": node, "ttl": ttl, **_pairs(held)})
            renewed = dict(cursor.fetchall())
    return live, renewed


def renew(node: str, held: Mapping[int, int], ttl: int) -> dict[int, int]:
    """Renew this node's leases; return the ones still held (row count 0 = all lost)."""
    if not held:
        return {}
    with connection.cursor() as cursor:
        cursor.execute(RENEW, {"node": node, "ttl": ttl, **_pairs(held)})
        return dict(cursor.fetchall())


def acquire(node: str, room: int, shard_count: int, ttl: int) -> dict[int, int]:
    """Take up to `room` free shards; return {shard: epoch} of those taken."""
    if room <= 0:
        return {}
    with connection.cursor() as cursor:
        cursor.execute(ACQUIRE, {"node": node, "room": room, "count": shard_count, "ttl": ttl})
        return dict(cursor.fetchall())


def release(node: str, held: Mapping[int, int]) -> list[int]:
    """Give up these leases (if still ours, same epoch); return the shards released."""
    if not held:
        return []
    with connection.cursor() as cursor:
        cursor.execute(RELEASE, {"node": node, **_pairs(held)})
        return sorted(row[0] for row in cursor.fetchall())


def leave(node: str) -> None:
    """Release every lease of this node and remove it from the live nodes, in one transaction."""
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute(RELEASE_ALL, {"node": node})
        cursor.execute(LEAVE, {"node": node})
