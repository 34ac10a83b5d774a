"""The scheduler loop: hold shard leases, reap expired run leases, materialise due runs, and
(in a thread of its own, apps/notify/loop.py) page the teams' notification channels.

Shaped like healthchecks' sendalerts: every step is a `handle_one_…() -> bool` method ("did
work, call me again") that tests call directly; `run()` strings them together, once per tick.
Signals only set `shutdown`; the loop finishes the step in progress, releases this node's shards
and returns.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from django.conf import settings
from django.db import DatabaseError, close_old_connections, connection, connections

from apps.jobs import services
from apps.notify import loop as notifier
from apps.runs import census, retention, shards, store
from apps.scheduler import leases
from apps.scheduler.materialiser import grace_for, materialise_batch

log = logging.getLogger(__name__)

# The owner of this shard also runs retention: exactly one node at a time.
RETENTION_SHARD = 0

MATERIALISE_BATCH = 5000


def default_node_id() -> str:
    """Return `hostname/pid/random`: unique per process, readable in the lease table."""
    return f"{socket.gethostname()}/{os.getpid()}/{secrets.token_hex(3)}"


@dataclass
class TickReport:
    """What one tick did, for logs and tests."""

    acquired: list[int] = field(default_factory=list)
    lost: list[int] = field(default_factory=list)
    released: list[int] = field(default_factory=list)
    reaped: int = 0
    materialised: int = 0
    inserted: int = 0
    # Fire times an overlap policy left without a run; runs cancel_other cancelled or asked to stop.
    skipped: int = 0
    cancelled: int = 0
    counted: list[str] = field(default_factory=list)  # databases whose census was taken


class Scheduler:
    """One scheduler node. `held` maps each shard this node believes it owns to its epoch."""

    def __init__(
        self,
        *,
        node_id: str | None = None,
        tick_seconds: float | None = None,
        lease_seconds: int | None = None,
        lookahead_seconds: int | None = None,
        shard_count: int | None = None,
        missed_cap: int | None = None,
        reaper_batch: int | None = None,
        batch: int = MATERIALISE_BATCH,
    ) -> None:
        self.node_id = node_id or default_node_id()
        self.tick_seconds = (
            tick_seconds if tick_seconds is not None else settings.SCHEDULER_TICK_SECONDS
        )
        self.lease_seconds = lease_seconds or settings.SCHEDULER_SHARD_LEASE_SECONDS
        self.lookahead = timedelta(
            seconds=lookahead_seconds
            if lookahead_seconds is not None
            else settings.SCHEDULER_LOOKAHEAD_SECONDS
        )
        self.shard_count = shard_count or settings.SCHEDULER_SHARD_COUNT
        self.missed_cap = missed_cap or settings.SCHEDULER_MISSED_RUNS_CAP
        self.reaper_batch = reaper_batch or settings.SCHEDULER_REAPER_BATCH
        self.batch = batch
        self.grace = grace_for(self.tick_seconds, self.lease_seconds)
        self.held: dict[int, int] = {}
        # Shards taken this tick and not yet reaped and materialised: they go first.
        self.fresh: set[int] = set()
        self._down: set[str] = set()  # shard databases found down this tick
        self.shutdown = False
        self.now: datetime | None = None
        self._renewed_at = 0.0  # time.monotonic(): only paces renewals, never judges expiry
        self._wake = threading.Event()
        self._shards_ensured = False
        self._retention_at = float("-inf")
        self._census_due: dict[str, float] = {}  # time.monotonic() of each database's next census
        self.report = TickReport()

    # --- signals -------------------------------------------------------------------------------

    def stop(self, *_: object) -> None:
        """Finish the current step, then release the shards and leave (signal handler)."""
        self.shutdown = True
        self._wake.set()

    # --- steps ---------------------------------------------------------------------------------

    def read_clock(self) -> datetime:
        """Read the database clock once for the tick: all fire-time decisions use it."""
        with connection.cursor() as cursor:
            cursor.execute("SELECT now()")
            self.now = cursor.fetchone()[0]
        return self.now

    def handle_one_lease_round(self) -> bool:
        """Announce this node, renew its leases, then give up extras or take free shards.

        The fair share is ceil(shards / live nodes): a node over it (another node joined)
        releases its highest shards; a node under it takes free or expired shards, which the
        tick then reaps and materialises before the others. Return True when the set of shards
        changed.
        """
        if not self._shards_ensured:
            leases.ensure_shards(self.shard_count)
            self._shards_ensured = True
        live, renewed = leases.announce_and_renew(self.node_id, self.held, self.lease_seconds)
        self._renewed_at = time.monotonic()
        lost = sorted(set(self.held) - set(renewed))
        if lost:
            log.warning("%s lost shards %s (expired or taken over)", self.node_id, lost)
            self.report.lost.extend(lost)
        self.held = renewed
        self.fresh &= set(renewed)
        share = leases.fair_share(self.shard_count, live)
        released: list[int] = []
        acquired: dict[int, int] = {}
        if len(self.held) > share:
            extras = {s: self.held[s] for s in sorted(self.held)[share:]}
            released = leases.release(self.node_id, extras)
            for shard in extras:
                self.held.pop(shard, None)
                self.fresh.discard(shard)
            log.info(
                "%s released shards %s (fair share %d of %d nodes)",
                self.node_id,
                released,
                share,
                live,
            )
            self.report.released.extend(released)
        elif len(self.held) < share:
            acquired = leases.acquire(
                self.node_id, share - len(self.held), self.shard_count, self.lease_seconds
            )
            if acquired:
                self.held.update(acquired)
                self.fresh.update(acquired)
                log.info("%s took shards %s", self.node_id, sorted(acquired))
                self.report.acquired.extend(sorted(acquired))
        return bool(lost or released or acquired)

    def handle_one_renewal(self) -> bool:
        """Renew the leases if a third of the TTL has passed since the last renewal.

        Called between batches, so a long materialisation never outlives its leases.
        Return True when a lease was lost.
        """
        if time.monotonic() - self._renewed_at < self.lease_seconds / 3:
            return False
        renewed = leases.renew(self.node_id, self.held, self.lease_seconds)
        self._renewed_at = time.monotonic()
        lost = sorted(set(self.held) - set(renewed))
        if lost:
            log.warning("%s lost shards %s (expired or taken over)", self.node_id, lost)
            self.report.lost.extend(lost)
        self.held = renewed
        self.fresh &= set(renewed)
        return bool(lost)

    def handle_one_reap(self, shards: list[int] | None = None) -> bool:
        """Reap one batch of expired run leases in these shards (default: all held).

        Return True when the batch was full (call again).
        """
        shards = sorted(self.held) if shards is None else shards
        if not shards:
            return False
        reaped = store.reap(shards=shards, batch=self.reaper_batch)
        self.report.reaped += len(reaped)
        return len(reaped) == self.reaper_batch

    def handle_one_materialise(self, shard: int) -> bool:
        """Materialise one batch of due definitions of this shard, if it is still held.

        The lease and epoch are checked inside the writing transaction, so a node that lost the
        shard while asleep writes nothing; it then forgets the shard. Return True when the batch
        was full (call again).
        """
        epoch = self.held.get(shard)
        if epoch is None:
            return False
        now = self.now or self.read_clock()
        result = materialise_batch(
            shard=shard,
            node=self.node_id,
            epoch=epoch,
            now=now,
            lookahead=self.lookahead,
            grace=self.grace,
            missed_cap=self.missed_cap,
            batch=self.batch,
        )
        if not result.lease_held:
            log.warning(
                "%s no longer holds shard %d (epoch %d); skipping it", self.node_id, shard, epoch
            )
            self.held.pop(shard, None)
            self.fresh.discard(shard)
            self.report.lost.append(shard)
            return False
        self.report.materialised += result.definitions
        self.report.inserted += result.inserted
        self.report.skipped += result.skipped
        self.report.cancelled += result.cancelled
        return result.full

    # --- the loop ------------------------------------------------------------------------------

    def _drain_shard(self, shard: int) -> None:
        # Renewal is checked before every batch: a long backlog spans many shards and batches.
        alias = shards.alias_of_shard(shard)
        if alias in self._down:
            return
        try:
            while not self.shutdown:
                self.handle_one_renewal()
                if not self.handle_one_materialise(shard):
                    break
        except DatabaseError:  # down, or failed at its commit: the others go on
            self._pass_over(alias, "wait for the next tick")

    def _pass_over(self, alias: str, what: str) -> None:
        """In an `except DatabaseError` block: with shards on servers of their own, a database
        that is down, or fails at its commit whatever the error, holds back its own shards only
        (noted for this tick; the others are served all the same, and retention and the audit
        relay after them). The control database's failure (its lease check is part of every
        batch) is raised again, failing the tick as before: the loop starts the next one on a
        fresh connection."""
        if (
            not shards.physical()
            or alias == shards.CONTROL
            or connections[shards.CONTROL].errors_occurred
        ):
            raise  # the exception being handled
        log.warning(
            "%s: shards %s %s: their database failed",
            self.node_id,
            shards.span(alias),
            what,
            exc_info=True,
        )
        self._down.add(alias)
        connections[alias].close()

    def handle_one_retention(self) -> bool:
        """Delete one round of old finished runs and audit events, and finish the job deletes
        their process left, on the owner of shard 0 only.

        One node is enough, and the owner of shard 0 is exactly one node at a time. Return True
        when the round was full (more is waiting).
        """
        if RETENTION_SHARD not in self.held:
            return False
        if services.finish_deletions():
            log.info("finished the deletes of jobs their process left")
        batch = settings.SCHEDULER_RETENTION_BATCH
        return retention.handle_one_round(batch=batch) >= batch

    def _retention_due(self) -> bool:
        now = time.monotonic()
        if now - self._retention_at < settings.SCHEDULER_RETENTION_INTERVAL_SECONDS:
            return False
        self._retention_at = now
        return True

    def handle_one_census(self) -> None:
        """Take the census (apps/runs/census.py) of each shard database whose first shard this
        node holds, when it is due: one node per database, and different nodes count
        different databases."""
        for alias in shards.databases():
            if (
                min(shards.shards_on(alias)) not in self.held
                or alias in self._down
                or time.monotonic() < self._census_due.get(alias, float("-inf"))
            ):
                continue
            try:
                with shards.using(alias):
                    seconds = census.take()
            except DatabaseError as exc:
                if shards.down(exc):
                    self._pass_over(alias, "are not counted")
                    continue
                # Not migrated yet (a deploy under way), or its commit refused, say: the pages
                # count live meanwhile, and the tick's other work never waits on a census.
                log.warning(
                    "%s: no census of shards %s", self.node_id, shards.span(alias), exc_info=True
                )
                self._census_due[alias] = time.monotonic() + census.period(0)
                continue
            self._census_due[alias] = time.monotonic() + census.period(seconds)
            self.report.counted.append(alias)

    def tick(self) -> TickReport:
        """Run one tick: clock, leases, then reap and materialise (new shards first)."""
        self.report = TickReport()
        self._down = set()
        shards.refresh()  # a shard moved by `manage.py moveshard` is materialised where it went
        self.read_clock()
        self.handle_one_lease_round()
        if self.fresh:
            fresh = sorted(self.fresh)
            while self.handle_one_reap(fresh) and not self.shutdown:
                pass
            for shard in fresh:
                self._drain_shard(shard)
                self.fresh.discard(shard)
        while self.handle_one_reap() and not self.shutdown:
            self.handle_one_renewal()
        for shard in sorted(self.held):
            if self.shutdown:
                break
            self._drain_shard(shard)
        if self._retention_due():
            # A few rounds per tick at most: the backlog of a first run must not stall the tick.
            for _ in range(10):
                if self.shutdown or not self.handle_one_retention():
                    break
        if not self.shutdown:
            self.handle_one_census()
        return self.report

    def leave(self) -> None:
        """Release every shard of this node and remove it from the live nodes."""
        leases.leave(self.node_id)
        self.held.clear()
        self.fresh.clear()
        log.info("%s released its shards and left", self.node_id)

    def look_before_taking(self) -> None:
        """Look for events once before the first lease round. The notifier runs inside the
        schedulers: after every one was down, the first to start would otherwise take the
        shards before its notifier looked, and the teams would never hear that their shards
        had no scheduler (`scheduler.shard_unowned`); they hear it now, and its recovery next."""
        try:
            notifier.Notifier().handle_one_detection(force=True)
        except Exception:  # never keeps the scheduler from starting
            log.exception("%s: the look for events before starting failed", self.node_id)
            connection.close()

    def run(self, *, once: bool = False) -> None:
        """Tick until `shutdown` (or once), then release the shards."""
        log.info(
            "scheduler %s starting (tick %.2fs, lease TTL %ds)",
            self.node_id,
            self.tick_seconds,
            self.lease_seconds,
        )
        # Notifications (apps/notify/loop.py) in a thread of their own: a slow webhook never
        # delays the renewal of this node's shard leases.
        if not once:
            self.look_before_taking()
        notifying = None if once else notifier.start(f"notifier {self.node_id}")
        try:
            while not self.shutdown:
                started = time.monotonic()
                try:
                    report = self.tick()
                    if report.inserted or report.reaped:
                        log.info(
                            "%s: %d definitions, %d runs inserted, %d leases reaped, shards %s",
                            self.node_id,
                            report.materialised,
                            report.inserted,
                            report.reaped,
                            sorted(self.held),
                        )
                except Exception:
                    # A lost database or a bug in one tick must not end the process: the next
                    # tick starts on a fresh connection. Bad rows are dealt with in the materialiser.
                    log.exception("%s: tick failed; retrying next tick", self.node_id)
                    connection.close()
                if self.shutdown or once:
                    break
                close_old_connections()
                self._wake.wait(max(0.0, self.tick_seconds - (time.monotonic() - started)))
        finally:
            if notifying is not None:
                notifying[1].set()  # it finishes the message on the wire, if any, then stops
            try:
                self.leave()
            except Exception:
                log.exception(
                    "%s: could not release its shards; they expire in %ds",
                    self.node_id,
                    self.lease_seconds,
                )
            connection.close()
            if notifying is not None:
                notifying[0].join(settings.SCHEDULER_NOTIFY_TIMEOUT_SECONDS + 5)
