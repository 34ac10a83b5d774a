"""PostgreSQL restarted under load: API server, reaper and workers run against a server of the
test's own (the `pgserver` package's binaries), which the test stops (`pg_ctl stop -m fast`:
every connection dies), keeps down for half a second, and starts again, mid-load.

Both layouts. With shards on servers of their own, the test starts two servers: the restarted
one holds the control database and shards 0-7, the other shards 8-15, and the load is runs of
a job on each. (A shard server killed outright while workers drain: tests/shards.)
"""

from __future__ import annotations

import json
import secrets
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import pytest

from apps.jobs.schedule import shard_for
from apps.runs import shards, store
from apps.teams.models import TOKEN_PREFIX, hash_token
from scheduler_site import shardmap
from tests.faults.handlers import WORK_JOBS
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

pytestmark = [
    pytest.mark.slow,
    pytest.mark.shards,
    pytest.mark.django_db(transaction=True, databases="__all__"),
]

RUNS = 40
LIMIT = 3


def insert_runs(db: Db, definition_id: int, count: int) -> list[int]:
    """Insert `count` runs claimable now, with the product's own INSERT statement (on every
    database of `db`: it inserts only where the definition is)."""
    now = db.scalar("SELECT now()")
    rows = [
        {
            "definition_id": definition_id,
            "trigger": "api",
            "due_at": (now - timedelta(seconds=1, milliseconds=-i)).isoformat(),
            "available_at": (now - timedelta(seconds=1, milliseconds=-i)).isoformat(),
            "idempotency_key": f"restart-{definition_id}-{i}",
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


def job_names() -> list[str]:
    """The jobs of the load: one; with shards on servers of their own, one on each server
    (shards 0-7 and 8-15: `shardmap.spread` over two), both run by the `work` handler."""
    if not shards.physical():
        return ["faults.work"]
    on_restarted = next(name for name in WORK_JOBS if shard_for(name) < 8)
    return [on_restarted, next(name for name in WORK_JOBS if shard_for(name) >= 8)]


def test_a_postgres_restart_mid_load_loses_and_doubles_no_run(harness):
    h = harness
    root = Path(tempfile.mkdtemp(prefix="faults-pg-"))
    pg = OwnPostgres(root)
    other = OwnPostgres(Path(tempfile.mkdtemp(prefix="faults-pg-"))) if shards.physical() else None
    others = [other.url] if other else []
    sampler: LeaseSampler | None = None
    db: Db | None = None
    try:
        # The map is this test's own (the session's names the suite's servers).
        shard_map = shardmap.spread(16, [pg.url, *others]) if other else ""
        env = process_env(pg.url, root / "data", SCHEDULER_SHARD_DATABASES=shard_map)
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
        control = Db(pg.url)
        token = create_team_token(control)
        control.close()
        db = Db(pg.url, others=others)
        install_peak_recorder(db)
        # The workers start now and wait for work (their start-up overlaps the rest).
        sampler = LeaseSampler([pg.url, *others]).start()
        workers = [
            h.worker(f"restart-{i}", "restart", concurrency=2, lease=3, url=url, token=token)
            for i in range(2)
        ]
        wait_http_ok(f"{url}/readyz", api)
        names = job_names()
        with h.http(token, url) as http:
            for name in names:
                created = http.put(
                    f"/api/v1/jobs/{name}",
                    json={
                        "name": name,
                        "schedule": {},
                        "queue": "restart",
                        "timeoutSeconds": 60,
                        "retry": {"maxAttempts": 5, "baseSeconds": 0, "maxSeconds": 0},
                        "concurrency": LIMIT,
                        "payload": {"seconds": 0.2},
                    },
                )
                assert created.status_code in (200, 201), created.text
        definition_ids = [
            db.scalar("SELECT id FROM jobs_jobdefinition WHERE name = %s", [name]) for name in names
        ]
        for definition_id in definition_ids:
            assert len(insert_runs(db, definition_id, RUNS // len(names))) == RUNS // len(names)

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
        db = Db(pg.url, others=others)
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
        assert all(peaks[definition_id] <= LIMIT for definition_id in definition_ids)
    finally:
        if sampler is not None:
            sampler.stop()
        for proc in h.procs:
            proc.kill()
        if db is not None:
            db.close()
        pg.close()
        if other is not None:
            other.close()
