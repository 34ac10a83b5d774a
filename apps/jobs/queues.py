"""Queues as people see them: depth by priority, oldest ready run, pause state, last worker."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime

from apps.jobs.models import Queue
from apps.runs import depth
from apps.runs.models import PRIORITY_NAMES


@dataclass
class QueueView:
    name: str
    paused: bool = False
    depth: dict[str, int] = field(default_factory=lambda: dict.fromkeys(PRIORITY_NAMES.values(), 0))
    oldest_ready_at: datetime | None = None
    last_leased_at: datetime | None = None
    last_worker_id: str = ""


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
    for lane in depth.claimable([team.pk]):
        view = views.setdefault(lane.queue, QueueView(lane.queue))
        view.depth[PRIORITY_NAMES[lane.priority]] = lane.ready
        if view.oldest_ready_at is None or lane.oldest_ready < view.oldest_ready_at:
            view.oldest_ready_at = lane.oldest_ready
    return sorted(views.values(), key=lambda view: view.name)
