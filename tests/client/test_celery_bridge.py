"""The Celery bridge end to end: the live server, PostgreSQL, Redis, and as real processes a
Celery worker running examples.celery_worker and `python -m cronlease_client bridge`."""

from __future__ import annotations

import os
import re
import signal
import socket
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import closing, contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import cronlease_client
import httpx
import pytest

from apps.runs import store
from apps.runs.ids import public_run_id
from apps.runs.models import Attempt, Run, Worker
from apps.runs.store import NewRun, insert_runs
from tests.client.conftest import runs_when, wait_for
from tests.conftest import (
    add_ready_runs,
    db_now,
    expire_lease,
    flushed_redis,
    make_definition,
    redis_test_url,
    unavailable,
)

ROOT = Path(__file__).resolve().parents[2]
CLIENT_DIR = Path(cronlease_client.__file__).resolve().parents[1]
# A database of its own, flushed by every test: nothing else on this Redis is touched.
BROKER_URL = os.environ.get("CELERY_BRIDGE_TEST_BROKER") or redis_test_url(1)
CELERY_QUEUE = "celery"  # the example app's default queue

pytestmark = pytest.mark.slow
# The tests with processes: they see the test's rows only once committed.
e2e = pytest.mark.django_db(transaction=True)


@pytest.fixture
def celery_installed() -> None:
    try:
        import celery  # noqa: F401
        import redis  # noqa: F401
    except ImportError as exc:
        unavailable(f"the Celery bridge needs Celery: pip install -e './client[celery]' ({exc})")


@pytest.fixture
def broker(celery_installed) -> Iterator[Any]:
    """A flushed Redis database for the broker; the redis client, to look inside it."""
    with flushed_redis(BROKER_URL) as client:
        yield client


@dataclass
class Process:
    popen: subprocess.Popen
    log: Path

    def output(self) -> str:
        return self.log.read_text()

    def send_signal(self, signum: int) -> None:
        self.popen.send_signal(signum)

    def kill(self) -> None:
        self.popen.kill()
        self.popen.wait(timeout=10)

    def wait(self, timeout: float) -> int:
        return self.popen.wait(timeout=timeout)


@pytest.fixture
def ledger(tmp_path: Path) -> Path:
    return tmp_path / "celery_example.sqlite3"


