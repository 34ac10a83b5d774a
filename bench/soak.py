"""Soak with faults: schedulers, the API and many workers for N minutes while things break.

    . .venv/bin/activate && python bench/soak.py --minutes 10

It builds a fresh database `soak` on the server of DATABASE_URL (default: this machine's
PostgreSQL), starts two schedulers, a two-process API and a fleet of SDK workers, feeds runs at a
steady rate through the API (plus minutely cron jobs and a concurrency-limited job), and every
few seconds injects one fault at random: SIGKILL a worker, SIGTERM a worker, freeze a scheduler
with SIGSTOP past its shard lease then SIGCONT it, kill the application's database connections
with pg_terminate_backend, or restart a scheduler. Killed processes are replaced. At the end it
stops feeding, lets the system drain, and prints the totals:

    runs due, started, succeeded, dead; lost (must be 0); double-succeeded (must be 0);
    succeeded without an effect (must be 0); max concurrency seen vs the limit.

A run is "lost" when it is neither finished nor dead after the drain, or when the API answered
its creation but the database has no such run. "Double-succeeded" counts runs with more than one
succeeded attempt. "Succeeded without an effect" counts succeeded runs whose handler's ledger
(keyed by idempotency key, fenced by token: examples/plain_worker/handlers.py) has no row. The
figures of the last 10-minute run are in docs/RELIABILITY.md.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import closing
from pathlib import Path
from urllib.parse import urlparse, urlunparse

import httpx
import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from apps.runs.ids import parse_run_id  # noqa: E402 - a pure helper, no Django setup needed

ROOT = Path(__file__).resolve().parent.parent
LIMIT = 2  # concurrency of the limited job
CRON_JOBS = 20


def database_urls(base: str, name: str) -> tuple[str, str]:
    parsed = urlparse(base)
    return urlunparse(parsed._replace(path="/postgres")), urlunparse(
        parsed._replace(path=f"/{name}")
    )


class Fleet:
    """The processes of the soak, each replaceable."""

    def __init__(self, env: dict[str, str], logs: Path, workers: int) -> None:
        self.env = env
        self.logs = logs
        self.workers: list[subprocess.Popen] = []
        self.schedulers: list[subprocess.Popen] = []
        self.api: subprocess.Popen | None = None
        self.count = 0
        for _ in range(workers):
            self.workers.append(self.worker())
        for _ in range(2):
            self.schedulers.append(self.scheduler())

    def spawn(self, name: str, command: list[str]) -> subprocess.Popen:
        self.count += 1
        log = (self.logs / f"{name}-{self.count}.log").open("w")
        return subprocess.Popen(
            command, cwd=ROOT, env=self.env, stdout=log, stderr=subprocess.STDOUT
        )

    def start_api(self, port: int) -> None:
        self.api = self.spawn(
            "api",
            [sys.executable, "manage.py", "web", "--port", str(port), "--workers", "2"],
        )

    def worker(self) -> subprocess.Popen:
        return self.spawn(
            "worker",
            [
                sys.executable,
                "-m",
                "cronlease_client",
                "run",
                "soak_handlers",
                "--queue",
                "soak",
                "--concurrency",
                "8",
                "--lease-seconds",
                "5",
                "--wait-seconds",
                "2",
                "--grace-seconds",
                "5",
            ],
        )

    def scheduler(self) -> subprocess.Popen:
        return self.spawn("scheduler", [sys.executable, "manage.py", "scheduler"])

    def everything(self) -> list[subprocess.Popen]:
        return [*self.workers, *self.schedulers, *([self.api] if self.api else [])]

    def stop(self) -> None:
        for process in self.everything():
            if process.poll() is None:
                process.send_signal(signal.SIGCONT)
                process.terminate()
        deadline = time.monotonic() + 30
        for process in self.everything():
            try:
                process.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()


def inject(fleet: Fleet, db_url: str, faults: dict[str, int]) -> None:
    """One fault, chosen at random; the victim is replaced where it died."""
    kind = random.choice(
        ["kill_worker", "term_worker", "freeze_scheduler", "reset_connections", "restart_scheduler"]
    )
    faults[kind] = faults.get(kind, 0) + 1
    if kind in ("kill_worker", "term_worker"):
        index = random.randrange(len(fleet.workers))
        victim = fleet.workers[index]
        victim.send_signal(signal.SIGKILL if kind == "kill_worker" else signal.SIGTERM)
        if kind == "term_worker":
            try:
                victim.wait(15)
            except subprocess.TimeoutExpired:
                victim.kill()
        fleet.workers[index] = fleet.worker()
    elif kind == "freeze_scheduler":
        victim = random.choice(fleet.schedulers)
        victim.send_signal(signal.SIGSTOP)
        # Past the shard lease (10 s): the other node takes its shards; the frozen one must be
        # refused by the epoch check when it wakes up.
        threading.Timer(12.0, lambda: victim.send_signal(signal.SIGCONT)).start()
    elif kind == "reset_connections":
        with psycopg.connect(db_url, autocommit=True) as conn:
            conn.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                "WHERE datname = current_database() AND pid <> pg_backend_pid() "
                "AND application_name LIKE 'scheduler:%%'"
            )
    else:
        index = random.randrange(len(fleet.schedulers))
        fleet.schedulers[index].send_signal(signal.SIGCONT)
        fleet.schedulers[index].terminate()
        try:
            fleet.schedulers[index].wait(20)
        except subprocess.TimeoutExpired:
            fleet.schedulers[index].kill()
        fleet.schedulers[index] = fleet.scheduler()


def sample_concurrency(db_url: str, stop: threading.Event, seen: list[int]) -> None:
    with psycopg.connect(db_url, autocommit=True) as conn:
        while not stop.is_set():
            try:
                row = conn.execute(
                    "SELECT count(*) FROM runs_run r JOIN jobs_jobdefinition d ON d.id = r.definition_id "
                    "WHERE d.name = 'demo.sleep' AND r.state = 'leased'"
                ).fetchone()
                seen.append(row[0])
            except psycopg.Error:
                time.sleep(0.5)
            time.sleep(0.05)


def feed(api: httpx.Client, stop: threading.Event, rate: float, created: list[str]) -> None:
    """Create runs through the API at `rate` per second, each with its own idempotency key."""
    jobs = ["soak.work", "demo.flaky", "demo.sleep"]
    interval = 1.0 / rate
    index = 0
    while not stop.is_set():
        started = time.monotonic()
        job = jobs[0] if index % 10 < 8 else jobs[1 + index % 2]
        key = f"soak-{index}"
        try:
            answer = api.post(f"/api/v1/jobs/{job}/runs", json={"idempotencyKey": key})
            if answer.status_code in (200, 201):
                created.append(answer.json()["runId"])
            elif answer.status_code >= 500:
                continue  # retried with the same key next round: at most one run per key
        except httpx.HTTPError:
            continue
        index += 1
        time.sleep(max(0.0, interval - (time.monotonic() - started)))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--minutes", type=float, default=10)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--rate", type=float, default=20, help="API-created runs per second")
    parser.add_argument("--fault-every", type=float, default=15, help="seconds between faults")
    parser.add_argument("--port", type=int, default=8765)
    parser.add_argument(
        "--database-url",
        default=os.environ.get("DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/postgres"),
    )
    args = parser.parse_args()

    admin_url, db_url = database_urls(args.database_url, "soak")
    with psycopg.connect(admin_url, autocommit=True) as conn:
        conn.execute("DROP DATABASE IF EXISTS soak WITH (FORCE)")
        conn.execute("CREATE DATABASE soak")
    work = Path(tempfile.mkdtemp(prefix="soak-"))
    ledger = work / "ledger.sqlite3"
    # The example's ledger handlers (demo.sleep, demo.flaky) plus a plain one for soak.work.
    (work / "soak_handlers.py").write_text(
        "from cronlease_client import handler\n"
        "from examples.plain_worker.handlers import record_once\n\n\n"
        "def work(ctx):\n"
        "    return {'recorded': record_once(ctx, {})}\n\n\n"
        f"for name in ['soak.work'] + [f'soak.cron-{{i}}' for i in range({CRON_JOBS})]:\n"
        "    handler(name)(work)\n"
    )
    env = {
        **os.environ,
        "DATABASE_URL": db_url,
        "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "client"), str(work)]),
        "PLAIN_WORKER_DB": str(ledger),
        "LOG_FORMAT": "plain",
        "LOG_RUNS_LEVEL": "WARNING",
        "SCHEDULER_API_RATE_WORKER": "",
        "SCHEDULER_API_RATE_MANAGE": "",
        "PROMETHEUS_MULTIPROC_DIR": str(work),
    }
    env.pop("TEST_DATABASE_NAME", None)
    subprocess.run([sys.executable, "manage.py", "migrate", "-v0"], cwd=ROOT, env=env, check=True)
    token = (
        subprocess.run(
            [sys.executable, "manage.py", "createteam", "soak"],
            cwd=ROOT,
            env=env,
            check=True,
            capture_output=True,
            text=True,
        )
        .stdout.strip()
        .splitlines()[-1]
    )

    fleet = Fleet(
        {**env, "CRONLEASE_URL": f"http://127.0.0.1:{args.port}", "CRONLEASE_TOKEN": token},
        work,
        args.workers,
    )
    fleet.start_api(args.port)
    api = httpx.Client(
        base_url=f"http://127.0.0.1:{args.port}",
        headers={"Authorization": f"Bearer {token}"},
        timeout=10,
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if api.get("/healthz").status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.5)
    retry = {"maxAttempts": 5, "baseSeconds": 1, "maxSeconds": 5}
    api.put(
        "/api/v1/jobs/soak.work",
        json={"name": "soak.work", "queue": "soak", "retry": retry, "timeoutSeconds": 30},
    )
    # The ledger handlers are registered under the example's job names.
    api.put(
        "/api/v1/jobs/demo.flaky",
        json={
            "name": "demo.flaky",
            "queue": "soak",
            "retry": retry,
            "payload": {"failAttempts": 1},
        },
    )
    api.put(
        "/api/v1/jobs/demo.sleep",
        json={
            "name": "demo.sleep",
            "queue": "soak",
            "retry": retry,
            "concurrency": LIMIT,
            "payload": {"seconds": 0.2},
        },
    )
    for minute in range(CRON_JOBS):
        api.put(
            f"/api/v1/jobs/soak.cron-{minute}",
            json={
                "name": f"soak.cron-{minute}",
                "queue": "soak",
                "schedule": {"cron": "* * * * *", "jitterSeconds": 30},
                "retry": retry,
            },
        )

    stop = threading.Event()
    created: list[str] = []
    seen: list[int] = []
    faults: dict[str, int] = {}
    threading.Thread(target=feed, args=(api, stop, args.rate, created), daemon=True).start()
    threading.Thread(target=sample_concurrency, args=(db_url, stop, seen), daemon=True).start()
    started = time.monotonic()
    print(f"soaking for {args.minutes} minutes; logs in {work}", flush=True)
    try:
        while time.monotonic() - started < args.minutes * 60:
            time.sleep(args.fault_every * random.uniform(0.5, 1.5))
            inject(fleet, db_url, faults)
            for index, worker in enumerate(fleet.workers):
                if worker.poll() is not None:
                    fleet.workers[index] = fleet.worker()
        stop.set()
        totals = drain_and_count(db_url, ledger, created)
    finally:
        stop.set()
        fleet.stop()
    totals.update(
        {
            "faults": faults,
            "maxConcurrencySeen": max(seen or [0]),
            "concurrencyLimit": LIMIT,
            "minutes": args.minutes,
        }
    )
    print(json.dumps(totals, indent=2))


def drain_and_count(db_url: str, ledger: Path, created: list[str]) -> dict:
    """Wait (up to 3 minutes) until no run is waiting or leased, then count."""
    deadline = time.monotonic() + 180
    with psycopg.connect(db_url, autocommit=True) as conn:
        # Cron definitions would keep producing runs: pause them so the drain can end.
        conn.execute("UPDATE jobs_jobdefinition SET paused = true WHERE name LIKE 'soak.cron-%%'")
        while time.monotonic() < deadline:
            (pending,) = conn.execute(
                "SELECT count(*) FROM runs_run r JOIN jobs_jobdefinition d ON d.id = r.definition_id "
                "WHERE r.state IN ('scheduled', 'ready', 'retrying', 'leased') AND NOT d.paused"
            ).fetchone()
            if pending == 0:
                break
            time.sleep(2)
        row = conn.execute(
            """
            SELECT count(*),
                   count(*) FILTER (WHERE attempt >= 1),
                   count(*) FILTER (WHERE state = 'succeeded'),
                   count(*) FILTER (WHERE state = 'dead')
            FROM runs_run r JOIN jobs_jobdefinition d ON d.id = r.definition_id
            WHERE NOT (d.paused AND r.state IN ('scheduled', 'ready', 'retrying'))
            """
        ).fetchone()
        (lost,) = conn.execute(
            "SELECT count(*) FROM runs_run r JOIN jobs_jobdefinition d ON d.id = r.definition_id "
            "WHERE r.state IN ('scheduled', 'ready', 'retrying', 'leased') AND NOT d.paused"
        ).fetchone()
        (double,) = conn.execute(
            "SELECT count(*) FROM (SELECT run_id FROM runs_attempt WHERE outcome = 'succeeded' "
            "GROUP BY run_id HAVING count(*) > 1) AS d"
        ).fetchone()
        pks = [parse_run_id(run_id) for run_id in created]
        (found,) = conn.execute(
            "SELECT count(*) FROM runs_run WHERE id = ANY(%s)", [pks]
        ).fetchone()
        keys = [
            key
            for (key,) in conn.execute(
                "SELECT r.idempotency_key FROM runs_run r JOIN jobs_jobdefinition d ON d.id = r.definition_id "
                "WHERE (d.name = 'soak.work' OR d.name LIKE 'soak.cron-%%') AND r.state = 'succeeded'"
            )
        ]
    with closing(sqlite3.connect(ledger)) as db:
        recorded = {key for (key,) in db.execute("SELECT idempotency_key FROM effects")}
    return {
        "runsDue": row[0],
        "started": row[1],
        "succeeded": row[2],
        "dead": row[3],
        "lost": lost + (len(pks) - found),
        "doubleSucceeded": double,
        "succeededWithoutEffect": sum(1 for key in keys if key not in recorded),
        "createdThroughApi": len(created),
    }


if __name__ == "__main__":
    main()
