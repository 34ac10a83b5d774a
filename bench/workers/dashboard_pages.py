"""Server time of every dashboard address (README, "Dashboard") with N runs stored.

    DATABASE_URL=… python -m bench.workers.dashboard_pages --runs 100000 --requests 10 --out FILE

Loads the data of bench/dashboard.py (5 teams × 40 definitions, N runs spread over the last
24 hours in every state, an attempt for every started run, the per-minute counters, 5 000 audit
events, then VACUUM ANALYZE). Each address is requested through
Django's test Client (middleware, view, template; no network) by a signed-in superuser (the
widest view: every team), 2 warm-up requests and then `--requests` timed ones. An address
whose pattern the URLconf does not resolve is skipped with a note.
"""

from __future__ import annotations

import argparse
import json
import time

import django

from bench.dashboard import load  # the same data as the per-screen benchmark


def addresses() -> list[tuple[str, str]]:
    from apps.runs.models import Run

    dead = Run.objects.filter(state="dead").order_by("-pk").first()
    run_id = dead.run_id if dead else "run_1"
    job = "team-0.job-007"
    return [
        ("/", "/"),
        ("/failures", "/failures"),
        ("/failures?view=groups", "/failures?view=groups"),
        ("/runs", "/runs"),
        ("/runs?state=ready", "/runs?state=ready"),
        ("/runs?job=<name>", f"/runs?job={job}"),
        ("/runs/<runId>", f"/runs/{run_id}"),
        ("/dlq", "/dlq"),
        ("/dlq?view=groups", "/dlq?view=groups"),
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
    # An allowed host of the settings (the test client's default `testserver` is refused).
    staff = Client(HTTP_HOST="localhost")
    staff.force_login(get_user_model().objects.get(username="bench-staff"))
    anonymous = Client(HTTP_HOST="localhost")
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
        pages.append(
            {
                "page": name,
                "path": path,
                "timings": timings,
                "statuses": sorted(statuses),
                "queries": len(queries),
            }
        )
    with open(args.out, "w") as out:
        json.dump({"runs": args.runs, "load_seconds": loaded, "pages": pages}, out)


if __name__ == "__main__":
    main()
