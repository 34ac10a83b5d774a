"""/metrics: the run counters every process keeps (apps/runs/metrics.py), and gauges that are
facts of the database, read at scrape time (apps/ops/gauges.py).

With PROMETHEUS_MULTIPROC_DIR set, the counters of every process of the host are added up.
"""

from __future__ import annotations

import logging
import os

from prometheus_client import CollectorRegistry, generate_latest, multiprocess
from prometheus_client.core import GaugeMetricFamily

from apps.ops import gauges
from apps.runs import shards
from apps.runs.models import PRIORITY_NAMES

logger = logging.getLogger(__name__)


class DatabaseCollector:
    """Gauges that are facts of the database, read when Prometheus scrapes."""

    def collect(self):
        try:
            snapshot = gauges.read()
        except shards.UNREADABLE as exc:
            # The control database cannot be read (down, or not migrated): the counters are
            # still served, with the database's gauges saying so, not a 500 (an operator lost
            # every counter during the very incident they were needed for).
            logger.warning("/metrics without the database's gauges: %s", exc)
            return self._readable(False)
        depth = GaugeMetricFamily(
            "scheduler_queue_depth", "Claimable runs.", labels=["team", "queue", "priority"]
        )
        oldest = GaugeMetricFamily(
            "scheduler_oldest_ready_age_seconds",
            "Age of the oldest claimable run.",
            labels=["team", "queue", "priority"],
        )
        for row in snapshot.queues:
            labels = [row.team, row.queue, PRIORITY_NAMES[row.priority]]
            depth.add_metric(labels, row.depth)
            oldest.add_metric(labels, row.oldest_age)
        dlq = GaugeMetricFamily(
            "scheduler_dlq_size", "Dead runs waiting to be handled.", labels=["team"]
        )
        for team, count in snapshot.dlq.items():
            dlq.add_metric([team], count)
        lag = GaugeMetricFamily(
            "scheduler_materialiser_lag_seconds",
            "How far the most overdue definition of a shard is behind (0 when none is overdue).",
            labels=["shard"],
        )
        for shard, seconds in snapshot.lag.items():
            lag.add_metric([str(shard)], seconds)
        owner = GaugeMetricFamily(
            "scheduler_shard_owned",
            "1 when the shard has a live owner, by owner node.",
            labels=["shard", "node"],
        )
        for shard, node in snapshot.owners.items():
            owner.add_metric([str(shard), node or ""], 1 if node else 0)
        # Every shard, so that the rule's expression has a series to compare whatever happens.
        unfinished = GaugeMetricFamily(
            "scheduler_shard_move_unfinished",
            "1 when a move of the shard died half way (manage.py moveshard finishes or undoes it"
            " when run again): its runs may wait meanwhile.",
            labels=["shard"],
        )
        for shard in snapshot.owners:
            unfinished.add_metric([str(shard)], 1 if shard in snapshot.moves_unfinished else 0)
        heartbeat = GaugeMetricFamily(
            "scheduler_node_heartbeat_age_seconds",
            "Seconds since a scheduler node was last seen.",
            labels=["node"],
        )
        for node, age in snapshot.nodes.items():
            heartbeat.add_metric([node], age)
        transaction = GaugeMetricFamily(
            "scheduler_oldest_transaction_seconds",
            "Age of the oldest transaction another session holds open in the database "
            "(it keeps vacuum from cleaning the runs table).",
        )
        transaction.add_metric([], snapshot.oldest_transaction)
        dead = GaugeMetricFamily(
            "scheduler_dead_row_versions",
            "Dead row versions vacuum has yet to remove, per hot table (PostgreSQL's statistics).",
            labels=["table"],
        )
        for table, count in sorted(snapshot.dead_rows.items()):
            dead.add_metric([table], count)
        autovacuum = GaugeMetricFamily(
            "scheduler_autovacuum_enabled",
            "1 when the database runs autovacuum; with 0 nothing cleans the runs table.",
        )
        autovacuum.add_metric([], 1 if snapshot.autovacuum else 0)
        up = GaugeMetricFamily(
            "scheduler_shard_database_up",
            "1 when the database of these shards answers, 0 while it cannot be reached.",
            labels=["shards"],
        )
        backlog = GaugeMetricFamily(
            "scheduler_shard_database_depth",
            "Claimable runs in the database of these shards.",
            labels=["shards"],
        )
        open_for = GaugeMetricFamily(
            "scheduler_shard_database_oldest_transaction_seconds",
            "Age of the oldest transaction another session holds open in this shard database.",
            labels=["shards"],
        )
        rate_used = GaugeMetricFamily(
            "scheduler_rate_limit_used",
            "Leases started within the rate window of a rate-limited job.",
            labels=["job"],
        )
        rate_count = GaugeMetricFamily(
            "scheduler_rate_limit", "The starts a rate-limited job's window allows.", labels=["job"]
        )
        for job, (used, count) in sorted(snapshot.rate_limits.items()):
            rate_used.add_metric([job], used)
            rate_count.add_metric([job], count)
        queue_used = GaugeMetricFamily(
            "scheduler_queue_rate_limit_used",
            "Leases started within the rate window of a rate-limited queue.",
            labels=["team", "queue"],
        )
        queue_count = GaugeMetricFamily(
            "scheduler_queue_rate_limit",
            "The starts a rate-limited queue's window allows.",
            labels=["team", "queue"],
        )
        for (team, queue), (used, count) in sorted(snapshot.queue_rate_limits.items()):
            queue_used.add_metric([team, queue], used)
            queue_count.add_metric([team, queue], count)
        for database in snapshot.databases:
            up.add_metric([database.shards], 1 if database.up else 0)
            if database.up:
                backlog.add_metric([database.shards], database.depth)
                open_for.add_metric([database.shards], database.oldest_transaction)
        return [
            depth,
            oldest,
            dlq,
            lag,
            owner,
            unfinished,
            heartbeat,
            transaction,
            dead,
            autovacuum,
            up,
            backlog,
            open_for,
            rate_used,
            rate_count,
            queue_used,
            queue_count,
            *self._readable(True),
        ]

    @staticmethod
    def _readable(readable: bool) -> list[GaugeMetricFamily]:
        """Whether the gauges could be read; when not, the control database (if it holds
        shards) reported down."""
        gauge = GaugeMetricFamily(
            "scheduler_database_gauges_readable",
            "1 when /metrics could read the database's gauges, 0 when it could not.",
        )
        gauge.add_metric([], 1 if readable else 0)
        if readable:
            return [gauge]
        up = GaugeMetricFamily(
            "scheduler_shard_database_up",
            "1 when the database of these shards answers, 0 while it cannot be reached.",
            labels=["shards"],
        )
        if shards.CONTROL in shards.databases():
            up.add_metric([shards.span(shards.CONTROL)], 0)
        return [gauge, up]


def render() -> bytes:
    registry = CollectorRegistry()
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        multiprocess.MultiProcessCollector(registry)
    else:
        from prometheus_client import REGISTRY

        for collector in list(REGISTRY._collector_to_names):
            registry.register(collector)
    registry.register(DatabaseCollector())
    return generate_latest(registry)
