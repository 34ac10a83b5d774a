from __future__ import annotations

from django.db import models


class ShardLease(models.Model):
    """Which scheduler node materialises a shard, until when (database clock)."""

    shard = models.PositiveSmallIntegerField(primary_key=True)
    owner = models.CharField(max_length=200, blank=True, default="")
    # Increases on every change of owner; a write for the shard must carry the current epoch.
    epoch = models.BigIntegerField(default=0)
    expires_at = models.DateTimeField(null=True, blank=True)

    def __str__(self) -> str:
        return f"shard {self.shard} → {self.owner or '-'} (epoch {self.epoch})"


class SchedulerNode(models.Model):
    """A running scheduler process; its last_seen_at (database clock) says it is alive.

    Nodes count the live rows to work out their fair share of the shards. A node deletes its row
    on a clean shutdown, so the others take its shards at once instead of waiting for a timeout.
    """

    node_id = models.CharField(max_length=200, primary_key=True)
    started_at = models.DateTimeField()
    last_seen_at = models.DateTimeField()

    def __str__(self) -> str:
        return self.node_id
