"""`pg_terminate_backend` on the API server's and a scheduler's connections, in the middle of a
claim, a heartbeat, a completion, a long poll and a materialisation.

Each statement to be cut is first made to wait for a lock that the test holds in an open
transaction, so the backend is terminated exactly while it is inside that statement (found in
pg_stat_activity by application_name, waiting on the lock). The killed transaction rolls back;
the client gets a retryable answer, sends again, and the retry creates no second attempt or run.
The same processes keep serving: nothing is restarted. Last, `pg_cancel_backend` (what a
statement or lock timeout does) on the scheduler's insert: no fire time may be skipped for it.

Both layouts. The locks are held, and the backends cut, on the database of the job's shard.
What the client is told differs where a request spans databases: on one database a cut claim
or batch of results is a 503 problem that the SDK's transport sends again; with shards on
servers of their own, the claim passes that database over (200, no leases from it) and a
result is answered 503 in its item (which the SDK's worker sends again).
"""

from __future__ import annotations

import http.client
import json
import threading
import time
from datetime import timedelta
from typing import Any

import pytest
from cronlease_client.transport import Transport

from apps.runs import shards, store
from apps.runs.ids import public_run_id
from tests.conftest import db_now
from tests.faults.conftest import WEB
from tests.faults.helpers import (
    Proc,
    attempts_of,
    free_port,
    runs,
    uvicorn_argv,
    wait_for,
    wait_http_ok,
)

pytestmark = [
    pytest.mark.slow,
    pytest.mark.shards,
    pytest.mark.django_db(transaction=True, databases="__all__"),
]

LISTENER = "scheduler:listener"  # the API server's LISTEN connection (apps.runs.waiting)
MINUTELY = {"cron": "* * * * *", "jitterSeconds": 0, "missedRunPolicy": "run_all"}


class Recorder(Transport):
    """The SDK's transport, remembering the status of every answer (None: no answer)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.statuses: list[int | None] = []

    def _send(self, *args: Any) -> Any:
        try:
            exchange = super()._send(*args)
        except (OSError, http.client.HTTPException):
            self.statuses.append(None)
            raise
        self.statuses.append(exchange[0])
        return exchange


class Call:
    """One SDK call (Transport.post, with its retries) on a thread of its own."""

    def __init__(self, url: str, token: str, path: str, body: dict[str, Any]) -> None:
        self.transport = self.recorder = Recorder(url, token, attempts=10)
        self.answer: Any = None
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(path, body), daemon=True)
        self._thread.start()

    def _run(self, path: str, body: dict[str, Any]) -> None:
        try:
            self.answer = self.transport.post(path, body)
        except BaseException as exc:  # noqa: BLE001 - re-raised by result()
            self.error = exc
        finally:
            self.transport.close()

    @property
    def done(self) -> bool:
        return not self._thread.is_alive()

    def result(self, timeout: float = 20) -> Any:
        self._thread.join(timeout)
        assert not self._thread.is_alive(), f"no answer yet; statuses {self.recorder.statuses}"
        if self.error is not None:
            raise self.error
        return self.answer


def cut_while_waiting(h, on: str, lock_sql: str, params: list[Any], path: str, body: dict) -> Call:
    """Hold `lock_sql`'s locks on the database at `on`, send the call, terminate the API
    backend that waits for them there, let the client see its first answer, then release the
    locks so that whatever is sent again goes through."""
    with h.db.holding(lock_sql, params, url=on):
        with h.db.terminating_first_waiter(WEB, url=on):
            call = Call(h.services.api_url, h.token, path, body)
        wait_for(lambda: call.recorder.statuses, 15, "the first answer")
    call.result()
    return call


def sent_again(h, path: str, body: dict) -> Any:
    """What the client is answered when it sends the same request again."""
    return Call(h.services.api_url, h.token, path, body).result()


def cron_run_row(definition_id: int, due) -> dict[str, Any]:
    """INSERT_RUNS parameters for one cron run of this definition at `due`; inserted by a test
    in a transaction it keeps open, it makes the scheduler's insert of that time wait."""
    row = {
        "definition_id": definition_id,
        "trigger": "cron",
        "due_at": due.isoformat(),
        "available_at": due.isoformat(),
        "idempotency_key": "faults-blocker",
        "own": False,
        "payload": None,
        "payload_key": "",
    }
    return {"rows": json.dumps([row]), "definition_ids": [definition_id]}


