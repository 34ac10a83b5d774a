"""The census (apps/runs/census.py): the scheduler's count of each shard database's runs, read by
the overview and queues pages instead of counting when their teams have more runs than
SCHEDULER_LIVE_COUNT_LIMIT; the same figures as a live count, never another team's, never stale past
three periods."""

from __future__ import annotations

from datetime import timedelta

import pytest

from apps.dashboard import queries
from apps.jobs import triage
from apps.runs import census, depth, shards, store
from apps.runs.filters import BulkFilter
from apps.runs.models import Census, Run
from apps.scheduler.daemon import Scheduler
from tests.conftest import (
    add_ready_runs,
    claim,
    db_now,
    everywhere,
    make_definition,
    names_on_one_database,
)
from tests.dashboard.conftest import client_for, failed_runs, make_user
from tests.runs.test_claim_concurrency import run_in_threads
from tests.triage_runs import insert_failed

# The tests of what each shard database does apart also run with shards on servers of their own.
pytestmark = pytest.mark.django_db(transaction=True, databases="__all__")

EVERYTHING = BulkFilter(everything=True)


def take_everywhere() -> None:
    for alias in shards.databases():
        with shards.using(alias):
            census.take()


def mixed_runs(team, name: str) -> None:
    """Runs of `team` in every state the census counts: ready, scheduled, leased, retrying,
    dead, cancelled, and one succeeded (not counted)."""
    job = make_definition(team, name, queue=f"{name}-q", retry_max_attempts=3)
    ids = add_ready_runs(job, 9, prefix=name)
    with shards.using(shards.alias_of_shard(job.shard)):
        Run.objects.filter(pk=ids[0]).update(available_at=db_now() + timedelta(hours=1))
        Run.objects.filter(pk=ids[-1]).update(state="cancelled")
    leased = claim(queues=[f"{name}-q"], max_runs=2, worker_id="w", team_ids=[team.pk])
    store.complete([(leased[0].id, leased[0].fencing_token, None)], team_ids=[team.pk])
    failing = make_definition(team, f"{name}.failing", queue=f"{name}-f", retry_max_attempts=3)
    failed_runs(failing, 2, retryable=True, prefix=f"{name}-r")
    failed_runs(failing, 3, prefix=f"{name}-d")


@pytest.mark.shards
def test_the_census_counts_what_a_live_count_counts(team_a, team_b, settings):
    mixed_runs(team_a, "alpha")
    mixed_runs(team_b, "beta")
    live = queries.overview([team_a.pk], db_now())
    assert live.counted_at is None
    assert {s: n for s, n in live.counts.items() if s != "succeeded"} == {
        "ready": 5, "scheduled": 1, "leased": 1, "retrying": 2, "dead": 3, "cancelled": 1,
    }  # fmt: skip
    take_everywhere()
    settings.SCHEDULER_LIVE_COUNT_LIMIT = 0
    counted = queries.overview([team_a.pk], db_now())
    assert counted.counted_at is not None
    assert counted.counts == live.counts
    assert (counted.dlq, counted.failing, counted.to_retry) == (3, 5, 2)
    strip = ("oldest_age",)  # by the clock of each reading
    assert [{k: v for k, v in lane.items() if k not in strip} for lane in counted.queues] == [
        {k: v for k, v in lane.items() if k not in strip} for lane in live.queues
    ]
    assert {lane["team_id"] for lane in counted.queues} == {team_a.pk}


@pytest.mark.shards
def test_pages_count_live_up_to_the_limit_and_read_the_census_above_it(team_a, settings):
    settings.SCHEDULER_LIVE_COUNT_LIMIT = 5
    job = make_definition(team_a, "census.job", queue="counted")
    add_ready_runs(job, 4, prefix="a")
    take_everywhere()
    add_ready_runs(job, 3, prefix="b")
    # The census holds 4 runs of the team, within the limit: counted on each load.
    stats = queries.overview([team_a.pk], db_now())
    assert stats.counts["ready"] == 7 and stats.counted_at is None

    take_everywhere()  # 7 runs: over the limit
    add_ready_runs(job, 2, prefix="c")
    stats = queries.overview([team_a.pk], db_now())
    assert stats.counts["ready"] == 7 and stats.counted_at is not None
    assert [lane["ready"] for lane in stats.queues] == [7]
    rows, counted_at = queries.queues([team_a], db_now())
    assert [row.ready for row in rows] == [7] and counted_at == stats.counted_at

    viewer = make_user("census-viewer", team_a, "viewer")
    for page in ("/", "/queues"):
        body = client_for(viewer).get(page).content.decode()
        assert 'id="counted-at"' in body and "the scheduler counts them every" in body, page

    settings.SCHEDULER_LIVE_COUNT_LIMIT = 100
    assert queries.overview([team_a.pk], db_now()).counts["ready"] == 9
    assert 'id="counted-at"' not in client_for(viewer).get("/").content.decode()


