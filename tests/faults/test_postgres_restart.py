"""PostgreSQL restarted under load: API server, reaper and workers run against a server of the
test's own (the `pgserver` package's binaries), which the test stops (`pg_ctl stop -m fast`:
every connection dies), keeps down for half a second, and starts again, mid-load.
"""

from __future__ import annotations

import json
import secrets
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import pytest

from apps.runs import store
from apps.teams.models import TOKEN_PREFIX, hash_token
from tests.faults.helpers import (
    Db,
    LeaseSampler,
    OwnPostgres,
    check_invariants,
    free_port,
    install_peak_recorder,
    manage_argv,
    process_env,
    read_ledger,
    uvicorn_argv,
    wait_for,
    wait_http_ok,
)

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

RUNS = 40
LIMIT = 3


def insert_runs(db: Db, definition_id: int, count: int) -> list[int]:
    """Insert `count` runs claimable now, with the product's own INSERT statement."""
    now = db.scalar("SELECT now()")
    rows = [
        {
            "definition_id": definition_id,
            "trigger": "api",
            "due_at": (now - timedelta(seconds=1, milliseconds=-i)).isoformat(),
            "available_at": (now - timedelta(seconds=1, milliseconds=-i)).isoformat(),
            "idempotency_key": f"restart-{i}",
            "own": False,
            "payload": None,
            "payload_key": "",
        }
        for i in range(count)
    ]
    inserted = db.rows(
        store.INSERT_RUNS, {"rows": json.dumps(rows), "definition_ids": [definition_id]}
    )
    return [row[0] for row in inserted]


def create_team_token(db: Db) -> str:
    """Create a team and a token for it straight in the database (what `createteam` does, minus
    the few seconds of a Django start-up); return the raw token."""
    raw = TOKEN_PREFIX + secrets.token_urlsafe(32)
    team_id = db.scalar(
        "INSERT INTO teams_team (slug, name, created_at) VALUES ('restart', 'Restart', now())"
        " RETURNING id"
    )
    db.rows(
        "INSERT INTO teams_apitoken (team_id, name, token_hash, prefix, scopes, created_at)"
        " VALUES (%s, 'faults', %s, %s, '[\"manage\", \"worker\"]', now()) RETURNING id",
        [team_id, hash_token(raw), raw[:12]],
    )
    return raw


def test_a_postgres_restart_mid_load_loses_and_doubles_no_run(harness):
    h = harness
    root = Path(tempfile.mkdtemp(prefix="faults-pg-"))
    pg = OwnPostgres(root)
    sampler: LeaseSampler | None = None
    db: Db | None = None
    try:
        env = process_env(pg.url, root / "data")
        # The API server starts while the schema is migrated (it needs it only to answer).
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        api = h.start(
            "web-own", uvicorn_argv(port), base_env=env, SCHEDULER_APPLICATION_NAME="faults:web"
        )
        migrate = h.start("migrate", manage_argv("migrate", "-v0"), base_env=env)
        assert migrate.wait(120) == 0, migrate.output()
        reaper = h.start(
            "reaper-own",
            manage_argv("reaper", "--interval", "0.2"),
            base_env=env,
            SCHEDULER_APPLICATION_NAME="faults:reaper",
        )
        db = Db(pg.url)
        install_peak_recorder(db)
        token = create_team_token(db)
        # The workers start now and wait for work (their start-up overlaps the rest).
        sampler = LeaseSampler(pg.url).start()
        workers = [
            h.worker(f"restart-{i}", "restart", concurrency=2, lease=3, url=url, token=token)
            for i in range(2)
        ]
        wait_http_ok(f"{url}/readyz", api)
        with h.http(token, url) as http:
            created = http.put(
                "/api/v1/jobs/faults.work",
                json={
                    "name": "faults.work",
                    "schedule": {},
                    "queue": "restart",
                    "timeoutSeconds": 60,
                    "retry": {"maxAttempts": 5, "baseSeconds": 0, "maxSeconds": 0},
                    "concurrency": LIMIT,
                    "payload": {"seconds": 0.2},
                },
            )
            assert created.status_code in (200, 201), created.text
        definition_id = db.scalar("SELECT id FROM jobs_jobdefinition WHERE name = 'faults.work'")
        ids = insert_runs(db, definition_id, RUNS)
        assert len(ids) == RUNS

        def succeeded() -> int:
            return db.scalar("SELECT count(*) FROM runs_run WHERE state = 'succeeded'")

        wait_for(
            lambda: (
                succeeded() >= 8
                and db.scalar("SELECT count(*) FROM runs_run WHERE state = 'leased'")
            ),
            60,
            "the load to get going, with runs in flight",
        )
        db.close()
        pg.stop()
        time.sleep(0.5)
        pg.start()
        db = Db(pg.url)
        assert succeeded() < RUNS

        wait_for(lambda: succeeded() == RUNS, 90, "every run to succeed after the restart")

        # Everything resumed without being restarted.
        for proc in (api, reaper, *workers):
            assert proc.alive(), f"{proc.name} died:\n{proc.output()[-3000:]}"
        assert db.scalar("SELECT count(*) FROM runs_run") == RUNS
        effects = read_ledger(h.ledger)
        keys = {
            row[0]: row[1] for row in db.rows("SELECT idempotency_key, fencing_token FROM runs_run")
        }
        assert set(effects) == set(keys)
        for key, effect in effects.items():
            # Written once, by an attempt of that run (a retry after a lost result finds it).
            assert effect["fencing_token"] in {
                row[0]
                for row in db.rows(
                    "SELECT a.fencing_token FROM runs_attempt a JOIN runs_run r ON r.id = a.run_id"
                    " WHERE r.idempotency_key = %s",
                    [key],
                )
            }
        sampler.stop()
        assert sampler.failures > 0  # it did see the database go away
        peaks = check_invariants(db, sampler)
        assert peaks[definition_id] <= LIMIT
    finally:
        if sampler is not None:
            sampler.stop()
        for proc in h.procs:
            proc.kill()
        if db is not None:
            db.close()
        pg.close()
