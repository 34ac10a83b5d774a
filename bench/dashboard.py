"""Dashboard benchmark: server time of every screen with N runs stored (default 100 000).

    python bench/dashboard.py [--runs 100000] [--requests 15] [--database-url URL] [--keep]

Uses its own database (default `bench_dashboard` on the local server; created if missing,
migrated, and refilled unless --keep), so it never touches the development or test databases.

The data: 5 teams, 40 definitions each, runs spread over the last 24 hours — 70 % succeeded,
8 % dead, 5 % retrying, 5 % scheduled, 5 % ready, 2 % leased, 5 % cancelled — each started run
with an attempt that ended in the last day (the worst case for the overview's 24-hour pass), and
5 000 audit events, then VACUUM ANALYZE (autovacuum's steady state). Each screen is requested
in-process through Django's test client (the whole middleware, view and template path, no
network), as a superuser who sees all five teams (the most branches in every keyset query) and
as an operator of one team, after the census a running scheduler keeps (apps/runs/census.py) is
taken. Figures: median and p95 in ms, and the number of SQL statements per request.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from urllib.parse import urlparse, urlunparse

REPO = Path(__file__).resolve().parents[1]
DEFAULT_URL = "postgresql://postgres@127.0.0.1:5432/bench_dashboard"
TEAMS = 5
DEFINITIONS_PER_TEAM = 40
AUDIT_EVENTS = 5000
TARGET_MS = 300


def ensure_database(url: str) -> None:
    """Create the benchmark database if it does not exist (connecting to `postgres` to do so)."""
    import psycopg
    from psycopg import sql

    parsed = urlparse(url)
    name = parsed.path.lstrip("/")
    admin = urlunparse(parsed._replace(path="/postgres"))
    with psycopg.connect(admin, autocommit=True) as conn:
        if not conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", [name]).fetchone():
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))


def setup_django(url: str) -> None:
    os.environ["DATABASE_URL"] = url
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "scheduler_site.settings")
    os.environ.setdefault("SCHEDULER_APPLICATION_NAME", "scheduler:bench-dashboard")
    os.environ.setdefault("LOG_LEVEL", "WARNING")
    sys.path.insert(0, str(REPO))
    import django

    django.setup()


# Runs spread evenly over the last 24 hours; the state follows g mod 100 (see the docstring).
INSERT_RUNS = """
WITH defs AS (SELECT array_agg(id ORDER BY id) AS ids FROM jobs_jobdefinition)
INSERT INTO runs_run (
    definition_id, team_id, queue, priority, shard, state, trigger, due_at, available_at,
    attempt, max_attempts, idempotency_key, fencing_token, lease_expires_at, timeout_at,
    lease_seconds, worker_id, dry_run, payload, payload_key, result, last_error, created_at,
    started_at, late_seconds, finished_at, error_fingerprint, failed_at
)
SELECT d.id, d.team_id, d.queue, d.priority, d.shard, s.state, 'cron', t.due,
       CASE s.state WHEN 'scheduled' THEN now() + make_interval(secs => 60 + g %% 3600)
                    WHEN 'retrying' THEN now() + make_interval(secs => 30 + g %% 600)
                    ELSE t.due + interval '2 seconds' END,
       CASE WHEN s.started THEN 1 ELSE 0 END, 3, d.name || '@' || g,
       CASE WHEN s.started THEN g END,
       CASE s.state WHEN 'leased' THEN now() + interval '60 seconds' END,
       CASE s.state WHEN 'leased' THEN now() + interval '1 hour' END,
       60, CASE WHEN s.started THEN 'bench-worker/' || (g %% 50) ELSE '' END, false,
       jsonb_build_object('invoice', g, 'format', 'csv'), '', NULL,
       CASE WHEN s.state IN ('dead', 'retrying') THEN jsonb_build_object(
           'message', format((%(messages)s::text[])[1 + g %% %(errors)s], g),
           'type', (%(types)s::text[])[1 + g %% %(errors)s])
       END,
       t.due,
       CASE WHEN s.started THEN t.due + interval '2 seconds' + make_interval(secs => (g %% 97) / 100.0) END,
       CASE WHEN s.started THEN (g %% 97) / 100.0 END,
       CASE WHEN s.state IN ('succeeded', 'dead', 'cancelled') THEN t.due + interval '5 seconds' END,
       -- The group and time the fail statement stores (apps/runs/fingerprints.py, FAILURES).
       CASE WHEN s.state IN ('dead', 'retrying')
            THEN (%(fingerprints)s::bigint[])[1 + g %% %(errors)s] END,
       CASE WHEN s.state IN ('dead', 'retrying') THEN t.due + interval '5 seconds' END
