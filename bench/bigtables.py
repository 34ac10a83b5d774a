"""Big tables: the critical path with N runs stored (default 10 000 000) against an empty table.

    python bench/bigtables.py [--runs 10000000] [--backlog 50000] [--retire 1000000]
                              [--requests 5] [--database-url URL]

Uses its own database (default `bench_bigtables` on the local server; created if missing,
migrated and refilled), never the development or test databases. In one process, on one
database, the store layer without HTTP (the REST path adds the same per-request cost whatever
the table's size):

1. **Empty**: a backlog of `--backlog` ready runs of one job, alone in the tables, drained by
   one claimer 100 at a time — claim, heartbeat, complete — each step timed.
2. **Stored**: the same after bench/dashboard.py's load of `--runs` runs spread over the last
   day in an installation's shares (SHARES: 95 % succeeded, 2.5 % cancelled, 0.5 % dead, 0.3 %
   retrying, 1 % scheduled, 0.2 % ready, 0.5 % leased; each started one with an attempt; the
   dashboard benchmark's own shares, a day of heavy failures and backlog, put 1.5 M runs in
   the backlog at 10 M), VACUUM ANALYZE; then every dashboard screen (bench/dashboard.py's list
   and measure).
3. **Retention while draining**: `--retire` of the succeeded runs are made 40 days old, and a
   fresh backlog is drained while a thread runs the scheduler's retention rounds
   (`apps.runs.retention.handle_one_round`, batches of SCHEDULER_RETENTION_BATCH) until they are
   gone; the drain's rate against step 2's.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench import dashboard  # noqa: E402 - after the path

DEFAULT_URL = "postgresql://postgres@127.0.0.1:5432/bench_bigtables"
BATCH = 100
# Each state's share in hundredths of a percent (bench/dashboard.py's SHARES).
SHARES = {
    "succeeded": 9500, "dead": 50, "retrying": 30, "scheduled": 100, "ready": 20,
    "leased": 50, "cancelled": 250,
}  # fmt: skip


def backlog(count: int, name: str):
    """A team with one job and `count` runs of it claimable now; return the team."""
    from django.db import connection

    from apps.jobs.models import JobDefinition
    from apps.jobs.schedule import shard_for
    from apps.runs import store
    from apps.teams.models import Team

    team = Team.objects.create(slug=name, name=name)
    job = JobDefinition.objects.create(
        team=team, name=f"{name}.job", schedule={}, queue="drain", priority=1,
        shard=shard_for(f"{name}.job"),
    )  # fmt: skip
    with connection.cursor() as cursor:
        cursor.execute("SELECT now() - interval '10 seconds'")
        at = cursor.fetchone()[0]
    for start in range(0, count, 10_000):
        store.insert_runs(
            [
                store.NewRun(job.pk, "api", at + timedelta(microseconds=i),
                             at + timedelta(microseconds=i), f"k{i}")
                for i in range(start, min(count, start + 10_000))
            ]
        )  # fmt: skip
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE runs_run")
    return team


def drain(team) -> dict[str, float]:
    """Claim, heartbeat and complete the team's backlog 100 at a time; runs/s and ms per step."""
    from apps.runs import store

    spent = {"claim": 0.0, "heartbeat": 0.0, "complete": 0.0}
    done = 0
    started = time.perf_counter()
    while True:
        a = time.perf_counter()
        leases = store.claim(
            queues=["drain"], max_runs=BATCH, worker_id="bench", lease_seconds=60,
            team_ids=[team.pk],
        )  # fmt: skip
        b = time.perf_counter()
        if not leases:
            break
        store.heartbeat([(x.id, x.fencing_token) for x in leases], team_ids=[team.pk])
        c = time.perf_counter()
        store.complete([(x.id, x.fencing_token, None) for x in leases], team_ids=[team.pk])
        d = time.perf_counter()
        spent["claim"] += b - a
        spent["heartbeat"] += c - b
        spent["complete"] += d - c
        done += len(leases)
    elapsed = time.perf_counter() - started
    calls = max(1, done // BATCH)
    return {
        "runs": done,
        "runs_per_s": done / elapsed,
        **{f"{step}_ms": 1000 * seconds / calls for step, seconds in spent.items()},
    }


def show(label: str, figures: dict[str, float]) -> None:
    print(
        f"{label:<28} {figures['runs']:>7} runs {figures['runs_per_s']:>8.0f} runs/s   "
        f"claim {figures['claim_ms']:.2f} ms  heartbeat {figures['heartbeat_ms']:.2f} ms  "
        f"complete {figures['complete_ms']:.2f} ms  (per 100)",
        flush=True,
    )


def table_size() -> str:
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*), pg_size_pretty(pg_table_size('runs_run')),"
            " pg_size_pretty(pg_indexes_size('runs_run')) FROM runs_run"
        )
        rows, heap, indexes = cursor.fetchone()
    return f"runs_run: {rows} rows, {heap} heap, {indexes} indexes"


