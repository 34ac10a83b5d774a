"""Queues as people see them: depth by priority, oldest ready run, pause state, last worker."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime

from django.db import connection

from apps.jobs.models import Queue
from apps.runs.models import PRIORITY_NAMES


@dataclass
class QueueView:
    name: str
    paused: bool = False
    depth: dict[str, int] = field(default_factory=lambda: dict.fromkeys(PRIORITY_NAMES.values(), 0))
    oldest_ready_at: datetime | None = None
    last_leased_at: datetime | None = None
    last_worker_id: str = ""


# Served by the partial index run_claimable, whose leading columns are (team_id, queue, priority):
# only the backlog is read, never the finished runs.
DEPTH = """
SELECT queue, priority, count(*), min(available_at)
FROM runs_run
WHERE team_id = %(team)s AND state IN ('scheduled', 'ready', 'retrying') AND available_at <= now()
GROUP BY queue, priority
"""


def overview(team) -> list[QueueView]:
    """Every queue of the team that has a backlog, a definition, or a row (paused or leased)."""
    views: dict[str, QueueView] = {}
    for name in team.jobs.values_list("queue", flat=True).distinct():
        views.setdefault(name, QueueView(name))
    for queue in Queue.objects.filter(team=team):
        view = views.setdefault(queue.name, QueueView(queue.name))
        view.paused = queue.paused
        view.last_leased_at = queue.last_leased_at
        view.last_worker_id = queue.last_worker_id
    with connection.cursor() as cursor:
        cursor.execute(DEPTH, {"team": team.pk})
        for name, priority, count, oldest in cursor.fetchall():
            view = views.setdefault(name, QueueView(name))
            view.depth[PRIORITY_NAMES[priority]] = count
            if view.oldest_ready_at is None or oldest < view.oldest_ready_at:
                view.oldest_ready_at = oldest
    return sorted(views.values(), key=lambda view: view.name)
