"""A worker's lease request: claim now, or wait for work and claim then (the long poll).

The view calls `claim_or_wait` once. The answer is built by the caller's `render` inside the
claim's transaction, and the claim commits only once it is built and the worker is still
there: a failure to render (a payload that cannot be read back, say) or a worker that hung up
rolls the claim back, so no run stays leased to a worker that never got it. A worker that hangs
up after the commit, before its answer is sent, is told by its `Hangup`: the web process gives
those runs back (`Hangup.undelivered`) rather than leave them leased until their lease expires.
"""

from __future__ import annotations

import functools
import itertools
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from typing import TypeVar

import psycopg
from django.db import DatabaseError, InterfaceError, OperationalError, connections

from apps.runs import shards, store
from apps.runs.activity import note_lease_activity
from apps.runs.waiting import listener

T = TypeVar("T")
logger = logging.getLogger(__name__)

# A waiting lease call claims again at least this often: a freed concurrency slot sends no
# NOTIFY (that would be one per completion), nor does a NOTIFY lost with a dropped connection.
RECHECK_SECONDS = 2.0
# How stale a process's copy of the control database's state for claims may be (the
# rate-limited queues; with shards on databases of their own, the teams and the paused queues
# too): a change is held by every web process within this time (at once by the process that
# made it).
CONTROL_STATE_SECONDS = 1.0


@dataclass(frozen=True)
class LeaseRequest:
    team_id: int
    team_ids: Sequence[int] | None
    queues: Sequence[str]
    jobs: Sequence[str] | None
    max_runs: int
    worker_id: str
    lease_seconds: int
    wait_seconds: int


class _WorkerGone(Exception):
    """Raised inside the claim's transaction to roll it back."""


class Hangup(threading.Event):
    """Set when the worker that asked hangs up. Once a claim has committed, `undelivered` gives
    its runs back: the web process calls it when the worker hung up before the answer was sent
    (the answer is then never sent), not after, when the worker may have read it."""

    undelivered: Callable[[], None] | None = None


# The failure a run given back that way records (retryable: it costs an attempt, as the lease's
# expiry would, and is retried after the job's backoff instead of after the lease).
UNDELIVERED = {
    "type": "WorkerGone",
    "message": "the worker hung up before the answer with this lease reached it",
}


def give_back(leases: Sequence[store.Lease]) -> None:
    """Fail the leases as retryable (UNDELIVERED), each under its fencing token."""
    items = [(lease.id, lease.fencing_token, UNDELIVERED, True) for lease in leases]
    outcomes = store.fail(items, team_ids=sorted({lease.team_id for lease in leases}))
    logger.warning(
        "a worker hung up before its lease answer was sent: %d runs given back (%d taken)",
        len(leases),
        sum(outcome.status == 200 for outcome in outcomes),
    )


class _ControlState:
    """What a claim reads from the control database and rarely changes, read again once older
    than CONTROL_STATE_SECONDS: a statement or two a second per process, not one per lease
    request.

    - The rate-limited queues (both layouts).
    - With shards on databases of their own, the teams and the paused queues, which a claim on
      one database finds by joining its own tables. Read per request, they were a round trip
      to the control database before every claim: the store layer on three databases ran at
      0.80-0.85 of one database, 0.90 with them read once a second (bench/README.md, "Shards").
    """

    def __init__(self) -> None:
        self._read_at = float("-inf")
        self._limited: list[store.LimitedQueue] = []
        self._teams: list[int] = []
        self._paused: frozenset[tuple[int, str]] = frozenset()

    def forget(self) -> None:
        """Read it again on the next request (a queue's limit or pause changed in this
        process)."""
        self._read_at = float("-inf")

    def _fresh(self) -> None:
        if time.monotonic() - self._read_at <= CONTROL_STATE_SECONDS:
            return
        self._limited = store.limited_queues()
        if shards.physical():
            teams, paused = store.control_lanes()
            self._teams, self._paused = teams, frozenset(paused)
        self._read_at = time.monotonic()

    def limited(self, request: LeaseRequest) -> list[store.LimitedQueue]:
        """The rate-limited queues among those the request asks for."""
        self._fresh()
        return [
            queue
            for queue in self._limited
            if queue.name in request.queues
            and (request.team_ids is None or queue.team_id in request.team_ids)
        ]

    def lanes(self, request: LeaseRequest) -> store.Lanes:
        """The request's teams and their paused queues among those it asks for."""
        self._fresh()
        team_ids = list(self._teams if request.team_ids is None else request.team_ids)
        wanted = set(team_ids)
        paused = [
            (team, queue)
            for team, queue in self._paused
            if team in wanted and queue in request.queues
        ]
        return store.Lanes(team_ids, paused)


control_state = _ControlState()


