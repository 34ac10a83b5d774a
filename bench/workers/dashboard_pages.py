"""Server time of every dashboard address (DESIGN.md, "Addresses") with N runs stored.

    DATABASE_URL=… python -m bench.workers.dashboard_pages --runs 100000 --requests 10 --out FILE

Loads 5 teams × 40 definitions and N runs spread over the last 24 hours (70 % succeeded, 8 %
dead, 5 % retrying, 5 % scheduled, 5 % ready, 2 % leased, 5 % cancelled; an attempt for every
started run) and 5 000 audit events, then VACUUM ANALYZE. Each address is requested through
Django's test Client (middleware, view, template; no network) by a signed-in superuser (the
widest view: every team), 2 warm-up requests and then `--requests` timed ones. An address
whose pattern the URLconf does not resolve is skipped with a note.
"""

from __future__ import annotations

import argparse
import json
import time

import django

TEAMS = 5
DEFINITIONS_PER_TEAM = 40

INSERT_RUNS = """
WITH defs AS (SELECT array_agg(id ORDER BY id) AS ids FROM jobs_jobdefinition),
picked AS (
    SELECT g, d.id AS def_id, d.team_id, d.queue, d.priority, d.shard, d.name,
           now() - make_interval(secs => g * 86000.0 / %(n)s) AS due,
           CASE WHEN p < 70 THEN 'succeeded' WHEN p < 78 THEN 'dead' WHEN p < 83 THEN 'retrying'
                WHEN p < 88 THEN 'scheduled' WHEN p < 93 THEN 'ready' WHEN p < 95 THEN 'leased'
                ELSE 'cancelled' END AS state
    FROM generate_series(1, %(n)s) AS g
    CROSS JOIN defs
    JOIN jobs_jobdefinition d ON d.id = defs.ids[1 + g %% array_length(defs.ids, 1)]
    CROSS JOIN LATERAL (SELECT (g / array_length(defs.ids, 1)) %% 100 AS p) AS x
)
INSERT INTO runs_run (
    definition_id, team_id, queue, priority, shard, state, trigger, due_at, available_at,
    attempt, max_attempts, idempotency_key, fencing_token, lease_expires_at, timeout_at,
    lease_seconds, worker_id, dry_run, payload, payload_key, result, last_error, created_at,
    started_at, late_seconds, finished_at
)
SELECT def_id, team_id, queue, priority, shard, state, 'cron', due,
       CASE state WHEN 'scheduled' THEN now() + make_interval(secs => 60 + g %% 3600)
                  WHEN 'retrying' THEN now() + make_interval(secs => 30 + g %% 600)
                  ELSE due END,
       CASE WHEN state IN ('scheduled', 'ready', 'cancelled') THEN 0 ELSE 1 END, 3,
       name || '@' || g,
       CASE WHEN state IN ('scheduled', 'ready', 'cancelled') THEN NULL ELSE g END,
       CASE state WHEN 'leased' THEN now() + interval '60 seconds' END,
       CASE state WHEN 'leased' THEN now() + interval '1 hour' END,
       60, CASE WHEN state IN ('scheduled', 'ready', 'cancelled') THEN '' ELSE 'bench-worker/' || (g %% 50) END,
       false, jsonb_build_object('invoice', g), '', NULL,
       CASE WHEN state IN ('dead', 'retrying') THEN jsonb_build_object(
           'message', 'upstream timed out after 30 s (request ' || g || ')', 'type', 'TimeoutError')
       END,
       due,
       CASE WHEN state IN ('scheduled', 'ready', 'cancelled') THEN NULL ELSE due + interval '1 second' END,
       CASE WHEN state IN ('scheduled', 'ready', 'cancelled') THEN NULL ELSE 1.0 END,
       CASE WHEN state IN ('succeeded', 'dead', 'cancelled') THEN due + interval '4 seconds' END
FROM picked
"""

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
FROM generate_series(1, 5000) AS g
CROSS JOIN (SELECT array_agg(id ORDER BY id) AS ids FROM teams_team) AS t
"""


def load(n: int) -> None:
    from django.contrib.auth import get_user_model
    from django.db import connection

    from apps.jobs.models import PRIORITIES, JobDefinition
    from apps.jobs.schedule import shard_for
    from apps.runs import counters
    from apps.teams.models import Team

    with connection.cursor() as cursor:
        cursor.execute("TRUNCATE runs_minutecounts, runs_attempt, runs_run, jobs_jobdefinition, audit_auditevent CASCADE")
    teams = [Team.objects.get_or_create(slug=f"team-{i}", defaults={"name": f"Team {i}"})[0]
             for i in range(TEAMS)]
    priorities = list(PRIORITIES.values())
    JobDefinition.objects.bulk_create(
        JobDefinition(
            team=team, name=f"{team.slug}.job-{j:03d}",
            schedule={"cron": f"{j % 60} * * * *", "timeZone": "Europe/Berlin", "jitterSeconds": 30},
            queue=f"q{j % 4}", priority=priorities[j % 3], shard=shard_for(f"{team.slug}.job-{j:03d}"),
        )
        for team in teams for j in range(DEFINITIONS_PER_TEAM)
    )
    with connection.cursor() as cursor:
        cursor.execute(INSERT_RUNS, {"n": n})
        cursor.execute(INSERT_ATTEMPTS)
        # The per-minute counters the claim and completion statements would have written.
        cursor.execute(counters.REBUILD, {"hours": counters.KEEP_HOURS})
        cursor.execute("SELECT setval('runs_fencing_token', %s)", [n + 1])
        cursor.execute(INSERT_AUDIT, {})
        cursor.execute("VACUUM ANALYZE")
    users = get_user_model().objects
    if not users.filter(username="bench-staff").exists():
        users.create_superuser("bench-staff", password="bench-password")


def addresses() -> list[tuple[str, str]]:
    from apps.runs.models import Run

    dead = Run.objects.filter(state="dead").order_by("-pk").first()
    run_id = dead.run_id if dead else "run_1"
    job = "team-0.job-007"
    return [
        ("/", "/"),
        ("/failures", "/failures"),
        ("/runs", "/runs"),
        ("/runs?state=ready", "/runs?state=ready"),
        ("/runs?job=<name>", f"/runs?job={job}"),
        ("/runs/<runId>", f"/runs/{run_id}"),
        ("/dlq", "/dlq"),
        ("/jobs", "/jobs"),
        ("/jobs/new", "/jobs/new"),
        ("/jobs/<name>", f"/jobs/{job}"),
        ("/jobs/<name>/edit", f"/jobs/{job}/edit"),
        ("/queues", "/queues"),
        ("/audit", "/audit"),
        ("/teams/<slug>", "/teams/team-0"),
        ("/accounts/login/", "/accounts/login/"),
    ]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=100_000)
    parser.add_argument("--requests", type=int, default=10)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    django.setup()
    from django.contrib.auth import get_user_model
    from django.db import connection
    from django.test import Client
    from django.test.utils import CaptureQueriesContext
    from django.urls import Resolver404, resolve

    started = time.perf_counter()
    load(args.runs)
    loaded = time.perf_counter() - started
    staff = Client()
    staff.force_login(get_user_model().objects.get(username="bench-staff"))
    anonymous = Client()
    pages = []
    for name, path in addresses():
        try:
            resolve(path.split("?")[0])
        except Resolver404:
            pages.append({"page": name, "skipped": "not in the URLconf yet"})
            continue
        client = anonymous if path.startswith("/accounts/login") else staff
        statuses = set()
        for _ in range(2):
            statuses.add(client.get(path).status_code)
        timings = []
        for _ in range(args.requests):
            t = time.perf_counter()
            response = client.get(path)
            timings.append(time.perf_counter() - t)
            statuses.add(response.status_code)
        with CaptureQueriesContext(connection) as queries:
            client.get(path)
        pages.append({"page": name, "path": path, "timings": timings,
                      "statuses": sorted(statuses), "queries": len(queries)})
    with open(args.out, "w") as out:
        json.dump({"runs": args.runs, "load_seconds": loaded, "pages": pages}, out)


if __name__ == "__main__":
    main()
