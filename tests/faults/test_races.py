"""Races with the reaper, made deterministic: one side's transaction is held open (its row lock
held) on a connection of its own while the other side runs; a side that must wait is seen
waiting for that lock in pg_stat_activity before the first one commits.

The shared reaper is frozen meanwhile (while its connection is idle), so the only reaper in
each race is the test's own call of `store.reap`. Both layouts: with shards on servers of their
own, the held transaction is on the database of the job's shard, where its runs are.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any

import pytest
from django.db import connections, transaction

from apps.audit.record import Actor
from apps.runs import shards, store, transitions
from apps.runs.ids import public_run_id
from apps.runs.models import Run
from tests.conftest import claim, expire_lease
from tests.faults.conftest import WEB
from tests.faults.helpers import all_in, attempts_of, runs, wait_for

pytestmark = [
    pytest.mark.slow,
    pytest.mark.shards,
    pytest.mark.django_db(transaction=True, databases="__all__"),
]


class TransactionThread:
    """One transaction on a thread (and connection) of its own, driven step by step: `run(f)`
    calls f inside it and returns f's value; the transaction, and every lock it took, stays open
    until `commit()`. Leaving the `with` block without committing rolls it back."""

    _COMMIT = object()
    _ROLLBACK = object()

    def __init__(self, alias: str) -> None:
        self.alias = alias  # the database it holds its transaction on
        self._calls: queue.Queue[Any] = queue.Queue()
        self._answers: queue.Queue[tuple[bool, Any]] = queue.Queue()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def __enter__(self) -> TransactionThread:
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self._thread.is_alive():
            self._calls.put(self._ROLLBACK)
            self._thread.join(15)

    def _serve(self) -> None:
        try:
            with shards.using(self.alias), transaction.atomic(using=self.alias):
                while (call := self._calls.get(timeout=60)) is not self._COMMIT:
                    if call is self._ROLLBACK:
                        raise RuntimeError("rolled back")
                    try:
                        self._answers.put((True, call()))
                    except BaseException as exc:
                        self._answers.put((False, exc))
                        raise
        except BaseException:  # noqa: BLE001 - handed to run()'s caller, or a rollback
            pass
        finally:
            connections.close_all()  # this thread's, on every database it reached

    def run(self, call: Callable[[], Any], timeout: float = 15) -> Any:
        self._calls.put(call)
        ok, value = self._answers.get(timeout=timeout)
        if not ok:
            raise value
        return value

    def commit(self) -> None:
        self._calls.put(self._COMMIT)
        self._thread.join(15)
        assert not self._thread.is_alive()


class InBackground:
    """Call `action` on a thread of its own; `result()` waits for it."""

    def __init__(self, action: Callable[[], Any]) -> None:
        self.value: Any = None
        self.error: BaseException | None = None

        def run() -> None:
            try:
                self.value = action()
            except BaseException as exc:  # noqa: BLE001 - re-raised by result()
                self.error = exc

        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()

    def result(self, timeout: float = 15) -> Any:
        self._thread.join(timeout)
        assert not self._thread.is_alive(), "still running"
        if self.error is not None:
            raise self.error
        return self.value


def leases(queue: str, count: int) -> list[store.Lease]:
    """Lease `count` runs of `queue` as worker `racer`, for a minute."""
    found = claim(queues=[queue], max_runs=count, worker_id="racer", lease_seconds=60)
    assert len(found) == count
    return found


def expired_ids() -> list[int]:
    """The reaper's read, on its own: the leases that have expired (on the current database)."""
    with shards.cursor() as cursor:
        cursor.execute(
            "SELECT id FROM runs_run WHERE state = 'leased' AND lease_expires_at <= now()"
        )
        return [row[0] for row in cursor.fetchall()]