def waiting_statement(db, application_name: str) -> tuple[int, Any] | None:
    """(pid, query start) of the statement of that application waiting for a lock, if any."""
    return db.one(
        "SELECT pid, query_start FROM pg_stat_activity WHERE datname = current_database()"
        " AND application_name = %s AND wait_event_type = 'Lock'",
        [application_name],
    )


def test_terminated_connections_give_retryable_errors_and_retries_duplicate_nothing(harness):
    h = harness
    api_pid = h.services.api.pid
    # A limited definition: the claim takes its claim lock, which the test can hold.
    definition = h.definition("faults.work", "cut", concurrency=5, retry_max_attempts=3)
    ids = h.add_runs(definition, [{}] * 3)
    home = h.database_of(definition)
    physical = shards.physical()

    # The scheduler's first materialisation of this minutely job will wait on an uncommitted
    # run of the same cron time, inserted by the test with the product's own statement.
    due = db_now().replace(second=0, microsecond=0) + timedelta(minutes=1)
    cron = h.definition("faults.control", "cut-cron", schedule=MINUTELY, next_due_at=due)
    with h.db.holding(store.INSERT_RUNS, cron_run_row(cron.pk, due), url=h.database_of(cron)):
        node = h.scheduler("cut-node")

        # Claim: terminated while waiting for the definition's lock (candidates already locked).
        lease_call = {"queues": ["cut"], "max": 3, "workerId": "cut-worker", "leaseSeconds": 60}
        claim = cut_while_waiting(
            h,
            home,
            "SELECT pg_advisory_xact_lock(%s, %s)",
            list(store.claim_lock_key(definition.pk)),
            "/api/v1/leases",
            lease_call,
        )
        if physical:
            # The database is passed over: nothing leased from it, and nothing lost.
            assert claim.recorder.statuses == [200] and claim.answer["leases"] == []
            assert all(attempts_of(h.db, pk) == [] for pk in ids)
            leases = sent_again(h, "/api/v1/leases", lease_call)["leases"]
        else:
            assert claim.recorder.statuses == [503, 200], claim.recorder.statuses
            leases = claim.answer["leases"]
        assert sorted(lease["runId"] for lease in leases) == sorted(map(public_run_id, ids))
        for lease in leases:
            assert lease["attempt"] == 1
        for pk in ids:
            assert [a[:3] for a in attempts_of(h.db, pk)] == [
                (1, runs(h.db, [pk])[pk]["fencing_token"], "cut-worker")
            ]
        first, second = leases[0], leases[1]
        first_pk = ids[[public_run_id(pk) for pk in ids].index(first["runId"])]

        # Heartbeat: terminated while waiting for the run's row lock.
        expires_before = h.db.scalar(
            "SELECT lease_expires_at FROM runs_run WHERE id = %s", [first_pk]
        )
        beat = cut_while_waiting(
            h,
            home,
            "SELECT 1 FROM runs_run WHERE id = %s FOR UPDATE",
            [first_pk],
            f"/api/v1/runs/{first['runId']}/heartbeat",
            {"fencingToken": first["fencingToken"]},
        )
        assert beat.recorder.statuses == [503, 200], beat.recorder.statuses
        assert (
            h.db.scalar("SELECT lease_expires_at FROM runs_run WHERE id = %s", [first_pk])
            > expires_before
        )
        assert runs(h.db, [first_pk])[first_pk]["attempt"] == 1

        # Complete, through the batch endpoint the SDK uses: terminated inside the UPDATE.
        result = {
            "runId": first["runId"],
            "fencingToken": first["fencingToken"],
            "outcome": "succeeded",
            "result": {"cut": True},
        }
        report = cut_while_waiting(
            h,
            home,
            "SELECT 1 FROM runs_run WHERE id = %s FOR UPDATE",
            [first_pk],
            "/api/v1/results",
            {"results": [result]},
        )
        if physical:
            assert report.recorder.statuses == [200]
            (refused,) = report.answer["results"]
            assert refused["status"] == 503 and "unavailable" in refused["detail"], refused
            assert runs(h.db, [first_pk])[first_pk]["state"] == "leased"
            (done,) = sent_again(h, "/api/v1/results", {"results": [result]})["results"]
            assert done["status"] == 200, done
        else:
            assert report.recorder.statuses == [503, 200], report.recorder.statuses
        done = runs(h.db, [first_pk])[first_pk]
        assert (done["state"], done["result"]) == ("succeeded", {"cut": True})
        assert [a[3] for a in attempts_of(h.db, first_pk)] == ["succeeded"]

        # Long poll: every connection of the API server is cut, its LISTEN connection too;
        # a worker's long poll still wakes up for a run that becomes ready.
        h.db.terminate(h.db.backends(WEB) + h.db.backends(LISTENER))
        poll = Call(
            h.services.api_url,
            h.token,
            "/api/v1/leases",
            {"queues": ["cut-poll"], "max": 1, "workerId": "poller", "waitSeconds": 20},
        )
        polled = h.definition("faults.spent", "cut-poll")
        time.sleep(0.5)  # the poll is waiting by now (it returns a lease either way)
        sent = time.monotonic()
        (new_run,) = h.add_runs(polled, [{}], prefix="poll")
        (lease,) = poll.result(25)["leases"]
        assert lease["runId"] == public_run_id(new_run)
        # Woken by the NOTIFY through the re-made LISTEN connection, not by its 2 s alarm.
        # Without a stall on the pool's dead connections either (scheduler_site/postgresql:
        # it was 2.4 s on one database and 8.7 s with shards on servers of their own).
        assert time.monotonic() - sent < 1
        wait_for(lambda: h.db.backends(LISTENER), 10, "the LISTEN connection to come back")

        # Materialise: the scheduler's INSERT has been waiting for the test's conflicting row.
        scheduler_app = f"faults:sched:{node.name}"
        (pid,) = wait_for(
            lambda: h.db.backends(scheduler_app, waiting_on_lock=True),
            30,
            "the scheduler's insert to wait",
        )
        h.db.terminate([pid])

    # The killed transaction inserted nothing and did not move next_due_at; the next tick,
    # on a new connection in the same process, materialises the cron time exactly once.
    def materialised() -> bool:
        return bool(
            h.db.scalar(
                "SELECT count(*) FROM runs_run WHERE definition_id = %s AND due_at = %s",
                [cron.pk, due],
            )
        ) and h.db.scalar(
            "SELECT next_due_at > %s FROM jobs_jobdefinition WHERE id = %s", [due, cron.pk]
        )

    wait_for(materialised, 20, "the cron time to be materialised")
    # One run for that time (a `catch_up` one if the minute had long begun by then).
    assert h.db.rows(
        "SELECT due_at, count(*) FROM runs_run WHERE definition_id = %s GROUP BY 1 ORDER BY 1",
        [cron.pk],
    )[0] == (due, 1)
    # The scheduler met the cut: its tick, or the shard database's part of it, failed and was
    # retried.
    assert (
        "tick failed; retrying next tick" in node.output()
        or "wait for the next tick: their database failed" in node.output()
    )
    assert node.alive()

    # Materialise, cancelled rather than terminated (what a statement or lock timeout does
    # too): the waiting INSERT is cancelled twice (the batch's insert, then whatever the
    # materialiser tries next), then the row is released. Nothing is wrong with the rows, so
    # no fire time may be skipped: the cron time is inserted once, next_due_at moves on by
    # the schedule.
    later = h.definition("faults.poison", "cut-cron-2", schedule=MINUTELY)
    due = db_now().replace(second=0, microsecond=0) + timedelta(minutes=1)

    def cancel_the_waiting_insert() -> None:
        waiting = wait_for(
            lambda: waiting_statement(h.db, scheduler_app), 30, "the scheduler's insert to wait"
        )
        h.db.rows(
            "SELECT pg_cancel_backend(pid) FROM pg_stat_activity WHERE pid = %s", [waiting[0]]
        )
        wait_for(lambda: waiting_statement(h.db, scheduler_app) != waiting, 10, "the cancel")

    with h.db.holding(store.INSERT_RUNS, cron_run_row(later.pk, due), url=h.database_of(later)):
        # Due only now, with the blocking row in place: the running scheduler cannot get there first.
        later.next_due_at = due
        later.save()
        cancel_the_waiting_insert()
        cancel_the_waiting_insert()

    def settled() -> tuple | None:
        count = h.db.scalar(
            "SELECT count(*) FROM runs_run WHERE definition_id = %s AND due_at = %s",
            [later.pk, due],
        )
        next_due = h.db.scalar(
            "SELECT next_due_at FROM jobs_jobdefinition WHERE id = %s", [later.pk]
        )
        return (count, next_due) if count or next_due > due + timedelta(minutes=5) else None

    count, next_due = wait_for(settled, 20, "the cancelled cron time to be materialised")
    assert next_due <= due + timedelta(minutes=2), f"next_due_at jumped to {next_due}"
    assert count == 1
    assert node.alive()

    # Nothing restarted; both still serve.
    assert h.services.api.pid == api_pid and h.services.api.alive()
    with h.http() as http:
        assert http.get("/readyz").status_code == 200
        assert (
            http.post(
                f"/api/v1/runs/{second['runId']}/complete",
                json={"fencingToken": second["fencingToken"]},
            ).status_code
            == 200
        )
    assert (
        h.db.scalar("SELECT count(*) FROM runs_run WHERE definition_id = %s", [definition.pk]) == 3
    )
    h.check()


