"""Which queues workers are leasing from, written a few times a minute, not once per claim."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

from apps.runs.store import record_lease_activity

INTERVAL_SECONDS = 5.0

_lock = threading.Lock()
_last_written: dict[tuple[int, tuple[str, ...]], float] = {}


def note_lease_activity(team_id: int, queues: Sequence[str], worker_id: str) -> None:
    """Record that a worker asked these queues for work, at most once per interval per process."""
    key = (team_id, tuple(sorted(set(queues))))
    now = time.monotonic()
    with _lock:
        if now - _last_written.get(key, float("-inf")) < INTERVAL_SECONDS:
            return
        _last_written[key] = now
    record_lease_activity(team_id, key[1], worker_id)