def claim_or_wait(
    request: LeaseRequest,
    render: Callable[[list[store.Lease]], T],
    *,
    gone: threading.Event | None = None,
    allowed: Callable[[], None] | None = None,
) -> T:
    """Claim up to `max_runs`; with `wait_seconds`, wait for work first. Answer `render(leases)`.
    `allowed` raises when the caller may lease no more (its token was revoked while it waited:
    the long poll leased runs to a worker whose every next call was refused).

    1. Note which worker asked for which queues (a few writes a minute, not one per call).
    2. Claim in a transaction; render the leases in it; commit only if the worker is still
       connected (`gone` unset), else roll back and answer no leases.
    3. Nothing claimed and time left: give the pooled connection back, wait for a NOTIFY on the
       asked queues or the next run's availableAt (at most RECHECK_SECONDS), then go to 2.
       A process that is stopping (`listener.close_waits`) answers at once instead.
    """
    note_lease_activity(request.team_id, request.queues, request.worker_id)
    deadline = time.monotonic() + request.wait_seconds
    if request.wait_seconds:
        listener.ensure_started()
    waited = False
    while True:
        if gone is not None and gone.is_set():
            # A dead worker's long poll must not lease it runs that nobody would run.
            return render([])
        if waited and allowed is not None:
            allowed()
        seen = listener.generation
        # The map of every try, not only the request's start (a long poll waits up to 60 s):
        # a shard move counts on every claim routing by a map at most a second old, and a
        # claim by an older map leased a moving shard's copy where the move had put it.
        shards.refresh()
        lanes = control_state.lanes(request) if shards.physical() else None
        held = _Held()
        try:
            leases = _claim_everywhere(request, lanes, held)
            answer = render(leases)
            if leases and gone is not None and gone.is_set():
                raise _WorkerGone
        except BaseException as exc:
            _finish(held, exc)
            if isinstance(exc, _WorkerGone):
                return render([])
            raise
        lost = _finish(held, None)
        if lost:
            # A database that failed at commit leased nothing: its runs leave the answer.
            leases = [lease for lease in leases if shards.alias_of_run(lease.id) not in lost]
            answer = render(leases)
        if leases and isinstance(gone, Hangup):
            gone.undelivered = functools.partial(give_back, leases)
        left = deadline - time.monotonic()
        if leases or left <= 0 or listener.closing.is_set():
            return answer
        alarm = min(left, _until_next_available(request, lanes, held.reopens_in))
        _release_pooled_connections()
        listener.wait(seen, alarm)
        waited = True


_rotation = itertools.count()


class _Held(dict[str, ExitStack]):
    """A request's open claim transaction on each database; `rated` when the control
    database's holds the starts of rate-limited queues (it was opened first: it commits first)."""

    rated = False
    # Seconds until the first full window of a rate-limited queue asked has room again.
    reopens_in: float | None = None


def _finish(held: _Held, error: BaseException | None) -> list[str]:
    """Commit each database's claim transaction (roll back, given the `error` that ended the
    request); return the shard databases whose commit failed (their server went away, or it
    raised at its commit: any database error).

    The control database's comes first when the request took rooms in rate-limited queues
    (`_queue_rooms`): when it fails to commit, the starts it recorded are gone, so every other
    claim rolls back with it. Every transaction is closed whatever fails: one left open kept
    its connection inside an atomic block, and the process answered 500 for that database
    until it was restarted."""
    lost = []
    failure: DatabaseError | None = None
    for alias, transaction in held.items():
        try:
            if error is None:
                transaction.close()
            else:
                transaction.__exit__(type(error), error, error.__traceback__)
        except DatabaseError as exc:
            if not shards.physical() or error is not None:
                failure = failure or exc  # raised once the others are closed
                continue
            logger.warning("shard database %s failed to commit a claim", alias, exc_info=True)
            lost.append(alias)
            if held.rated and alias == shards.CONTROL:
                error = exc
                lost.extend(other for other in held if other != alias)
    if failure is not None:
        raise failure
    return lost


def _claim_everywhere(
    request: LeaseRequest, lanes: store.Lanes | None, held: _Held
) -> list[store.Lease]:
    """Claim from every shard database, one transaction each, all held open until the caller
    has built its answer (`held`, by database); a database that cannot be reached is passed
    over.

    Each database in turn is asked for what the batch still lacks, starting at a rotating one
    so that requests spread over the databases: a database gives a whole batch when it has one,
    and its claim costs per run what one database's does (asking each for an equal share, as
    this did first, split every batch in three and halved the rate on three databases:
    bench/README.md, "Shards"). One database: one claim, as before shards had databases of
    their own."""
    rooms = _queue_rooms(request, held)
    databases = shards.databases()
    start = next(_rotation) % len(databases)
    order = databases[start:] + databases[:start]
    claimed: dict[str, list[store.Lease]] = {}
    for alias in order:
        wanted = request.max_runs - sum(map(len, claimed.values()))
        if wanted <= 0:
            break
        _claim_on(alias, request, lanes, wanted, held, claimed, _left(rooms, claimed))
    leases = [lease for alias in order for lease in claimed.get(alias, ())]
    if held.rated:
        lanes_of = [(lease.team_id, lease.queue) for lease in leases]
        store.record_queue_starts([rooms[lane][0] for lane in lanes_of if lane in rooms])
    return leases


