"""Claim floors: where a lane's next claim starts while another session holds an old snapshot.

A claimed run leaves its entry in `run_claimable` (the index's entry for the version that was
waiting). Vacuum, and the index scans themselves, drop such entries once no snapshot can see
that version, but while any session keeps a transaction open nothing can: every claim of a lane
starts at its head and walks past the entry of every run claimed since, reading each one's heap
row to find it gone (3 300 buffers per claim after 100 000 runs; the rate fell to a fifth in
the 10-minute soak, bench/README.md).

So, only while the oldest transaction of the claim's database is older than
HELD_SNAPSHOT_SECONDS, each process remembers per lane (team, queue, priority) where its last
claim of runs without limits stopped, `(available_at, id)` of the last run it leased there
before the first candidate it let go, and its next claim of that lane starts past it: an index
bound, not a walk. A floor lives FLOOR_SECONDS from when it was set at the head, then the lane
is read from the head once again, so a run behind a floor (one another claimer locked as a
candidate and let go, or one that became claimable with an older `available_at`, a catch-up
run say) waits at most that long more, and only while a snapshot is held. Without one, no floor
is kept and no run ever waits behind one.

Floors stay LINGER_SECONDS after the old snapshot ends. The entries it held up are then dead to
everyone, but still in the index until a scan marks them (or vacuum, busy with millions of dead
rows, removes them): without floors, every claim at once walked the whole dead stretch from the
head, and the 10-minute soak fell from 6 000 to 2 000 runs/s for 50 s right after its open
transaction closed. With them, only the head read of each lane, once a second, walks it and
marks what it passes (bench/README.md, "Floors that linger").
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Mapping
from datetime import datetime
from typing import Any

# How old the oldest open transaction must be before floors are kept: a claim, a completion or a
# dashboard read is over well within it; a session left idle in a transaction is not.
HELD_SNAPSHOT_SECONDS = 10.0
# How long floors are kept after the old snapshot has ended (see above).
LINGER_SECONDS = 60.0
# How long a floor lives before its lane is read from the head again: the most a run left
# behind one waits for it (measured: bench/README.md, "Claim floors").
FLOOR_SECONDS = 1.0
# How often a process asks each database for its oldest transaction (one statement).
CHECK_SECONDS = 1.0

# The oldest transaction any other client session of this database holds open. While it lasts,
# vacuum cannot remove the versions every claim and completion leaves behind (apps/ops reports
# it as scheduler_oldest_transaction_seconds).
OLDEST_TRANSACTION = """
SELECT coalesce(extract(epoch FROM now() - min(xact_start)), 0) FROM pg_stat_activity
WHERE datname = current_database() AND pid <> pg_backend_pid() AND backend_type = 'client backend'
"""

Lane = tuple[int, str, int]  # team, queue, priority


class _Floors:
    """This process's floors, by database and lane; claims of several threads share them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: dict[str, bool] = {}  # by database: floors are kept (see `checked`)
        self._held_seen_at: dict[str, float] = {}  # by database: an old snapshot last seen
        self._checked_at: dict[str, float] = {}
        # (database, lane) -> (available_at, id, set at: monotonic)
        self._floors: dict[tuple[str, Lane], tuple[datetime, int, float]] = {}

    def due_check(self, alias: str) -> bool:
        """Whether the database's oldest transaction should be read again now."""
        return time.monotonic() - self._checked_at.get(alias, float("-inf")) >= CHECK_SECONDS

    def checked(self, alias: str, oldest_seconds: float) -> None:
        """Note the database's oldest transaction: floors are kept while it is old, and for
        LINGER_SECONDS after."""
        now = time.monotonic()
        with self._lock:
            if oldest_seconds >= HELD_SNAPSHOT_SECONDS:
                self._held_seen_at[alias] = now
            held = now - self._held_seen_at.get(alias, float("-inf")) < LINGER_SECONDS
            self._checked_at[alias] = now
            self._held[alias] = held
            if not held:
                for key in [key for key in self._floors if key[0] == alias]:
                    del self._floors[key]

    def active(self, alias: str) -> bool:
        return self._held.get(alias, False)

    def params(self, alias: str) -> dict[str, list[Any]]:
        """The live floors of this database's lanes, as the claim statement's arrays."""
        now = time.monotonic()
        teams: list[int] = []
        queues: list[str] = []
        priorities: list[int] = []
        ats: list[datetime] = []
        ids: list[int] = []
        with self._lock:
            for (database, (team, queue, priority)), (at, run, set_at) in list(
                self._floors.items()
            ):
                if database != alias:
                    continue
                if now - set_at >= FLOOR_SECONDS:
                    del self._floors[(database, (team, queue, priority))]
                    continue
                teams.append(team)
                queues.append(queue)
                priorities.append(priority)
                ats.append(at)
                ids.append(run)
        return {"teams": teams, "queues": queues, "priorities": priorities, "ats": ats, "ids": ids}

    def advance(
        self, alias: str, candidates: Iterable[Mapping[str, Any]], chosen: set[int]
    ) -> None:
        """Move each lane's floor to its last leased run before the first candidate let go.

        `candidates` are the claim's, in (priority, available_at, id) order; only runs without
        limits count (the others are read from other indexes)."""
        stopped: set[Lane] = set()
        reached: dict[Lane, tuple[datetime, int]] = {}
        for row in candidates:
            if row["concurrency"] is not None or row["per_key"] is not None:
                continue
            if row["rate_count"] is not None:
                continue
            lane = (row["team_id"], row["queue"], row["priority"])
            if lane in stopped:
                continue
            if row["id"] in chosen:
                reached[lane] = (row["available_at"], row["id"])
            else:
                stopped.add(lane)
        if not reached:
            return
        now = time.monotonic()
        with self._lock:
            for lane, (at, run) in reached.items():
                known = self._floors.get((alias, lane))
                # A floor keeps the time it was set at the head: advancing does not renew it.
                self._floors[(alias, lane)] = (at, run, known[2] if known else now)


floors = _Floors()