def test_a_census_older_than_three_periods_is_not_used(team_a, settings):
    settings.SCHEDULER_LIVE_COUNT_LIMIT = 0
    settings.SCHEDULER_CENSUS_SECONDS = 15
    job = make_definition(team_a, "census.stale", queue="stale")
    add_ready_runs(job, 2, prefix="a")
    take_everywhere()
    add_ready_runs(job, 1, prefix="b")
    assert queries.overview([team_a.pk], db_now()).counts["ready"] == 2
    everywhere("UPDATE runs_census SET taken_at = now() - interval '44 seconds'")
    assert queries.overview([team_a.pk], db_now()).counts["ready"] == 2
    everywhere("UPDATE runs_census SET taken_at = now() - interval '46 seconds'")
    stats = queries.overview([team_a.pk], db_now())
    assert stats.counts["ready"] == 3 and stats.counted_at is None
    # A census that took 3 s is taken once a minute: it stands for three minutes.
    everywhere("UPDATE runs_census SET taken_at = now() - interval '170 seconds', seconds = 3")
    assert queries.overview([team_a.pk], db_now()).counts["ready"] == 2


def test_a_census_that_takes_long_is_taken_less_often(settings):
    settings.SCHEDULER_CENSUS_SECONDS = 15
    assert census.period(0.2) == 15
    assert census.period(2.0) == 40  # counting stays under 5 % of the time


@pytest.mark.shards
def test_the_scheduler_takes_each_databases_census_once_a_period(team_a, settings):
    settings.SCHEDULER_CENSUS_SECONDS = 3600
    job = make_definition(team_a, "census.tick", queue="tick")
    add_ready_runs(job, 3)
    everywhere("DELETE FROM runs_census")
    node = Scheduler(node_id="census-node", lease_seconds=10)
    try:
        first = node.tick()
        assert set(first.counted) == set(shards.databases())
        with shards.using(shards.alias_of_shard(job.shard)):
            assert Census.objects.filter(seconds__gt=0).exists()
        assert node.tick().counted == []  # not due again for an hour
        settings.SCHEDULER_LIVE_COUNT_LIMIT = 0
        assert queries.overview([team_a.pk], db_now()).counts["ready"] == 3
        assert queries.overview([team_a.pk], db_now()).counted_at is not None
    finally:
        node.leave()


def test_only_the_holder_of_a_databases_first_shard_counts_it(team_a, settings):
    node = Scheduler(node_id="census-other", lease_seconds=10)
    first_shards = {min(shards.shards_on(alias)) for alias in shards.databases()}
    node.held = {shard: 1 for shard in range(settings.SCHEDULER_SHARD_COUNT)}
    for shard in first_shards:
        node.held.pop(shard)
    node.handle_one_census()
    assert node.report.counted == []


def test_failures_grouped_without_a_filter_read_the_census_above_the_limit(
    team_a, team_b, settings
):
    charge = make_definition(team_a, "census.charge", queue="billing")
    refund = make_definition(team_a, "census.refund", queue="billing")
    keyed = insert_failed(charge, 6)
    insert_failed(refund, 3, state="retrying")
    insert_failed(charge, 2, error_type="TimeoutError", message="after %s s")
    insert_failed(make_definition(team_b, "census.theirs", queue="search"), 9)
    states = ["retrying", "dead"]

    def shown(grouping: triage.Grouping) -> list[tuple]:
        return [
            (g.fingerprint, g.count, g.jobs, g.shares, g.first_at, g.last_at, g.latest)
            for g in grouping.groups
        ]

    live = triage.groups([team_a.pk], states, EVERYTHING)
    assert live.counted_at is None and (live.total_groups, live.total_runs) == (2, 11)
    take_everywhere()
    insert_failed(charge, 4, prefix="after-")  # after the census
    settings.SCHEDULER_LIVE_COUNT_LIMIT = 10
    counted = triage.groups([team_a.pk], states, EVERYTHING)
    assert counted.counted_at is not None and shown(counted) == shown(live)
    assert counted.groups[0].fingerprint == keyed and counted.groups[0].sample is not None
    # A filter is counted live; so are fewer runs than the limit.
    filtered = triage.groups([team_a.pk], states, BulkFilter(job="census.charge"))
    assert filtered.counted_at is None and filtered.groups[0].count == 10
    assert triage.groups([team_a.pk], ["retrying"], EVERYTHING).counted_at is None

    viewer = make_user("census-groups", team_a, "viewer")
    body = client_for(viewer).get("/failures?view=groups").content.decode()
    assert 'id="counted-at"' in body and "11 runs in 2 error groups" in body