def test_a_completion_racing_the_reaper_stays_succeeded(harness):
    h = harness
    definition = h.definition("faults.work", "race", retry_max_attempts=3)
    h.add_runs(definition, [{}] * 3)
    team = [h.team.pk]
    alias = shards.alias_of_shard(definition.shard)
    with h.services.reaper_paused(), shards.using(alias):
        held_row, read_first, reaped_first = leases("race", 3)

        # 1. The completion has updated the row but not committed when the reaper runs: the
        #    reaper skips the locked row (SKIP LOCKED) instead of waiting or overwriting it.
        expire_lease(held_row.id)
        with TransactionThread(alias) as completion:
            done = completion.run(
                lambda: store.complete(
                    [(held_row.id, held_row.fencing_token, {"by": "worker"})], team_ids=team
                )
            )
            assert done[0].status == 200
            assert store.reap() == []
            completion.commit()
        assert store.reap() == []

        # 2. The reaper reads the expired lease; the completion commits; then the reaper writes,
        #    in the same transaction. Its UPDATE re-checks state and expiry: it changes nothing.
        expire_lease(read_first.id)
        with TransactionThread(alias) as reaper:
            assert reaper.run(expired_ids) == [read_first.id]
            done = store.complete([(read_first.id, read_first.fencing_token, None)], team_ids=team)
            assert done[0].status == 200
            assert reaper.run(store.reap) == []
            reaper.commit()

        # 3. The other order: the reaper's UPDATE holds the row, uncommitted, when the worker's
        #    completion arrives (over HTTP). The completion waits for the lock, then finds the
        #    run no longer leased: 409, and the reaper's outcome stands.
        expire_lease(reaped_first.id)
        with TransactionThread(alias) as reaper, h.http() as http:
            assert [reaped.id for reaped in reaper.run(store.reap)] == [reaped_first.id]
            call = InBackground(
                lambda: http.post(
                    f"/api/v1/runs/{public_run_id(reaped_first.id)}/complete",
                    json={"fencingToken": reaped_first.fencing_token, "result": {}},
                )
            )
            wait_for(lambda: h.db.backends(WEB, waiting_on_lock=True), 15, "the completion to wait")
            reaper.commit()
            assert call.result().status_code == 409

    found = runs(h.db, [held_row.id, read_first.id, reaped_first.id])
    assert found[held_row.id]["state"] == found[read_first.id]["state"] == "succeeded"
    assert found[held_row.id]["result"] == {"by": "worker"}
    for lease in (held_row, read_first):
        assert attempts_of(h.db, lease.id) == [(1, lease.fencing_token, "racer", "succeeded", "")]
    assert found[reaped_first.id]["state"] == "retrying"
    assert attempts_of(h.db, reaped_first.id)[0] == (
        1,
        reaped_first.fencing_token,
        "racer",
        "lease_expired",
        "lease_expired",
    )
    h.check()


def test_a_cancel_racing_the_reaper_ends_cancelled_and_never_runs_again(harness):
    h = harness
    definition = h.definition("faults.work", "cancel", retry_max_attempts=3)
    h.add_runs(definition, [{}] * 2)
    team = [h.team.pk]
    alias = shards.alias_of_shard(definition.shard)
    with h.services.reaper_paused(), h.http() as http, shards.using(alias):
        during, before = leases("cancel", 2)

        def cancel(lease: store.Lease):
            return http.post(f"/api/v1/runs/{public_run_id(lease.id)}/cancel")

        # 1. The cancel arrives while the reaper's UPDATE (leased -> retrying) is not committed.
        #    The cancel's snapshot still shows a leased run, which a cancel asks to stop: its
        #    UPDATE waits for the reaper's row, then reads the run as the reaper left it
        #    (retrying) and cancels it at once; it is not told to a worker that no longer has it.
        expire_lease(during.id)
        with TransactionThread(alias) as reaper:
            assert [reaped.id for reaped in reaper.run(store.reap)] == [during.id]
            waiting = InBackground(lambda: cancel(during))
            wait_for(lambda: h.db.backends(WEB, waiting_on_lock=True), 15, "the cancel to wait")
            reaper.commit()
        accepted = waiting.result()
        assert accepted.status_code == 200, accepted.text
        assert accepted.json()["state"] == "cancelled"
        assert accepted.json()["cancelRequested"] is False
        assert runs(h.db, [during.id])[during.id]["state"] == "cancelled"

        # 2. The cancel holds the (now retrying) row, uncommitted, when a worker claims: the
        #    claim skips the locked row instead of leasing it; after the commit it is cancelled.
        expire_lease(before.id)
        assert [reaped.id for reaped in store.reap()] == [before.id]
        with TransactionThread(alias) as canceller:
            run = Run.objects.get(pk=before.id)
            assert canceller.run(lambda: transitions.cancel([run], Actor.system())) == [run]
            assert claim(queues=["cancel"], max_runs=5, worker_id="w", lease_seconds=60) == []
            canceller.commit()
        assert runs(h.db, [before.id])[before.id]["state"] == "cancelled"

        # The holder of each expired lease is refused whatever it says, and changes nothing.
        for lease in (during, before):
            run_id = public_run_id(lease.id)
            for call_name, body in [
                ("heartbeat", {}),
                ("complete", {"result": {}}),
                ("fail", {"error": {"message": "late"}, "retryable": True}),
            ]:
                late = http.post(
                    f"/api/v1/runs/{run_id}/{call_name}",
                    json={"fencingToken": lease.fencing_token, **body},
                )
                assert late.status_code == 409, (call_name, late.text)
        assert (
            store.complete([(during.id, during.fencing_token, None)], team_ids=team)[0].status
            == 409
        )

    # Never runs again: a worker drains the queue, including a run added after the cancels
    # (and due later than them, so the cancelled ones would have been leased first).
    (control,) = h.add_runs(definition, [{"seconds": 0.1}], prefix="control")
    h.worker("after-cancel", "cancel")
    wait_for(lambda: all_in(h.db, [control], "succeeded"), 30, "the control run")
    for lease in (during, before):
        found = runs(h.db, [lease.id])[lease.id]
        assert (found["state"], found["attempt"]) == ("cancelled", 1)
        assert attempts_of(h.db, lease.id) == [
            (1, lease.fencing_token, "racer", "lease_expired", "lease_expired")
        ]
    h.check()
