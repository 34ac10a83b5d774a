"""Materialisation benchmark: N hourly definitions all due in the same minute, one scheduler node.

    python bench/materialise.py [--definitions 100000] [--database-url URL] [--uncached] [--profile]
                                [--no-recreate] [--load-only | --skip-load] [--due-minutes M]
                                [--json PATH]

Uses its own database (default `bench_materialise` on the local server, dropped, created and
migrated on every run), so it never touches the development or test databases.
The definitions are inserted with one set-based INSERT; the timed part is the scheduler's own
step methods (one lease round that takes all 16 shards, then `handle_one_materialise` per shard
until no batch is full), exactly what `manage.py scheduler` runs each tick.

`python -m bench materialise` drives it: `--no-recreate` uses a database that exists (made from
the bench template), `--load-only` loads the definitions (due `--due-minutes` ahead) and exits,
`--skip-load` materialises the definitions already there (a copy of the loaded database, so the
scheduler-daemon, store and raw-SQL variants start from the same rows), `--json PATH` writes the
figures (seconds, runs, CPU of this process and of its PostgreSQL backend, commits).
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys
import time
from pathlib import Path
from urllib.parse import urlparse, urlunparse

REPO = Path(__file__).resolve().parents[1]
DEFAULT_URL = "postgresql://postgres@127.0.0.1:5432/bench_materialise"


def recreate_database(url: str) -> None:
    """Drop and create the benchmark database (connecting to `postgres` to do so).

    A fresh database each run: the schema follows the current migrations even while they change.
    """
    import psycopg
    from psycopg import sql

    parsed = urlparse(url)
    name = sql.Identifier(parsed.path.lstrip("/"))
    admin = urlunparse(parsed._replace(path="/postgres"))
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(name))
        conn.execute(sql.SQL("CREATE DATABASE {}").format(name))


def setup_django(url: str) -> None:
    os.environ["DATABASE_URL"] = url
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "scheduler_site.settings")
    os.environ.setdefault("SCHEDULER_APPLICATION_NAME", "scheduler:bench-materialise")
    os.environ.setdefault("LOG_LEVEL", "WARNING")
    sys.path.insert(0, str(REPO))
    import django

    django.setup()


def load_definitions(count: int, due_minutes: int = 2) -> tuple[object, str]:
    """Empty the tables and insert `count` hourly definitions due at the same minute.

    The minute is two minutes ahead (so loading a million rows cannot make it late) and the
    scheduler runs with a lookahead that covers it. Return (due time, cron).
    """
    from django.db import connection

    from apps.jobs.models import JobDefinition
    from apps.jobs.schedule import shard_for
    from apps.runs.shards import ID_SPACE
    from apps.teams.models import Team

    with connection.cursor() as cursor:
        cursor.execute(
            "TRUNCATE runs_attempt, runs_run, jobs_jobdefinition, scheduler_shardlease,"
            " scheduler_schedulernode CASCADE"
        )
        cursor.execute(
            "SELECT date_trunc('minute', now()) + make_interval(mins => %s)", [due_minutes]
        )
        due = cursor.fetchone()[0]
    team = Team.objects.get_or_create(slug="bench", defaults={"name": "Bench"})[0]
    cron = f"{due.minute} * * * *"
    # One row made by the ORM (so every column has its model default), copied N times by one
    # INSERT … SELECT with only the name and shard changed.
    template = JobDefinition.objects.create(
        name="bench.template",
        team=team,
        schedule={"cron": cron, "timeZone": "UTC", "jitterSeconds": 60},
        queue="bench",
        next_due_at=due,
    )
    names = [f"bench.hourly-{i:07d}" for i in range(count)]
    shards = [shard_for(name) for name in names]
    quote = connection.ops.quote_name
    # Keys as the product makes them (apps/runs/shards.py `next_id`): the sequence's value
    # times ID_SPACE plus the shard; the column's plain default would meet the template's key.
    columns = [f.column for f in JobDefinition._meta.concrete_fields]
    picked = {
        "id": f"nextval(pg_get_serial_sequence('jobs_jobdefinition', 'id')) * {ID_SPACE} + u.shard",
        "name": "u.name",
        "shard": "u.shard",
    }
    with connection.cursor() as cursor:
        cursor.execute(
            f"""
            INSERT INTO jobs_jobdefinition ({", ".join(quote(c) for c in columns)})
            SELECT {", ".join(picked.get(c, "t." + quote(c)) for c in columns)}
            FROM jobs_jobdefinition t
            CROSS JOIN unnest(%(names)s::text[], %(shards)s::int[]) AS u(name, shard)
            WHERE t.id = %(template)s
            """,
            {"names": names, "shards": shards, "template": template.pk},
        )
        cursor.execute("DELETE FROM jobs_jobdefinition WHERE id = %s", [template.pk])
        cursor.execute("VACUUM ANALYZE jobs_jobdefinition")
    return due, cron


def disable_plan_cache() -> None:
    """Plan every definition on its own, as if no two shared a schedule and a due time."""
    from apps.scheduler import materialiser

    class NoSharing(materialiser._PlanCache):
        def plan(self, name, raw, due_at):  # type: ignore[no-untyped-def]
            self._plans.clear()
            return super().plan(name, raw, due_at)

    materialiser._PlanCache = NoSharing  # type: ignore[misc]


def materialise_all(batch: int) -> tuple[float, int]:
    """Run the scheduler's steps over all 16 shards; return (seconds, definitions handled)."""
    from apps.scheduler.daemon import Scheduler

    scheduler = Scheduler(node_id="bench", lookahead_seconds=300, batch=batch)
    scheduler.read_clock()
    scheduler.handle_one_lease_round()
    assert len(scheduler.held) == scheduler.shard_count, scheduler.held
    started = time.perf_counter()
    for shard in sorted(scheduler.held):
        while True:
            scheduler.handle_one_renewal()
            if not scheduler.handle_one_materialise(shard):
                break
    elapsed = time.perf_counter() - started
    handled = scheduler.report.materialised
    scheduler.leave()
    return elapsed, handled


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--definitions", type=int, default=100_000)
    parser.add_argument("--batch", type=int, default=5000)
    parser.add_argument("--database-url", default=os.environ.get("BENCH_DATABASE_URL", DEFAULT_URL))
    parser.add_argument(
        "--uncached",
        action="store_true",
        help="plan every definition separately (no sharing of identical schedules)",
    )
    parser.add_argument("--profile", action="store_true", help="print the top of a cProfile")
    parser.add_argument("--no-recreate", action="store_true", help="use the database as it is")
    parser.add_argument("--load-only", action="store_true", help="load the definitions, exit")
    parser.add_argument("--json", help="write the figures to this file")
    parser.add_argument(
        "--skip-load", action="store_true", help="use the definitions already in the database"
    )
    parser.add_argument(
        "--due-minutes", type=int, default=2, help="how far ahead the definitions fall due"
    )
    args = parser.parse_args()

    if not args.no_recreate:
        recreate_database(args.database_url)
    setup_django(args.database_url)
    from django.core.management import call_command
    from django.db import connection

    call_command("migrate", verbosity=0)
    if args.uncached:
        disable_plan_cache()

    load_started = time.perf_counter()
    if args.skip_load:
        with connection.cursor() as cursor:
            cursor.execute("SELECT min(next_due_at), count(*) FROM jobs_jobdefinition")
            due, loaded = cursor.fetchone()
        assert loaded == args.definitions, (loaded, args.definitions)
    else:
        due, cron = load_definitions(args.definitions, args.due_minutes)
        print(
            f"loaded {args.definitions} definitions ({cron!r}, all due {due.isoformat()}) "
            f"in {time.perf_counter() - load_started:.1f}s"
        )

    if args.load_only:
        return

    before = _usage(connection)
    profiler = cProfile.Profile() if args.profile else None
    if profiler:
        profiler.enable()
    elapsed, handled = materialise_all(args.batch)
    if profiler:
        profiler.disable()
    after = _usage(connection)

    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*), count(DISTINCT definition_id) FROM runs_run")
        runs, definitions = cursor.fetchone()
        cursor.execute(
            "SELECT count(*) FROM jobs_jobdefinition WHERE next_due_at = %s + interval '1 hour'",
            [due],
        )
        advanced = cursor.fetchone()[0]
    assert runs == definitions == advanced == handled == args.definitions, (
        runs,
        definitions,
        advanced,
        handled,
    )
    mode = "uncached plans" if args.uncached else "shared plans"
    print(
        f"materialised {runs} runs for {handled} definitions in {elapsed:.2f}s "
        f"({runs / elapsed:,.0f} runs/s, batch {args.batch}, {mode})"
    )
    if args.json:
        import json

        Path(args.json).write_text(
            json.dumps(
                {
                    "seconds": elapsed,
                    "runs": runs,
                    "cpu_s_python": after["python"] - before["python"],
                    "cpu_s_backend": after["backend"] - before["backend"],
                    # Less the two reading transactions of _usage itself.
                    "commits": after["commits"] - before["commits"] - 2,
                    "rss_mb": {"scheduler": after["rss_python"], "postgres": after["rss_backend"]},
                }
            )
        )
    if profiler:
        pstats.Stats(profiler).sort_stats("cumulative").print_stats(25)


def _usage(connection) -> dict[str, float]:
    """CPU seconds of this process and of its backend, and the database's commits so far."""
    import resource

    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_backend_pid(), pg_stat_force_next_flush()")
        pid = cursor.fetchone()[0]
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()"
        )
        commits = cursor.fetchone()[0]
    ticks = os.sysconf("SC_CLK_TCK")
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    status = Path(f"/proc/{pid}/status").read_text()
    rss_backend = int(
        next(line for line in status.splitlines() if line.startswith("VmRSS")).split()[1]
    )
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return {
        "python": usage.ru_utime + usage.ru_stime,
        "backend": (int(fields[11]) + int(fields[12])) / ticks,
        "commits": commits,
        "rss_python": usage.ru_maxrss / 1024,
        "rss_backend": rss_backend / 1024,
    }


if __name__ == "__main__":
    main()
