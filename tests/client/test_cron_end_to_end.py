"""A cron job end to end: a live server, a scheduler process and an SDK worker process.

The definition runs every minute. Rather than wait for the next minute, the test sets its
next_due_at to the minute that has just begun: the scheduler materialises that cron time (as
`cron`, or as the `catch_up` of a missed time when the minute began longer ago than the grace),
and the worker runs it. The handler's effect records the idempotency key and fencing token.
"""

from __future__ import annotations

import os
import subprocess
import sys
from datetime import timedelta
from zoneinfo import ZoneInfo

import pytest

from apps.jobs.schedule import shard_for
from apps.runs.models import Run
from tests.client.conftest import read_ledger, wait_for
from tests.client.test_cli import CLIENT_DIR, ROOT
from tests.conftest import child_database_url, db_now, make_definition

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]


def test_every_minute_cron_runs_on_a_worker(live_server, team_a, worker_token_a, ledger, tmp_path):
    zone = ZoneInfo("Europe/Berlin")
    definition = make_definition(
        team_a,
        "billing.record-charge",
        queue="e2e",
        schedule={
            "cron": "* * * * *",
            "timeZone": "Europe/Berlin",
            "jitterSeconds": 0,
            "missedRunPolicy": "run_once",
        },
        payload={"customer": "c-1", "amountCents": 500},
    )
    now = db_now()
    minute = now.replace(second=0, microsecond=0)
    definition.next_due_at = minute
    definition.shard = shard_for(definition.name)
    definition.save()

    env = {
        **os.environ,
        "DATABASE_URL": child_database_url(),
        "PYTHONPATH": os.pathsep.join([str(ROOT), str(CLIENT_DIR)]),
        "SCHEDULER_SHARD_LEASE_SECONDS": "3",
        "SCHEDULER_TICK_SECONDS": "0.2",
        "CRONLEASE_URL": live_server.url,
        "CRONLEASE_TOKEN": worker_token_a,
        "PLAIN_WORKER_DB": str(ledger),
    }
    env.pop("TEST_DATABASE_NAME", None)
    logs = {name: (tmp_path / f"{name}.log").open("w") for name in ("scheduler", "worker")}
    processes = [
        subprocess.Popen(
            [sys.executable, "manage.py", "scheduler"],
            cwd=ROOT,
            env=env,
            stdout=logs["scheduler"],
            stderr=subprocess.STDOUT,
        ),
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "cronlease_client",
                "run",
                "examples.plain_worker.handlers",
                "--queue",
                "e2e",
                "--wait-seconds",
                "2",
            ],
            cwd=ROOT,
            env=env,
            stdout=logs["worker"],
            stderr=subprocess.STDOUT,
        ),
    ]
    try:
        run = wait_for(
            lambda: Run.objects.filter(
                definition=definition, due_at=minute, state="succeeded"
            ).first(),
            timeout=45,
            what="the cron run to succeed",
        )
        key = f"billing.record-charge@{minute.astimezone(zone).isoformat()}"
        assert run.idempotency_key == key
        assert run.trigger in ("cron", "catch_up")
        effect = read_ledger(ledger)[key]
        assert effect["fencing_token"] == run.fencing_token
        assert effect["run_id"] == run.run_id and effect["attempt"] == 1
        # The scheduler moved on to the next minute.
        definition.refresh_from_db()
        assert definition.next_due_at >= minute + timedelta(minutes=1)
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                process.kill()
        for handle in logs.values():
            handle.close()
        for name in logs:
            print(f"--- {name}\n{(tmp_path / f'{name}.log').read_text()[-3000:]}")
