"""Queues as people see them: depth by priority, oldest ready run, pause state, last worker,
rate limit and its use."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta

from apps.jobs.models import JobDefinition, Queue, QueueStart
from apps.runs import depth, shards
from apps.runs.clock import database_now
from apps.runs.models import PRIORITY_NAMES


@dataclass(frozen=True)
class RateWindow:
    count: int
    period_seconds: int
    used: int  # leases started within the window
    next_slot_in: float | None  # seconds until the oldest of them leaves it

    @property
    def full(self) -> bool:
        return self.used >= self.count


def rate_window(queue: Queue, now: datetime) -> RateWindow | None:
    """The queue's rate window as the claim counts it (served by queuestart_window)."""
    if queue.rate_limit_count is None:
        return None
    period = queue.rate_limit_period_seconds
    starts = QueueStart.objects.filter(queue=queue, started_at__gt=now - timedelta(seconds=period))
    used = starts.count()
    opens = None
    if used:
        # A slot opens when the start that leaves the window below the limit leaves it: the
        # oldest while the window holds no more than the limit, a later one after the limit
        # was lowered (the oldest said a slot opened early).
        skip = max(used - queue.rate_limit_count, 0)
        leaving = starts.order_by("started_at").values_list("started_at", flat=True)[skip]
        opens = max(0.0, (leaving + timedelta(seconds=period) - now).total_seconds())
    return RateWindow(queue.rate_limit_count, period, used, opens)


@dataclass
class QueueView:
    name: str
    paused: bool = False
    depth: dict[str, int] = field(default_factory=lambda: dict.fromkeys(PRIORITY_NAMES.values(), 0))
    oldest_ready_at: datetime | None = None
    last_leased_at: datetime | None = None
    last_worker_id: str = ""
    rate: RateWindow | None = None


def overview(team) -> list[QueueView]:
    """Every queue of the team that has a backlog, a definition, or a row (paused or leased)."""
    views: dict[str, QueueView] = {}
    # From every shard database (a database that is down is noted by `gather`): the team's
    # related manager would read only the control database, where the team is.
    names, _ = shards.gather(
        lambda: list(
            JobDefinition.objects.filter(team=team).values_list("queue", flat=True).distinct()
        )
    )
    for name in sorted({name for part in names for name in part}):
        views.setdefault(name, QueueView(name))
    now = database_now()
    for queue in Queue.objects.filter(team=team):
        view = views.setdefault(queue.name, QueueView(queue.name))
        view.paused = queue.paused
        view.last_leased_at = queue.last_leased_at
        view.last_worker_id = queue.last_worker_id
        view.rate = rate_window(queue, now)
    for lane in depth.claimable([team.pk]):
        view = views.setdefault(lane.queue, QueueView(lane.queue))
        view.depth[PRIORITY_NAMES[lane.priority]] = lane.ready
        if view.oldest_ready_at is None or lane.oldest_ready < view.oldest_ready_at:
            view.oldest_ready_at = lane.oldest_ready
    return sorted(views.values(), key=lambda view: view.name)