FROM generate_series(1, %(n)s) AS g
CROSS JOIN defs
JOIN jobs_jobdefinition d ON d.id = defs.ids[1 + g %% array_length(defs.ids, 1)]
CROSS JOIN LATERAL (SELECT now() - make_interval(secs => g * 86000.0 / %(n)s) AS due) AS t
CROSS JOIN LATERAL (
    SELECT state, state NOT IN ('scheduled', 'ready', 'cancelled') AS started
    FROM (SELECT CASE WHEN p < %(succeeded)s THEN 'succeeded' WHEN p < %(dead)s THEN 'dead'
                      WHEN p < %(retrying)s THEN 'retrying' WHEN p < %(scheduled)s THEN 'scheduled'
                      WHEN p < %(ready)s THEN 'ready' WHEN p < %(leased)s THEN 'leased'
                      ELSE 'cancelled' END AS state
          -- g / definitions, so that every definition gets runs in every state: its runs go
          -- through the shares every %(cycle)s runs
          FROM (SELECT ((g / array_length(defs.ids, 1)) %% %(cycle)s) * 10000 / %(cycle)s AS p)
               AS share) AS picked
) AS s
"""

# Each state's share of the runs, in hundredths of a percent (the docstring's: a busy day with
# a large backlog and many failures, the dashboard's hard case).
SHARES = {
    "succeeded": 7000, "dead": 800, "retrying": 500, "scheduled": 500, "ready": 500,
    "leased": 200, "cancelled": 500,
}  # fmt: skip


def share_cuts(shares: dict[str, int], runs: int) -> dict[str, int]:
    """INSERT_RUNS's parameters: each state's upper bound of `p` (0-9999), in its order, and
    the cycle of a definition's runs through them (100 for whole percents, as this benchmark's
    data has always been; finer shares need as many runs per definition as there are)."""
    assert sum(shares.values()) == 10_000, shares
    whole = all(share % 100 == 0 for share in shares.values())
    per_definition = runs // (TEAMS * DEFINITIONS_PER_TEAM)
    cuts, total = {"cycle": 100 if whole else max(100, min(10_000, per_definition))}, 0
    for state in ("succeeded", "dead", "retrying", "scheduled", "ready", "leased"):
        total += shares[state]
        cuts[state] = total
    return cuts


# The errors of failed runs, in turn: a few groups, as an incident's failures look; each
# message differs per run (its `%s` is the run's number), its group does not.
FAILURES = [
    ("TimeoutError", "upstream timed out after 30 s (request %s)"),
    ("KeyError", "'customer %s'"),
    ("ConnectionError", "connection to db-%s.internal:5432 refused"),
    ("ValueError", "invoice %s has no lines"),
    ("PermissionError", "token for account %s was revoked"),
    ("RuntimeError", "export %s failed: disk quota exceeded"),
    ("LookupError", "no such order 5f2c1e9a-0000-4000-8000-%s"),
]


def failure_params() -> dict[str, object]:
    from apps.runs import fingerprints

    return {
        "errors": len(FAILURES),
        "types": [kind for kind, _ in FAILURES],
        "messages": [message for _, message in FAILURES],
        "fingerprints": [fingerprints.of(kind, message % 1) for kind, message in FAILURES],
    }


INSERT_ATTEMPTS = """
INSERT INTO runs_attempt (run_id, number, fencing_token, worker_id, leased_at, last_heartbeat_at,
                          ended_at, outcome, error_message, error_type)
SELECT id, 1, fencing_token, worker_id, started_at, started_at + interval '1 second',
       CASE WHEN state = 'leased' THEN NULL ELSE started_at + interval '3 seconds' END,
       CASE state WHEN 'succeeded' THEN 'succeeded' WHEN 'leased' THEN '' ELSE 'failed' END,
       coalesce(last_error->>'message', ''), coalesce(last_error->>'type', '')
FROM runs_run WHERE fencing_token IS NOT NULL
"""

INSERT_AUDIT = """
INSERT INTO audit_auditevent (created_at, team_id, actor, source, action, target_type, target,
                              before, after)
SELECT now() - make_interval(secs => g * 17), t.ids[1 + g %% array_length(t.ids, 1)],
       'bench-user', 'dashboard', 'run.retry', 'run', 'run_' || g,
       '{"state": "dead"}', '{"state": "ready"}'