def retire(count: int) -> None:
    """Make `count` of the loaded succeeded runs (the oldest ids) finished 40 days ago."""
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute(
            "UPDATE runs_run SET finished_at = now() - interval '40 days' WHERE id IN ("
            " SELECT id FROM runs_run WHERE state = 'succeeded' ORDER BY id LIMIT %s)",
            [count],
        )
        cursor.execute("VACUUM ANALYZE runs_run")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=10_000_000)
    parser.add_argument("--backlog", type=int, default=50_000)
    parser.add_argument("--retire", type=int, default=1_000_000)
    parser.add_argument("--requests", type=int, default=5)
    parser.add_argument("--database-url", default=os.environ.get("BENCH_DATABASE_URL", DEFAULT_URL))
    args = parser.parse_args()

    # One log line per run event would be timed with the claims.
    os.environ.setdefault("LOG_RUNS_LEVEL", "WARNING")
    dashboard.ensure_database(args.database_url)
    dashboard.setup_django(args.database_url)
    from django.core.management import call_command
    from django.db import connection

    from apps.runs import retention

    call_command("migrate", verbosity=0)
    with connection.cursor() as cursor:
        cursor.execute("TRUNCATE runs_run, runs_attempt, runs_minutecounts, teams_team CASCADE")
    show("empty tables", drain(backlog(args.backlog, "empty")))

    dashboard.load(args.runs, SHARES)
    print(table_size(), flush=True)
    show(f"{args.runs:,} runs stored", drain(backlog(args.backlog, "stored")))

    worst = 0.0
    for username, who in (("bench-staff", "superuser, 5 teams"), ("bench-operator", "1 team")):
        print(f"\ndashboard, {who}: {args.requests} requests per screen, server time in ms")
        for name, median, p95, queries in dashboard.measure(username, args.requests):
            worst = max(worst, p95)
            print(f"  {name:<24}{median:>9.1f}{p95:>9.1f}{queries:>6}", flush=True)
    print(f"slowest p95: {worst:.1f} ms\n", flush=True)

    retire(args.retire)
    team = backlog(args.backlog, "baseline")
    show("before retention", drain(team))
    team = backlog(args.backlog, "retained")
    deleted = 0
    stop = threading.Event()
    timing: dict[str, float] = {}

    def retain() -> None:
        nonlocal deleted
        started = time.perf_counter()
        while not stop.is_set():
            gone = retention.handle_one_round()
            deleted += gone
            if not gone:
                break
        timing["retention_s"] = time.perf_counter() - started
        connection.close()

    thread = threading.Thread(target=retain)
    thread.start()
    figures = drain(team)
    show("while retention deletes", figures)
    thread.join()
    print(
        f"retention deleted {deleted} rows in {timing['retention_s']:.1f} s "
        f"({deleted / max(timing['retention_s'], 1e-9):.0f} rows/s, the drain's share of it "
        f"concurrent); {table_size()}"
    )


if __name__ == "__main__":
    main()
