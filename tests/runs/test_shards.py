"""Shards on databases of their own: the map, run ids that name their shard, the router, and
`manage.py migrate` preparing every database."""

from __future__ import annotations

import psycopg
import pytest

from apps.jobs.schedule import shard_for
from apps.runs import shards
from apps.runs.models import Run
from apps.runs.store import NewRun, insert_runs
from scheduler_site.shardmap import ShardMapError, parse, render
from tests.conftest import child_database_url, make_definition, manage
from tests.servers import postgres_servers

CONTROL = "postgresql://control/db"
A = "postgresql://db-a/sched"
B = "postgresql://db-b/sched"


def test_the_map_places_each_range_on_its_database_and_names_each_database_once():
    found = parse(f" 0-7={A} ; 8-13={B};14={CONTROL}; 15={A}", 16, CONTROL)
    assert found.aliases == ("shards_1",) * 8 + ("shards_2",) * 6 + ("default", "shards_1")
    assert found.urls == {"shards_1": A, "shards_2": B}
    assert found.physical
    assert parse(render(found.aliases, {**found.urls, "default": CONTROL}), 16, CONTROL) == found


def test_without_a_map_every_shard_is_on_the_control_database():
    found = parse("  ", 16, CONTROL)
    assert found.aliases == ("default",) * 16 and not found.physical


@pytest.mark.parametrize(
    ("text", "says"),
    [
        (f"0-7={A}", "Shards 8-15 are on no database"),
        (f"0-8={A};8-15={B}", "Shard 8 is placed twice"),
        ("0-15=mysql://x/y", "must start with postgresql://"),
        (f"0-16={A}", "not a range of shards 0-15"),
        (f"7-0={A}", "not a range of shards 0-15"),
        (f"a-b={A}", "is not RANGE=URL"),
        (A, "is not RANGE=URL"),
        (f"0-3={A};5-15={B}", "Shards 4 are on no database"),
    ],
)
def test_a_map_that_does_not_place_every_shard_once_is_refused_with_its_reason(text, says):
    with pytest.raises(ShardMapError, match=says):
        parse(text, 16, CONTROL)


def test_shards_are_named_by_the_ranges_they_make_gaps_and_all():
    from scheduler_site.shardmap import ranges

    assert ranges([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8"
    assert ranges([12]) == "12" and ranges(list(range(16))) == "0-15"
    # After moves: what a database holds is said as it is, not from its first to its last.
    assert ranges([6, 8, 9, 10, 11, 13, 14, 15]) == "6,8-11,13-15"


def test_a_bad_map_stops_the_process_at_start_with_the_settings_name():
    out = manage("check", SCHEDULER_SHARD_DATABASES=f"0-7={A}")
    assert out.returncode != 0
    assert "SCHEDULER_SHARD_DATABASES: Shards 8-15 are on no database" in out.stderr


@pytest.mark.django_db
def test_a_run_id_names_its_shard_however_the_run_was_made(team_a):
    names = ["billing.export", "reports.daily", "mail.digest", "search.reindex"]
    definitions = [make_definition(team_a, name) for name in names]
    inserted = insert_runs(
        [NewRun(d.pk, "api", d.created_at, d.created_at, f"k-{d.pk}") for d in definitions]
    )
    made = Run.objects.create(
        definition=definitions[0], team=team_a, queue="q", priority=1,
        shard=definitions[0].shard, trigger="api", due_at=definitions[0].created_at,
        available_at=definitions[0].created_at, max_attempts=1, idempotency_key="orm",
    )  # fmt: skip
    runs = Run.objects.filter(pk__in=[*inserted, made.pk])
    assert len(runs) == 5
    for run in runs:
        assert shards.shard_of_run(run.pk) == run.shard == shard_for(run.definition.name)
        assert shards.alias_of_run(run.pk) == "default"
    assert len({run.shard for run in runs}) > 1  # the names spread over shards


def test_orm_queries_of_sharded_models_go_to_the_database_of_the_block():
    from apps.jobs.models import JobDefinition
    from apps.teams.models import Team

    assert Run.objects.all().db == "default"
    with shards.using("shards_2"):
        assert Run.objects.all().db == "shards_2"
        assert JobDefinition.objects.all().db == "shards_2"
        assert Team.objects.all().db == "default"  # the control database's
        assert shards.current() == "shards_2"
    assert shards.current() == "default"


@pytest.mark.slow
@pytest.mark.django_db
def test_migrate_prepares_the_control_database_and_every_shard_database(team_a):
    with postgres_servers(2) as servers:
        a, b = (server.url for server in servers)
        control = child_database_url()
        shard_map = f"0-5={a};6-10={control};11-15={b}"
        out = manage("migrate", "--no-input", timeout=300, SCHEDULER_SHARD_DATABASES=shard_map)
        assert out.returncode == 0, out.stderr
        assert "Shard database shards_1:" in out.stdout
        assert "Shard database shards_2:" in out.stdout
        for url in (a, b):
            with psycopg.connect(url) as conn:
                applied = {
                    tuple(row)
                    for row in conn.execute("SELECT app, name FROM django_migrations").fetchall()
                }
                assert ("runs", "0012_teams_in_the_control_database") in applied
                assert ("jobs", "0006_teams_in_the_control_database") in applied
                # No key of a shard's rows points into the control database's tables.
                foreign = conn.execute(
                    "SELECT conrelid::regclass::text, confrelid::regclass::text"
                    " FROM pg_constraint WHERE contype = 'f'"
                    " AND conrelid::regclass::text IN"
                    " ('runs_run', 'runs_attempt', 'runs_minutecounts', 'jobs_jobdefinition')"
                ).fetchall()
                assert all(target in {"runs_run", "jobs_jobdefinition"} for _, target in foreign)