FROM generate_series(1, %(n)s) AS g
CROSS JOIN (SELECT array_agg(id ORDER BY id) AS ids FROM teams_team) AS t
"""


def load(runs: int, shares: dict[str, int] = SHARES) -> None:
    from django.contrib.auth import get_user_model
    from django.db import connection

    from apps.jobs.models import JobDefinition
    from apps.jobs.schedule import shard_for
    from apps.runs import counters
    from apps.runs.models import PRIORITIES
    from apps.teams.models import Membership, Team

    started = time.perf_counter()
    with connection.cursor() as cursor:
        cursor.execute(
            "TRUNCATE runs_minutecounts, runs_attempt, runs_run, jobs_jobdefinition, jobs_queue, audit_auditevent,"
            " teams_membership, teams_apitoken, teams_team, auth_user, django_session CASCADE"
        )
    teams = [Team.objects.create(slug=f"team-{i}", name=f"Team {i}") for i in range(TEAMS)]
    priorities = list(PRIORITIES.values())
    JobDefinition.objects.bulk_create(
        JobDefinition(
            team=team,
            name=f"{team.slug}.job-{j:03d}",
            schedule={
                "cron": f"{j % 60} * * * *",
                "timeZone": "Europe/Berlin",
                "jitterSeconds": 30,
                "missedRunPolicy": "run_once",
            },  # fmt: skip
            queue=f"q{j % 4}",
            priority=priorities[j % 3],
            shard=shard_for(f"{team.slug}.job-{j:03d}"),
        )
        for team in teams
        for j in range(DEFINITIONS_PER_TEAM)
    )
    with connection.cursor() as cursor:
        cursor.execute(INSERT_RUNS, {"n": runs, **failure_params(), **share_cuts(shares, runs)})
        cursor.execute(INSERT_ATTEMPTS)
        # The per-minute counters the claim and completion statements would have written.
        cursor.execute(counters.REBUILD, {"hours": counters.KEEP_HOURS})
        cursor.execute("SELECT setval('runs_fencing_token', %s)", [runs + 1])
        cursor.execute(INSERT_AUDIT, {"n": AUDIT_EVENTS})
        # What autovacuum does to a table in steady state (statistics, visibility map).
        cursor.execute("VACUUM ANALYZE")
    users = get_user_model().objects
    users.create_superuser("bench-staff", password="bench")
    operator = users.create_user("bench-operator", password="bench")
    Membership.objects.create(user=operator, team=teams[0], role="editor")
    print(f"loaded {runs} runs in {time.perf_counter() - started:.1f} s")


def screens() -> dict[str, str]:
    from apps.runs.models import Run

    dead = Run.objects.filter(state="dead", team__slug="team-0").order_by("-pk").first()
    return {
        "overview": "/",
        "failures": "/failures",
        "failures, error text": "/failures?error=request+4242",
        "failures, grouped": "/failures?view=groups",
        "dlq, grouped": "/dlq?view=groups",
        "failures, page 2": f"/failures?cursor={dead.run_id}",
        "runs": "/runs",
        "runs, state=ready": "/runs?state=ready",
        "runs, job filter": "/runs?job=team-0.job-007",
        "dlq": "/dlq",
        "run detail": f"/runs/{dead.run_id}",
        "jobs": "/jobs",
        "job detail": "/jobs/team-0.job-007",
        "job edit": "/jobs/team-0.job-007/edit",
        "queues": "/queues",
        "workers": "/workers",
        "late & missed": "/alerts",
        "team (channels)": "/teams/team-0",
        "audit": "/audit",
    }


def take_census() -> None:
    """What a running scheduler does every SCHEDULER_CENSUS_SECONDS (apps/runs/census.py): the
    pages read the census when there are more runs than SCHEDULER_LIVE_COUNT_LIMIT to count. Taken
    before each screen, outside the timings, so that it is never older than one period."""
    from apps.runs import census

    census.take()


def measure(username: str, requests: int) -> list[tuple[str, float, float, int]]:
    from django.contrib.auth import get_user_model
    from django.db import connection
    from django.test import Client
    from django.test.utils import CaptureQueriesContext

    # An allowed host of the settings (the test client's default `testserver` is refused).
    client = Client(HTTP_HOST="localhost")
    client.force_login(get_user_model().objects.get(username=username))
    rows = []
    for name, path in screens().items():
        if name.startswith("team") and client.get(path).status_code == 403:
            continue  # a team's page is its admins' (the superuser's row measures it)
        take_census()
        for _ in range(3):  # warm the plan and template caches
            assert client.get(path).status_code == 200, path
        timings = []
        for _ in range(requests):
            start = time.perf_counter()
            response = client.get(path)
            timings.append((time.perf_counter() - start) * 1000)
            assert response.status_code == 200, path
        with CaptureQueriesContext(connection) as queries:
            client.get(path)
        timings.sort()
        p95 = timings[min(len(timings) - 1, int(round(0.95 * (len(timings) - 1))))]
        rows.append((name, statistics.median(timings), p95, len(queries)))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=100_000)
    parser.add_argument("--requests", type=int, default=15)
    parser.add_argument("--database-url", default=os.environ.get("BENCH_DATABASE_URL", DEFAULT_URL))
    parser.add_argument("--keep", action="store_true", help="reuse the data of the last run")
    args = parser.parse_args()

    ensure_database(args.database_url)
    setup_django(args.database_url)
    from django.core.management import call_command

    call_command("migrate", verbosity=0)
    if not args.keep:
        load(args.runs)
    worst = 0.0
    for username, who in (
        ("bench-staff", "superuser, 5 teams"),
        ("bench-operator", "editor, 1 team"),
    ):
        print(f"\n{who}: {args.requests} requests per screen, server time in ms")
        print(f"{'screen':<24}{'median':>9}{'p95':>9}{'queries':>9}")
        for name, median, p95, queries in measure(username, args.requests):
            worst = max(worst, p95)
            print(f"{name:<24}{median:>9.1f}{p95:>9.1f}{queries:>9}")
    verdict = "within" if worst < TARGET_MS else "OVER"
    print(f"\nslowest p95: {worst:.1f} ms — {verdict} the {TARGET_MS} ms target")


if __name__ == "__main__":
    main()