SMALL_POOL = "faults:web-pool-of-two"


def test_long_polls_hold_no_pooled_connection_while_they_wait(harness):
    """An API server with a pool of two connections: six long polls wait at once, and a lease
    call for another queue is still served (by the pool) before any of them ends."""
    h = harness
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    small = Proc(
        "web-pool-of-two",
        uvicorn_argv(port),
        h.services.env(SCHEDULER_APPLICATION_NAME=SMALL_POOL, SCHEDULER_DB_POOL_SIZE="2"),
        h.tmp,
    )
    try:
        wait_http_ok(f"{url}/readyz", small)
        definition = h.definition("faults.work", "pool-busy")
        # A queue with a definition (and no runs): only such queues record lease activity.
        h.definition("faults.idle", "pool-idle")
        (pk,) = h.add_runs(definition, [{}])
        body = {"max": 1, "leaseSeconds": 60, "waitSeconds": 5}
        polls = [
            Call(
                url,
                h.token,
                "/api/v1/leases",
                {**body, "queues": ["pool-idle"], "workerId": f"p{i}"},
            )
            for i in range(6)
        ]
        # The server notes the queue's first lease activity as a poll comes in.
        wait_for(
            lambda: h.db.scalar("SELECT count(*) FROM jobs_queue WHERE name = 'pool-idle'"),
            15,
            "the long polls to reach the server",
        )
        time.sleep(0.5)  # the other five, sent at the same moment
        with h.http(url=url) as http:
            answer = http.post(
                "/api/v1/leases", json={**body, "queues": ["pool-busy"], "workerId": "busy"}
            )
            assert not any(poll.done for poll in polls), "a long poll ended early"
            assert answer.status_code == 200, answer.text
            assert [lease["runId"] for lease in answer.json()["leases"]] == [public_run_id(pk)]
            # Its connections: the pool's two on each database (the LISTEN connection is
            # named apart).
            for conn in h.db.conns:
                assert (
                    conn.execute(
                        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
                        " AND application_name = %s",
                        [SMALL_POOL],
                    ).fetchone()[0]
                    <= 2
                )
        for poll in polls:
            assert poll.result()["leases"] == []
    finally:
        small.stop()
    h.check()