@pytest.mark.shards
def test_two_nodes_taking_a_census_at_once_leave_one(team_a, settings):
    """During a handover two nodes may both hold a database's first shard for a moment."""
    twice, failed = names_on_one_database("census.twice", 2)
    job = make_definition(team_a, twice, queue="twice")
    add_ready_runs(job, 5)
    failed_runs(make_definition(team_a, failed, queue="failed"), 2)
    alias = shards.alias_of_shard(job.shard)

    def take(_: int) -> None:
        with shards.using(alias):
            for _ in range(10):
                census.take()

    run_in_threads(4, take)
    settings.SCHEDULER_LIVE_COUNT_LIMIT = 0
    with shards.using(alias):
        counted = census.here([team_a.pk])
        groups = census.failure_groups_here([team_a.pk], ["dead"])
    assert counted.taken_at is not None
    assert sum(c.due for c in counted.counts if c.queue == "twice") == 5
    assert groups is not None and [row[2:4] for row in groups[0]] == [("dead", 2)]


@pytest.mark.shards
def test_the_gauges_and_readiness_read_the_census_above_the_limit(team_a, settings):
    job = make_definition(team_a, "census.gauge", queue="gauge", priority="bulk")
    add_ready_runs(job, 4, prefix="a")
    take_everywhere()
    add_ready_runs(job, 2, prefix="b")

    def gauge() -> tuple[int, int, float | None]:
        lanes, per_database = depth.claimable_by_database()
        (lane,) = [lane for lane in lanes if lane.queue == "gauge"]
        return lane.ready, sum(n or 0 for n in per_database.values()), lane.oldest_age

    assert gauge()[:2] == (6, 6)  # 4 in the census, within the limit: counted now
    settings.SCHEDULER_LIVE_COUNT_LIMIT = 3
    ready, total, age = gauge()
    assert (ready, total) == (4, 4) and age is not None and age > 0


@pytest.mark.parametrize(
    ("why", "breaking", "mending"),
    [
        # A shard database not yet migrated (a deploy under way).
        (
            "unmigrated",
            "ALTER TABLE runs_census RENAME TO runs_census_away",
            "ALTER TABLE runs_census_away RENAME TO runs_census",
        ),
        # A refused commit is an OperationalError, which the census took for its database
        # being down: with one database the whole tick failed, every tick.
        (
            "refused",
            "CREATE FUNCTION refuse_census() RETURNS trigger LANGUAGE plpgsql"
            " AS $$ BEGIN RAISE EXCEPTION 'refused at commit'; END $$;"
            " CREATE CONSTRAINT TRIGGER refuse_census AFTER INSERT OR UPDATE ON runs_census"
            " DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION refuse_census()",
            "DROP TRIGGER refuse_census ON runs_census; DROP FUNCTION refuse_census()",
        ),
    ],
)
def test_a_census_that_fails_fails_no_tick(team_a, settings, why, breaking, mending):
    """The census waits, nothing else: the tick holds every shard, and the pages count live."""
    job = make_definition(team_a, f"census.{why}", queue=why)
    add_ready_runs(job, 2)
    node = Scheduler(node_id=f"census-{why}", lease_seconds=10)
    everywhere(breaking)
    try:
        report = node.tick()
        assert report.counted == [] and sorted(node.held) == list(
            range(settings.SCHEDULER_SHARD_COUNT)
        )
        assert node.tick().counted == []  # not tried again at once
    finally:
        everywhere(mending)
        node.leave()
    assert queries.overview([team_a.pk], db_now()).counts["ready"] == 2
