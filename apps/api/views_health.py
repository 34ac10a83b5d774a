from __future__ import annotations

from django.conf import settings
from django.db import DEFAULT_DB_ALIAS, connections
from django.db.migrations.executor import MigrationExecutor
from django.http import HttpRequest, HttpResponse, JsonResponse
from prometheus_client import CONTENT_TYPE_LATEST

from apps.api.ops_access import ops_only
from apps.ops.metrics import render
from apps.runs import depth
from apps.runs import shards as shard_map
from apps.runs.clock import format_utc

# A scheduler node renews its row every tick; one silent this long is reported as stale.
STALE_SCHEDULER_SECONDS = 30

SCHEDULERS = """
SELECT n.node_id, n.last_seen_at, extract(epoch FROM now() - n.last_seen_at),
       (SELECT count(*) FROM scheduler_shardlease s WHERE s.owner = n.node_id AND s.expires_at > now())
FROM scheduler_schedulernode n ORDER BY n.node_id
"""
# Shards without a live lease, those no scheduler has ever leased (no row yet) included.
UNOWNED = """
SELECT %(shards)s - count(*) FROM scheduler_shardlease
WHERE owner <> '' AND expires_at > now() AND shard < %(shards)s
"""
# On a shard database: how far its most overdue definition is behind, from the partial index
# job_due_by_shard (shard, next_due_at).
LAG = """
SELECT extract(epoch FROM now() - min(next_due_at)) FROM jobs_jobdefinition
WHERE shard = ANY(%(shards)s::int[]) AND NOT paused AND next_due_at IS NOT NULL
"""


def healthz(request: HttpRequest) -> JsonResponse:
    """The process is up. Open to everyone: load balancers probe it from anywhere."""
    return JsonResponse({"status": "ok"})


@ops_only
def readyz(request: HttpRequest) -> JsonResponse:
    """The database answers and every migration is applied; also who is scheduling.

    For the monitoring networks (ops_only): the answer names nodes and database errors.
    Scheduler heartbeats are reported but do not make the web process unready: the API keeps
    serving workers while schedulers restart.
    """
    try:
        connection = connections[DEFAULT_DB_ALIAS]
        # Before the tables are read: on a database not migrated at all, the reason given was
        # the first missing table's error.
        if pending := _pending_migrations(DEFAULT_DB_ALIAS):
            return JsonResponse(
                {"status": "unavailable", "detail": f"{len(pending)} migrations pending"},
                status=503,
            )
        with connection.cursor() as cursor:
            cursor.execute(SCHEDULERS)
            nodes = cursor.fetchall()
            cursor.execute(UNOWNED, {"shards": settings.SCHEDULER_SHARD_COUNT})
            unowned = cursor.fetchone()[0]
    except Exception as exc:  # noqa: BLE001 - any failure means "not ready"
        return JsonResponse({"status": "unavailable", "detail": str(exc)}, status=503)
    schedulers = [
        {
            "node": node,
            "lastSeenAt": format_utc(seen),
            "stale": age > STALE_SCHEDULER_SECONDS,
            "shards": shards,
        }
        for node, seen, age, shards in nodes
    ]
    shard_map.refresh()
    _, depths = depth.claimable_by_database()
    databases = [_shard_database(alias, depths) for alias in shard_map.databases()]
    behind = [d["shards"] for d in databases if d.get("migrated") is False]
    if behind:
        # A deploy that left a shard database unmigrated serves none of its shards.
        return JsonResponse(
            {
                "status": "unavailable",
                "detail": f"the database of shards {', '.join(behind)} has migrations pending",
                "shardDatabases": databases,
            },
            status=503,
        )
    # A shard database that is down leaves the others served: "degraded", still 200.
    status = "ok" if all(d["reachable"] for d in databases) else "degraded"
    return JsonResponse(
        {
            "status": status,
            "schedulers": schedulers,
            "unownedShards": unowned,
            "shardDatabases": databases,
        }
    )


def _shard_database(alias: str, depths: dict[str, int | None]) -> dict:
    """Whether a shard database answers, with its shards (never its URL), its claimable runs and
    how far its most overdue definition is behind (the lag of the schedulers of its shards)."""
    answer: dict = {"shards": shard_map.span(alias)}
    try:
        if alias != DEFAULT_DB_ALIAS and _pending_migrations(alias):
            return {**answer, "reachable": True, "migrated": False}
        with connections[alias].cursor() as cursor:
            cursor.execute(LAG, {"shards": shard_map.shards_on(alias)})
            lag = cursor.fetchone()[0]
    except Exception as exc:  # noqa: BLE001 - any failure means "not reachable"
        connections[alias].close()
        return {**answer, "reachable": False, "detail": type(exc).__name__}
    return {
        **answer,
        "reachable": True,
        "depth": depths.get(answer["shards"]) or 0,
        "lagSeconds": round(max(0.0, float(lag or 0)), 3),
    }


def _pending_migrations(alias: str) -> list:
    executor = MigrationExecutor(connections[alias])
    return executor.migration_plan(executor.loader.graph.leaf_nodes())


@ops_only
def metrics(request: HttpRequest) -> HttpResponse:
    """Prometheus text format, for the monitoring networks (ops_only)."""
    return HttpResponse(render(), content_type=CONTENT_TYPE_LATEST)
