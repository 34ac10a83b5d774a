"""Claim floors (apps/runs/floors.py): while another session holds an old snapshot, a lane's
next claim starts past the last run this process leased there instead of walking the entries of
every run claimed since; a run left behind a floor waits at most FLOOR_SECONDS more; floors
stay LINGER_SECONDS after the snapshot ends; without an old snapshot there is no floor at
all."""

from __future__ import annotations

import time
from collections.abc import Iterator
from datetime import timedelta

import pytest
from django.db import connection, transaction

from apps.runs import floors as floors_module
from apps.runs import store
from apps.runs.floors import floors
from tests.conftest import add_ready_runs, db_now, make_definition, other_session

pytestmark = pytest.mark.django_db(transaction=True)

HELD = 0.5  # seconds: "an old snapshot", for the tests
LINGER = 1.0  # seconds: floors kept after it ends, for the tests


@pytest.fixture(autouse=True)
def quick_floors(monkeypatch) -> Iterator[None]:
    monkeypatch.setattr(floors_module, "HELD_SNAPSHOT_SECONDS", HELD)
    monkeypatch.setattr(floors_module, "CHECK_SECONDS", 0.0)
    monkeypatch.setattr(floors_module, "LINGER_SECONDS", LINGER)
    floors.__init__()
    yield
    floors.__init__()


@pytest.fixture
def old_snapshot() -> Iterator[None]:
    with other_session() as session:
        session.execute("SELECT txid_current()")
        time.sleep(HELD + 0.1)
        yield


def claim(team, count: int = 100) -> list[store.Lease]:
    return store.claim(
        queues=["q"], max_runs=count, worker_id="w", lease_seconds=60, team_ids=[team.pk]
    )


def claimable_entries_read(action) -> tuple[int, list]:
    """Entries `action` read from run_claimable, counted in its own transaction."""
    query = "SELECT pg_stat_get_xact_tuples_returned('run_claimable'::regclass)"
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute(query)
        before = cursor.fetchone()[0]
        found = action()
        cursor.execute(query)
        return cursor.fetchone()[0] - before, found


def lease_and_finish(team, count: int) -> None:
    for _ in range(count // 100):
        leases = claim(team)
        store.complete([(x.id, x.fencing_token, None) for x in leases], team_ids=[team.pk])


def made_older() -> int:
    """The newest waiting run, made claimable with an availableAt an hour back, older than any
    floor (as a catch-up run is); its id."""
    with connection.cursor() as cursor:
        cursor.execute(
            "UPDATE runs_run SET available_at = %s WHERE id = ("
            " SELECT id FROM runs_run WHERE state = 'scheduled' ORDER BY available_at DESC"
            " LIMIT 1) RETURNING id",
            [db_now() - timedelta(hours=1)],
        )
        return cursor.fetchone()[0]


def test_with_an_old_snapshot_a_claim_starts_past_the_runs_claimed_before(team_a, old_snapshot):
    add_ready_runs(make_definition(team_a, "floor.job", queue="q"), 1100)
    lease_and_finish(team_a, 1000)  # their entries stay in run_claimable: vacuum cannot drop them
    read, leases = claimable_entries_read(lambda: claim(team_a))
    assert len(leases) == 100
    assert read <= 150, read  # the batch and a few, not the 1 000 entries behind the floor


def test_without_a_floor_the_claim_walks_every_entry_behind_it(team_a, old_snapshot, monkeypatch):
    """The same claim with floors kept off (the check never sees an old snapshot): the cost the
    floors remove, so the test above can tell them apart."""
    monkeypatch.setattr(floors_module, "HELD_SNAPSHOT_SECONDS", 3600.0)
    add_ready_runs(make_definition(team_a, "floor.job", queue="q"), 1100)
    lease_and_finish(team_a, 1000)
    read, leases = claimable_entries_read(lambda: claim(team_a))
    assert len(leases) == 100
    assert read >= 1000, read


def test_a_run_left_behind_a_floor_is_claimed_within_its_lifetime(team_a, old_snapshot):
    definition = make_definition(team_a, "floor.job", queue="q")
    add_ready_runs(definition, 200)
    lease_and_finish(team_a, 100)  # a floor now stands after the first 100
    behind = made_older()
    started = time.monotonic()
    leases = claim(team_a, 10)
    assert behind not in [lease.id for lease in leases]  # the floor passed it by
    while behind not in [lease.id for lease in leases]:
        assert time.monotonic() - started < floors_module.FLOOR_SECONDS + 1.0
        time.sleep(0.05)
        leases = claim(team_a, 1)
    assert time.monotonic() - started >= floors_module.FLOOR_SECONDS * 0.5


def test_without_an_old_snapshot_no_run_waits_behind_a_floor(team_a):
    definition = make_definition(team_a, "floor.job", queue="q")
    add_ready_runs(definition, 200)
    lease_and_finish(team_a, 100)
    behind = made_older()
    (first,) = claim(team_a, 1)
    assert first.id == behind  # the oldest, at once
    assert not floors.active("default")


def test_floors_stay_a_while_after_the_old_snapshot_ends_then_go(team_a, monkeypatch):
    """Right after a long snapshot ends, the entries it held up are still in the index: the
    claims keep starting at their floors for LINGER_SECONDS, then read from the head again."""
    monkeypatch.setattr(floors_module, "FLOOR_SECONDS", 60.0)  # the floor outlives the test
    definition = make_definition(team_a, "floor.job", queue="q")
    add_ready_runs(definition, 1300)
    with other_session() as session:
        session.execute("SELECT txid_current()")
        time.sleep(HELD + 0.1)
        lease_and_finish(team_a, 1000)
        assert floors.active("default")
    ended = time.monotonic()
    read, leases = claimable_entries_read(lambda: claim(team_a))
    assert time.monotonic() - ended < LINGER  # still lingering when it claimed
    assert floors.active("default") and len(leases) == 100
    assert read <= 150, read  # started at the floor, not at the 1 000 dead entries
    time.sleep(LINGER + 0.1)
    claim(team_a, 1)
    assert not floors.active("default")