@pytest.fixture
def spawn(
    live_server, broker, ledger, token_a, worker_token_a, tmp_path
) -> Iterator[dict[str, Callable[..., Process]]]:
    """Start Celery workers and bridges; every one is killed at teardown, its log printed."""
    processes: list[tuple[str, Process]] = []
    env = {
        # Without DJANGO_SETTINGS_MODULE (pytest-django's): Celery's Django fix-up would set up
        # this project's Django in the worker and the bridge, which are not Django programs.
        **{k: v for k, v in os.environ.items() if k != "DJANGO_SETTINGS_MODULE"},
        "PYTHONPATH": os.pathsep.join([str(ROOT), str(CLIENT_DIR)]),
        "CELERY_BROKER_URL": BROKER_URL,
        "CELERY_EXAMPLE_DB": str(ledger),
        # The Celery workers report with a worker-scope token, as in production.
        "CRONLEASE_URL": live_server.url,
        "CRONLEASE_TOKEN": worker_token_a,
    }

    def start(name: str, command: list[str], broker_url: str | None = None) -> Process:
        log = tmp_path / f"{name}.log"
        with log.open("w") as out:
            popen = subprocess.Popen(
                command,
                cwd=ROOT,
                env={**env, "CELERY_BROKER_URL": broker_url or BROKER_URL},
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        process = Process(popen, log)
        processes.append((name, process))
        return process

    def celery_worker(
        name: str = "w1", heartbeat: bool = False, broker_url: str | None = None
    ) -> Process:
        # Celery's worker heartbeats are off unless a test is about them: less broker traffic.
        beats = ["--heartbeat-interval=1"] if heartbeat else ["--without-heartbeat"]
        return start(
            f"celery-{name}",
            [
                sys.executable,
                "-m",
                "celery",
                "-A",
                "examples.celery_worker.app",
                "worker",
                # Threads, not solo: the solo pool blocks Celery's event loop while a task runs,
                # which delays the acknowledgement until the task returns.
                "--pool=threads",
                "--concurrency=1",
                "--loglevel=INFO",
                "--without-gossip",
                "--without-mingle",
                *beats,
                "-n",
                f"{name}@%h",
            ],
            broker_url,
        )

    def bridge(
        queue: str,
        *options: str,
        tasks: str = "examples.celery_worker.app",
        broker_url: str | None = None,
    ) -> Process:
        # The bridge's token also has the manage scope, for its check of the queue's jobs.
        return start(
            f"bridge-{len(processes)}",
            [
                sys.executable,
                "-m",
                "cronlease_client",
                "bridge",
                tasks,
                "--queue",
                queue,
                "--url",
                live_server.url,
                "--token",
                token_a,
                "--wait-seconds",
                "1",
                "--log-level",
                "DEBUG",
                *options,
            ],
            broker_url,
        )

    yield {"celery_worker": celery_worker, "bridge": bridge}
    for name, process in processes:
        if process.popen.poll() is None:
            process.popen.kill()
        process.popen.wait(timeout=10)
        # Shown by pytest only when the test failed.
        print(f"--- {name} (exit {process.popen.returncode})\n{process.output()}")


def read_calls(ledger: Path) -> list[tuple[str, int, str, int]]:
    """What the example tasks' functions were called with: (run id, attempt, key, token)."""
    if not ledger.exists():
        return []
    with closing(sqlite3.connect(ledger)) as db:
        try:
            rows = db.execute(
                "SELECT run_id, attempt, idempotency_key, fencing_token FROM calls ORDER BY id"
            ).fetchall()
        except sqlite3.OperationalError:
            return []
    return [tuple(row) for row in rows]


def add_cron_run(definition) -> int:
    """A run as the materialiser inserts it for a cron slot that has just come due."""
    due = (db_now() - timedelta(seconds=1)).replace(microsecond=0)
    (pk,) = insert_runs(
        [NewRun(definition.pk, "cron", due, due, f"{definition.name}@{due.isoformat()}")]
    )
    return pk


def received(process: Process, task: str) -> list[str]:
    """The Celery task ids a worker received for `task`, from its log."""
    return re.findall(
        rf"Task examples\.celery_worker\.tasks\.{task}\[([^\]]+)\] received", process.output()
    )


def attempts(pk: int) -> list[tuple[int, str, int]]:
    return [
        (a.number, a.outcome, a.fencing_token)
        for a in Attempt.objects.filter(run_id=pk).order_by("number")
    ]


def dawdling_runs(team, queue: str, count: int) -> list[int]:
    """Ready runs whose tasks take a minute (long enough to kill their worker), retried at once."""
    definition = make_definition(
        team,
        "billing.send-invoice",
        queue=queue,
        payload={"workSeconds": 60},
        retry_base_seconds=0,
    )
    return add_ready_runs(definition, count)


@e2e
def test_a_scheduled_run_executes_on_a_celery_worker_and_succeeds(team_a, spawn, ledger, broker):
    definition = make_definition(team_a, "billing.send-invoice", queue="celery-ok")
    pk = add_cron_run(definition)
    worker = spawn["celery_worker"]()
    spawn["bridge"]("celery-ok")

    (run,) = wait_for(runs_when([pk], "succeeded"), timeout=30, what="the run to succeed")

    run_id = public_run_id(pk)
    assert run.idempotency_key.startswith("billing.send-invoice@")
    # The task saw the lease's key and token, and completed the run with that token.
    assert read_calls(ledger) == [(run_id, 1, run.idempotency_key, run.fencing_token)]
    assert run.result == {"sent": True, "invoice": run.idempotency_key}
    assert attempts(pk) == [(1, "succeeded", run.fencing_token)]
    assert received(worker, "send_invoice") == [f"cronlease-{run_id}-{run.fencing_token}"]


@e2e
def test_a_raising_task_is_retried_by_the_scheduler_and_ends_in_the_dlq(
    team_a, spawn, ledger, broker
):
    definition = make_definition(
        team_a,
        "reports.flaky-upstream",
        queue="celery-flaky",
        retry_max_attempts=3,
        retry_base_seconds=0,
    )
    (pk,) = add_ready_runs(definition, 1)
    worker = spawn["celery_worker"]()
    spawn["bridge"]("celery-flaky")

    (run,) = wait_for(runs_when([pk], "dead"), timeout=30, what="the run to reach the DLQ")

    history = attempts(pk)
    assert [(number, outcome) for number, outcome, _ in history] == [
        (1, "failed"),
        (2, "failed"),
        (3, "failed"),
    ]
    tokens = [token for _, _, token in history]
    assert tokens == sorted(set(tokens))  # a new, larger fencing token per attempt
    run_id = public_run_id(pk)
    assert read_calls(ledger) == [
        (run_id, number, run.idempotency_key, token) for number, _, token in history
    ]
    assert run.attempt == 3
    assert run.last_error["type"] == "ConnectionError"
    assert "upstream unavailable (attempt 3)" in run.last_error["message"]
    assert set(Attempt.objects.filter(run_id=pk).values_list("error_type", flat=True)) == {
        "ConnectionError"
    }
    # self.retry(countdown=5) published nothing: the worker received one message per attempt
    # (a Celery retry is received at once, ETA or not) and the broker holds no other.
    assert received(worker, "flaky_upstream") == [f"cronlease-{run_id}-{t}" for t in tokens]
    assert "Retry in" not in worker.output()
    assert broker.llen(CELERY_QUEUE) == 0


@e2e
def test_a_task_whose_lease_was_lost_before_it_started_does_not_run(team_a, spawn, ledger, broker):
    definition = make_definition(
        team_a, "billing.send-invoice", queue="celery-lost", retry_base_seconds=0
    )
    (pk,) = add_ready_runs(definition, 1)
    spawn["bridge"]("celery-lost")
    # No Celery worker yet: the message waits in the broker while the bridge holds the lease.
    first = wait_for(
        lambda: Run.objects.filter(pk=pk, state="leased").first(), what="the first lease"
    )

    # The lease is lost while the message waits (as after a network partition of the bridge):
    # it expires and the reaper retries the run, which the bridge leases and sends again.
    expire_lease(pk)
    assert [(r.id, r.outcome) for r in store.reap()] == [(pk, "lease_expired")]
    second = wait_for(
        lambda: Run.objects.filter(pk=pk, state="leased", attempt=2).first(),
        what="the retry's lease",
    )
    assert second.fencing_token > first.fencing_token
    wait_for(lambda: broker.llen(CELERY_QUEUE) == 2, what="both messages in the broker")

    worker = spawn["celery_worker"]()
    (run,) = wait_for(runs_when([pk], "succeeded"), timeout=30, what="the retry to succeed")

    run_id = public_run_id(pk)
    # Both messages were delivered; the stale one was refused by its first heartbeat (409).
    assert received(worker, "send_invoice") == [
        f"cronlease-{run_id}-{first.fencing_token}",
        f"cronlease-{run_id}-{second.fencing_token}",
    ]
    assert (
        f"lease lost before the task started run_id={run_id} "
        f"fencing_token={first.fencing_token}: not running (409" in worker.output()
    )
    assert read_calls(ledger) == [(run_id, 2, run.idempotency_key, second.fencing_token)]
    assert attempts(pk) == [
        (1, "lease_expired", first.fencing_token),
        (2, "succeeded", second.fencing_token),
    ]


@e2e
def test_a_crashed_celery_worker_is_recovered_by_lease_expiry_alone(team_a, spawn, ledger, broker):
    (pk,) = dawdling_runs(team_a, "celery-crash", 1)
    worker = spawn["celery_worker"]("w1")
    spawn["bridge"]("celery-crash", "--lease-seconds", "2")
    ((_, _, _, first_token),) = wait_for(lambda: read_calls(ledger), what="the task to start")

    worker.kill()
    Run.objects.filter(pk=pk).update(payload={})  # the retry need not dawdle
    # Acknowledged on receipt: the broker has nothing to redeliver, so the retry is the
    # scheduler's alone. And once the task had the run the bridge stopped extending its lease:
    # with the task dead, it expires within the 2 s lease.
    assert broker.hlen("unacked") == 0
    reaped = wait_for(
        lambda: [r.outcome for r in store.reap() if r.id == pk], timeout=10, what="the reaper"
    )
    assert reaped == ["lease_expired"]

    replacement = spawn["celery_worker"]("w2")
    (run,) = wait_for(runs_when([pk], "succeeded"), timeout=90, what="the retry to succeed")

    run_id = public_run_id(pk)
    assert attempts(pk) == [(1, "lease_expired", first_token), (2, "succeeded", run.fencing_token)]
    assert [(attempt, token) for _, attempt, _, token in read_calls(ledger)] == [
        (1, first_token),
        (2, run.fencing_token),
    ]
    assert received(replacement, "send_invoice") == [f"cronlease-{run_id}-{run.fencing_token}"]


@e2e
@pytest.mark.parametrize("restarted", [False, True], ids=["gone", "restarted-same-name"])
def test_a_run_waiting_in_a_killed_celery_worker_is_let_go_within_a_few_heartbeats(
    team_a, spawn, ledger, broker, restarted
):
    """`restarted`: the worker is started again under its name at once, as a supervisor does.
    Its heartbeats were taken for the killed process's, whose held run stayed leased, and
    unrun, for --max-queued-seconds (600 s)."""
    pks = dawdling_runs(team_a, "celery-held", 2)
    worker = spawn["celery_worker"]("w1", heartbeat=True)
    bridge = spawn["bridge"]("celery-held", "--prefetch", "2", "--lease-seconds", "2")
    # One slot: the worker runs one task and holds the other message until the slot frees.
    ((started, _, _, _),) = wait_for(lambda: read_calls(ledger), what="the task to start")
    (held,) = [pk for pk in pks if public_run_id(pk) != started]
    wait_for(lambda: len(received(worker, "send_invoice")) == 2, what="the second message")
    assert broker.llen(CELERY_QUEUE) == 0
    time.sleep(3)  # past the 2 s lease: the bridge extends the held run's lease
    assert store.reap() == []

    worker.kill()
    Run.objects.filter(pk__in=pks).update(payload={})  # the retries need not dawdle
    if restarted:
        spawn["celery_worker"]("w1", heartbeat=True)
    # Silent for three heartbeats (at least 5 s): the bridge stops extending the held run's
    # lease, which then expires; it waited --max-queued-seconds (600 s) before. (A message in
    # the broker has no holder, and a worker under --without-heartbeat is never judged: both
    # stay extended, as the prefetch test shows.)
    reaped = wait_for(
        lambda: {r.id: r.outcome for r in store.reap() if r.id == held},
        timeout=20,
        what="the held run's lease to expire",
    )
    assert reaped == {held: "lease_expired"}
    assert "was received by Celery worker w1@" in bridge.output()

    if not restarted:
        spawn["celery_worker"]("w2", heartbeat=True)
    # The reaper's part too: the started run's lease expired with its task.
    done = wait_for(
        lambda: store.reap() is None or runs_when(pks, "succeeded")(),
        timeout=60,
        what="both runs to succeed",
    )
    assert sorted(run.pk for run in done) == sorted(pks)
    for pk in pks:
        assert [outcome for _, outcome, _ in attempts(pk)] == ["lease_expired", "succeeded"]


@e2e
def test_a_cancelled_run_tells_its_task_and_its_outcome_is_reported(
    team_a, spawn, ledger, broker, live_server, token_a
):
    definition = make_definition(
        team_a, "billing.send-invoice", queue="celery-cancel", payload={"workSeconds": 60}
    )
    (pk,) = add_ready_runs(definition, 1)
    spawn["celery_worker"]()
    spawn["bridge"]("celery-cancel", "--lease-seconds", "3")
    ((run_id, _, _, token),) = wait_for(lambda: read_calls(ledger), what="the task to start")

    cancel = httpx.post(
        f"{live_server.url}/api/v1/runs/{run_id}/cancel",
        headers={"Authorization": f"Bearer {token_a}"},
    )
    assert cancel.status_code == 202, cancel.text

    # The next heartbeat (a second later) tells the task, which stops; its outcome is reported
    # and the run ends cancelled, long before the task's 60 s or a lease expiry.
    (run,) = wait_for(runs_when([pk], "cancelled"), timeout=20, what="the run cancelled")
    assert run.result == {"sent": False, "cancelled": True}
    assert attempts(pk) == [(1, "cancelled", token)]


@e2e
def test_a_task_whose_lease_expired_unreaped_finishes_and_its_result_is_taken(
    team_a, spawn, ledger, broker
):
    """The lease of a running task expires (its worker stalled), and no reaper has run: the
    heartbeat's 409 (`/lease-expired`) told the task its lease was lost, which stopped it
    unsent; the reaper then retried the run. It is still the task's: it runs on and its result
    is taken, on its first attempt."""
    definition = make_definition(
        team_a, "billing.send-invoice", queue="celery-expired", payload={"workSeconds": 4}
    )
    (pk,) = add_ready_runs(definition, 1)
    worker = spawn["celery_worker"]()
    spawn["bridge"]("celery-expired", "--lease-seconds", "3")
    ((run_id, _, key, token),) = wait_for(lambda: read_calls(ledger), what="the task to start")
    expire_lease(pk)  # and no scheduler runs to reap it
    (run,) = wait_for(runs_when([pk], "succeeded"), timeout=30, what="the run done")
    assert run.result == {"sent": True, "invoice": key}
    assert attempts(pk) == [(1, "succeeded", token)]
    assert f"lease expired run_id={run_id}" in worker.output()


@e2e
def test_the_bridge_leases_no_more_than_prefetch_and_stops_on_sigterm(team_a, spawn, broker):
    definition = make_definition(team_a, "billing.send-invoice", queue="celery-prefetch")
    pks = add_ready_runs(definition, 5)
    bridge = spawn["bridge"](
        "celery-prefetch", "--prefetch", "2", "--lease-seconds", "2", "--grace-seconds", "1"
    )

    def leased() -> list[Run]:
        return list(Run.objects.filter(pk__in=pks, state="leased"))

    first = wait_for(lambda: len(leased()) == 2 and leased(), what="two leases")
    # No Celery worker: the two messages wait in the broker, the bridge extends their leases
    # past their 2 s length and leases nothing more.
    wait_for(lambda: broker.llen(CELERY_QUEUE) == 2, what="two messages in the broker")
    time.sleep(3)
    assert store.reap() == []
    assert sorted((r.pk, r.fencing_token) for r in leased()) == sorted(
        (r.pk, r.fencing_token) for r in first
    )
    assert Run.objects.filter(pk__in=pks, attempt=0).count() == 3

    bridge.send_signal(signal.SIGTERM)
    assert bridge.wait(timeout=15) == 0
    assert "still queued in Celery after the grace period" in bridge.output()
    assert Run.objects.filter(pk__in=pks, attempt=0).count() == 3


@e2e
def test_sigterm_hangs_up_the_bridges_long_poll_rather_than_wait_it_out(team_a, spawn, broker):
    make_definition(team_a, "billing.send-invoice", queue="celery-idle")
    # Nothing queued in Celery, so nothing for its 30 s grace period to wait for but the poll.
    bridge = spawn["bridge"]("celery-idle", "--wait-seconds", "30")
    # Asking: the queue's workers list it once its first lease request has arrived.
    wait_for(
        lambda: Worker.objects.filter(team=team_a, queues__contains=["celery-idle"]).exists(),
        what="the bridge's long poll",
    )
    time.sleep(0.5)
    bridge.send_signal(signal.SIGTERM)
    assert bridge.wait(timeout=15) == 0  # well inside the 30 s the poll would have waited


@e2e
def test_a_task_the_celery_worker_does_not_have_fails_its_run_at_once(team_a, spawn, broker):
    """A bridge deployed ahead of its Celery workers sends a task they do not have: Celery drops
    the message, and the run is failed at once as retryable, not kept leased by the bridge for
    its max_queued_seconds (600 s) per attempt."""
    definition = make_definition(team_a, "demo.ahead", queue="celery-ahead", retry_max_attempts=2)
    pk = add_cron_run(definition)
    spawn["celery_worker"]()
    bridge = spawn["bridge"]("celery-ahead", tasks="tests.client.celery_bridge_ahead")

    (run,) = wait_for(runs_when([pk], "retrying", "dead"), timeout=30, what="the run failed")
    assert run.last_error["type"] == "TaskNotRegistered"
    assert "celery_bridge_ahead.ahead" in run.last_error["message"]
    wait_for(lambda: "not_registered" in bridge.output(), timeout=10, what="the bridge told")


@e2e
def test_the_bridge_leases_only_jobs_it_has_tasks_for(team_a, spawn, ledger, broker):
    """The lease asks for the bridge's jobs only: another job in the same queue is left alone."""
    mine = make_definition(team_a, "billing.send-invoice", queue="celery-mixed")
    other = make_definition(team_a, "billing.reconcile", queue="celery-mixed")
    (foreign,) = add_ready_runs(other, 1, age_seconds=60)  # older: a FIFO lease would take it first
    pk = add_cron_run(mine)
    spawn["celery_worker"]()
    spawn["bridge"]("celery-mixed")

    wait_for(runs_when([pk], "succeeded"), timeout=30, what="the Celery job's run to succeed")
    untouched = Run.objects.get(pk=foreign)
    assert untouched.attempt == 0 and untouched.state == "scheduled"


def test_the_worker_sdk_does_not_import_celery():
    code = (
        "import sys, cronlease_client, cronlease_client.cli, cronlease_client.__main__\n"
        "assert not [m for m in sys.modules if m.split('.')[0] in ('celery', 'kombu')]\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(CLIENT_DIR)])}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=30)


def test_acks_late_is_refused(celery_installed):
    from celery import Celery
    from cronlease_client.celery import cronlease_task

    with pytest.raises(ValueError, match="acknowledged on receipt"):
        cronlease_task(Celery("refused", broker="memory://"), "x.y", acks_late=True)


@e2e
def test_a_dry_run_is_answered_by_the_next_lease_request(team_a, spawn, ledger, broker):
    """A run the bridge answers itself (a dry run its task does not take) goes to no Celery
    worker: its answer rides on the bridge's next lease request, not a request of its own."""
    definition = make_definition(team_a, "billing.send-invoice", queue="celery-dry", dry_run=True)
    pk = add_cron_run(definition)
    spawn["celery_worker"]()
    bridge = spawn["bridge"]("celery-dry")

    (run,) = wait_for(runs_when([pk], "succeeded"), timeout=30, what="the dry run answered")
    assert run.result == {"dryRun": True, "skipped": True}
    assert read_calls(ledger) == []
    wait_for(lambda: "reported run_id=" in bridge.output(), what="the bridge read its answer")
    assert "/api/v1/leases" in bridge.output()  # its requests are logged
    assert "/api/v1/results" not in bridge.output()


def test_a_garbled_lease_answer_is_a_failure_that_may_pass_not_a_crash(
    celery_installed, serve, monkeypatch
):
    """A 200 to the bridge's lease request whose body is not a lease answer (a proxy's page, an
    answer cut short, another shape) raises BadAnswer, which the lease loop waits out and
    retries as it does a 5xx; it crashed the loop (a TypeError) and stopped the bridge."""
    from celery import Celery
    from cronlease_client import transport
    from cronlease_client.celery import cronlease_task
    from cronlease_client.celery.bridge import Bridge
    from cronlease_client.celery.tasks import registered_tasks
    from cronlease_client.errors import BadAnswer

    from tests.client.scripted import Response

    monkeypatch.setattr(transport, "backoff_delay", lambda failures, **cap: 0.01)
    app = Celery("garbled", broker="memory://")
    cronlease_task(app, "demo.garbled")(lambda ctx: None)
    garbled = iter([b'{"leases": "nope"}', b"<html>502</html>", b'{"leases": [{"bogus": 1}]}'])
    server = serve(lambda request: Response(200, next(garbled, b"null"), {}))
    spec = registered_tasks()["demo.garbled"]
    bridge = Bridge(server.url, "token", ["q"], tasks={"demo.garbled": spec}, wait_seconds=0)
    bridge._lease_http = bridge._transport(cancel=bridge.shutdown)  # as start() makes it
    with pytest.raises(BadAnswer) as raised:
        bridge.lease_once()
    assert raised.value.transient


@e2e
def test_a_tasks_result_is_held_through_a_web_restart_longer_than_the_transports_tries(
    celery_installed, team_a, live_server, worker_token_a, serve, monkeypatch
):
    """The scheduler unreachable for longer than a report's tries (two here; ten, about 20 s,
    by default) while the lease runs for 30: the task's outcome was dropped ("its lease will
    expire and the scheduler retry it") and the finished work ran again. It is sent again,
    the lease heartbeated meanwhile, and taken once the scheduler is back."""
    import threading
    from types import SimpleNamespace

    from celery import Celery
    from cronlease_client import transport
    from cronlease_client.celery import tasks

    from tests.client.conftest import forwarding

    monkeypatch.setattr(tasks, "REPORT_ATTEMPTS", 2, raising=False)
    monkeypatch.setattr(transport, "backoff_delay", lambda failures, **cap: 0.2)
    definition = make_definition(team_a, "demo.restart", queue="restart")
    (pk,) = add_ready_runs(definition, 1)
    down, finished = threading.Event(), threading.Event()
    proxy = serve(forwarding(live_server.url, down))
    (lease,) = httpx.post(
        f"{live_server.url}/api/v1/leases",
        json={"queues": ["restart"], "max": 1, "workerId": "w", "leaseSeconds": 30},
        headers={"Authorization": f"Bearer {worker_token_a}"},
    ).json()["leases"]

    def work(ctx) -> dict:
        down.set()  # the web process goes away while the task works
        finished.set()
        return {"done": ctx.attempt}

    app = Celery("restart", broker="memory://")
    app.conf.cronlease_url, app.conf.cronlease_token = proxy.url, worker_token_a
    spec = tasks.TaskSpec("demo.restart", work, None, app)
    task = SimpleNamespace(app=app, request=SimpleNamespace(hostname="w1@test"))
    outcome: list[dict] = []
    body = threading.Thread(
        target=lambda: outcome.append(tasks.execute(task, spec, lease, {"leaseSeconds": 30}))
    )
    body.start()
    assert finished.wait(20)
    time.sleep(3)  # past the report's tries
    assert Run.objects.get(pk=pk).state == "leased"
    down.clear()
    body.join(30)
    assert outcome and outcome[0]["outcome"] == "succeeded", outcome
    run = Run.objects.get(pk=pk)
    assert (run.state, run.attempt, run.result) == ("succeeded", 1, {"done": 1})


@contextmanager
def private_redis(port: int) -> Iterator[Callable[[], None]]:
    """A Redis server of the test's own on `port` (it is stopped and started again: the
    shared one is not); the function starts it again after the test stopped it."""
    command = ["redis-server", "--port", str(port), "--save", "", "--appendonly", "no"]

    def started() -> subprocess.Popen:
        server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        wait_for(lambda: _answers(port), timeout=10, what="the private Redis to listen")
        return server

    servers = [started()]
    try:
        yield lambda: servers.append(started())
    finally:
        for server in servers:
            server.kill()
            server.wait(10)


def _answers(port: int) -> bool:
    try:
        with closing(socket.create_connection(("127.0.0.1", port), timeout=1)):
            return True
    except OSError:
        return False


def test_a_broker_down_spends_no_attempts_of_the_runs_the_bridge_would_lease(
    team_a, spawn, ledger, broker
):
    """With the broker down, the bridge leased, failed each run unsent (retryable), and leased
    it again after its backoff: a 30 s outage dead-lettered every run without one having run.
    It now waits for the broker before leasing again: the run that met the failure spent one
    attempt, the others none, and all run once the broker is back."""
    with closing(socket.socket()) as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    url = f"redis://127.0.0.1:{port}/0"
    definition = make_definition(
        team_a, "billing.send-invoice", queue="celery-down",
        retry_max_attempts=3, retry_base_seconds=1, retry_max_seconds=1,
    )  # fmt: skip
    with private_redis(port) as start_again:
        spawn["celery_worker"](broker_url=url)
        spawn["bridge"]("celery-down", "--prefetch", "2", broker_url=url)
        first = add_ready_runs(definition, 1, prefix="before")
        wait_for(runs_when(first, "succeeded"), timeout=60, what="a run before the outage")
        subprocess.run(["redis-cli", "-p", str(port), "shutdown", "nosave"], check=False)
        pks = add_ready_runs(definition, 3)
        time.sleep(8)  # eight backoffs of the runs' retries
        spent = {pk: len(attempts(pk)) for pk in pks}
        states = dict(Run.objects.filter(pk__in=pks).values_list("pk", "state"))
        assert "dead" not in states.values(), (states, spent)
        assert sum(spent.values()) <= 2, spent  # the batch that met the failure
        start_again()
        done = wait_for(runs_when(pks, "succeeded"), timeout=60, what="the runs to succeed")
    assert len(done) == 3
    assert all(attempts(pk)[-1][1] == "succeeded" for pk in pks)