def _queue_rooms(request: LeaseRequest, held: _Held) -> dict[tuple[int, str], tuple[int, int]]:
    """For each rate-limited queue asked, by (team, queue): its id and the leases it may still
    start, its row locked in a control-database transaction opened first in `held` (it records
    the starts and commits first: store.py, "Before the claim"). With shards on databases of
    their own, a lock not granted within the claims' lock timeout leaves those queues out of
    this request."""
    asked = control_state.limited(request)
    if not asked:
        return {}
    stack = ExitStack()
    try:
        with shards.using(shards.CONTROL):
            stack.enter_context(store.atomic())
            if shards.physical():
                store.limit_lock_waits()
            found = store.queue_rooms(asked)
    except BaseException as exc:
        stack.__exit__(type(exc), exc, exc.__traceback__)
        gave_up = isinstance(exc, OperationalError) and isinstance(
            exc.__cause__, psycopg.errors.LockNotAvailable
        )
        if not gave_up:
            raise
        logger.info("lease request gave up waiting for a rate-limited queue's lock")
        return {(queue.team_id, queue.name): (queue.id, 0) for queue in asked}
    held[shards.CONTROL] = stack
    held.rated = True
    full = [frees_in for room, frees_in in found.values() if room <= 0 and frees_in is not None]
    held.reopens_in = min(full, default=None)
    return {(queue.team_id, queue.name): (queue.id, found[queue.id][0]) for queue in asked}


def _left(
    rooms: dict[tuple[int, str], tuple[int, int]], claimed: dict[str, list[store.Lease]]
) -> dict[tuple[int, str], int]:
    """The room left in each rate-limited queue after this request's claims so far."""
    if not rooms:
        return {}
    used = Counter((lease.team_id, lease.queue) for got in claimed.values() for lease in got)
    return {lane: room - used[lane] for lane, (_, room) in rooms.items()}


def _claim_on(
    alias: str,
    request: LeaseRequest,
    lanes: store.Lanes | None,
    max_runs: int,
    held: _Held,
    claimed: dict[str, list[store.Lease]],
    queue_room: dict[tuple[int, str], int],
) -> None:
    """Claim up to `max_runs` more on one database, in this request's transaction there (begun
    by its first claim), into `claimed[alias]`."""
    if max_runs <= 0:
        return
    try:
        with ExitStack() as mine, shards.using(alias):
            if alias not in claimed:
                # On the control database after `_queue_rooms`, a savepoint in its transaction:
                # a claim there that fails must not lose the queues' locks.
                mine.enter_context(store.atomic())
            got = store.claim(
                queues=request.queues,
                max_runs=max_runs,
                worker_id=request.worker_id,
                lease_seconds=request.lease_seconds,
                team_ids=request.team_ids,
                jobs=request.jobs,
                lanes=lanes,
                queue_room=queue_room,
            )
            # Claimed: the transaction stays open with the others.
            if alias not in held:
                held[alias] = mine.pop_all()
            claimed.setdefault(alias, []).extend(got)
    except (OperationalError, InterfaceError) as exc:
        if lanes is None:
            raise
        # Its transaction has rolled back, or will when the others commit: none of its leases
        # may be answered.
        claimed.pop(alias, None)
        if isinstance(exc.__cause__, psycopg.errors.LockNotAvailable):
            logger.info("claim on shard database %s gave up a lock wait", alias)
        else:
            logger.warning("shard database %s unavailable for a claim", alias, exc_info=True)


def _until_next_available(
    request: LeaseRequest, lanes: store.Lanes | None, reopens_in: float | None = None
) -> float:
    """Seconds until the earliest waiting run of these queues becomes claimable by the clock,
    or a full rate window (a definition's, or a queue's: `reopens_in`) has room again."""
    found = [reopens_in]
    for alias in shards.databases():
        try:
            with shards.using(alias):
                found.append(store.seconds_until_available(request.queues, request.team_ids, lanes))
        except (OperationalError, InterfaceError):
            if lanes is None:
                raise
    seconds = min((s for s in found if s is not None), default=None)
    if seconds is None:
        return RECHECK_SECONDS
    return max(0.01, min(RECHECK_SECONDS, seconds))


def _release_pooled_connections() -> None:
    """Hand pooled connections back while the call waits: a long poll must not hold one of the
    pools' few connections for its whole wait. The next statement takes one again."""
    for alias in {shards.CONTROL, *shards.databases()}:
        connection = connections[alias]
        if connection.settings_dict["OPTIONS"].get("pool") and not connection.in_atomic_block:
            connection.close()
