"""Which queues and workers are leasing, and when workers' runs heartbeat: written a few times a
minute per process, not once per call (the lease and heartbeat paths pay a dictionary lookup)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence

from django.db import DatabaseError

from apps.runs import workers
from apps.runs.store import record_lease_activity

logger = logging.getLogger(__name__)

INTERVAL_SECONDS = 5.0
# Keys remembered per table before those older than the interval are dropped (worker ids that
# name processes come and go).
MOST_KEYS = 10_000
# Runs whose heartbeats one team's write carries: their workers' rows need one run each, and
# a worker's runs in flight show their exact heartbeats anyway (apps/runs/workers.py).
MOST_BEATS = 1_000

_lock = threading.Lock()
_last_written: dict[tuple[int, tuple[str, ...]], float] = {}
_worker_written: dict[tuple[int, str], float] = {}
# Per team: run id → when (monotonic) it last heartbeated here, since the team's last write.
_beats: dict[int, dict[int, float]] = {}
_beats_written: dict[int, float] = {}


def _due(written: dict, key: object, now: float) -> bool:
    """Whether `key` was last written an interval ago or more; if so, count it written now.
    Called under the lock."""
    if now - written.get(key, float("-inf")) < INTERVAL_SECONDS:
        return False
    if len(written) >= MOST_KEYS:
        for stale in [k for k, at in written.items() if now - at >= INTERVAL_SECONDS]:
            del written[stale]
    written[key] = now
    return True


def note_lease_activity(team_id: int, queues: Sequence[str], worker_id: str) -> None:
    """Record that a worker asked these queues for work, at most once per interval per process
    for the queues, and once per interval per process for the worker and the queues it asked
    (a worker that asked others within the interval was listed with the queues it had asked
    first: the list's `queues` are its latest request's)."""
    asked = tuple(sorted(set(queues)))
    now = time.monotonic()
    with _lock:
        queues_due = _due(_last_written, (team_id, asked), now)
        worker_due = _due(_worker_written, (team_id, worker_id, asked), now)
    if queues_due:
        record_lease_activity(team_id, asked, worker_id)
    if worker_due:
        workers.record_lease(team_id, asked, worker_id)


def note_heartbeats(team_id: int, run_ids: Sequence[int]) -> None:
    """Remember that these runs of the team heartbeated (leases extended); at most once per
    interval per team and process, write the latest heartbeat of each worker holding them."""
    if not run_ids:
        return
    now = time.monotonic()
    with _lock:
        pending = _beats.setdefault(team_id, {})
        for run_id in run_ids:
            if len(pending) < MOST_BEATS or run_id in pending:
                pending[run_id] = now
        if now - _beats_written.get(team_id, float("-inf")) < INTERVAL_SECONDS:
            return
        _beats_written[team_id] = now
        del _beats[team_id]
    try:
        # Ages, not times: the database's clock stamps them (now() - age).
        workers.record_heartbeats(team_id, {run_id: now - at for run_id, at in pending.items()})
    except DatabaseError:
        # The heartbeats have committed: their answer must not fail for want of a note, which
        # the team's next heartbeats write again.
        logger.warning(
            "heartbeats of team %s not noted for the workers list", team_id, exc_info=True
        )
