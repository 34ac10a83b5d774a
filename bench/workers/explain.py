"""EXPLAIN (ANALYZE, BUFFERS) of every statement store.claim and store.complete run, and the raw ones.

    DATABASE_URL=… python -m bench.workers.explain --batch 100

Runs `store.claim` and then `store.complete` on what it leased, against the backlog already in
the database, inside a transaction that is rolled back. A Django execute wrapper runs each of
their statements first as `EXPLAIN (ANALYZE, BUFFERS)` inside a savepoint that is rolled back,
then for real, so the plans are of exactly what the current code executes (whatever another
engineer has just changed) with the same parameters. Then the raw ceiling's claim and complete.
"""

from __future__ import annotations

import argparse

import django


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=100)
    args = parser.parse_args()
    django.setup()
    from django.db import connection, transaction

    from apps.runs import store
    from apps.teams.models import Team
    from bench.common import JOB, QUEUE
    from bench.workers import raw_worker

    team = Team.objects.get(slug="bench").pk

    def explain(title: str, sql: str, params: dict) -> list:
        with connection.cursor() as cursor:
            cursor.execute("EXPLAIN (ANALYZE, BUFFERS, VERBOSE OFF) " + sql, params)
            plan = [row[0] for row in cursor.fetchall()]
        print(f"\n=== {title} ===")
        print("\n".join(plan))
        return plan

    captured: list[tuple[str, list[str]]] = []

    def explain_first(execute, sql, params, many, context):
        head = sql.lstrip().split(None, 1)[0].upper() if sql.strip() else ""
        if head in ("SELECT", "WITH", "UPDATE", "INSERT", "DELETE") and not many:
            raw = context["cursor"].cursor
            raw.execute("SAVEPOINT bench_explain")
            raw.execute("EXPLAIN (ANALYZE, BUFFERS) " + sql, params)
            captured.append((sql, [row[0] for row in raw.fetchall()]))
            raw.execute("ROLLBACK TO SAVEPOINT bench_explain")
        return execute(sql, params, many, context)

    with transaction.atomic():
        with connection.execute_wrapper(explain_first):
            leases = store.claim(
                queues=[QUEUE],
                max_runs=args.batch,
                worker_id="explain",
                lease_seconds=60,
                team_ids=[team],
            )
            calls = [("store.claim", len(captured))]
            store.complete(
                [(lease.id, lease.fencing_token, None) for lease in leases], team_ids=[team]
            )
            calls.append(("store.complete", len(captured)))
        transaction.set_rollback(True)
    first = 0
    for name, last in calls:
        for number, (sql, plan) in enumerate(captured[first:last], 1):
            summary = " ".join(sql.split())[:160]
            print(f"\n=== {name} ({len(leases)} runs), statement {number}: {summary} …")
            print("\n".join(plan))
        first = last

    with transaction.atomic():
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT team_id, priority FROM jobs_jobdefinition WHERE name = %s", [JOB]
            )
            team_id, priority = cursor.fetchone()
        lane = {"team": team_id, "queue": QUEUE, "priority": priority}
        claim = raw_worker.CLAIM.format(attempts=raw_worker.INSERT_ATTEMPTS)
        explain(f"raw claim ({args.batch})", claim, {**lane, "n": args.batch, "worker": "explain"})
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT id, fencing_token FROM runs_run WHERE state = 'leased' AND worker_id = 'explain'"
            )
            leased = cursor.fetchall()
        explain(
            f"raw complete ({len(leased)})",
            raw_worker.COMPLETE.format(attempts=raw_worker.END_ATTEMPTS),
            {"ids": [i for i, _ in leased], "tokens": [t for _, t in leased]},
        )
        transaction.set_rollback(True)


if __name__ == "__main__":
    main()
