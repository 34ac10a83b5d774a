"""With a transaction left open elsewhere, vacuum can remove no row version, so the partial
indexes on leased runs keep an entry for every lease taken since. Completing, failing or
heartbeating a batch must find its runs by primary key, not by reading those indexes whole."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from django.db import connection, transaction

from apps.runs import store
from tests.conftest import add_ready_runs, make_definition, other_session

pytestmark = pytest.mark.django_db(transaction=True)

LEASED_INDEXES = ("run_leased_by_def", "run_leased_expiry")


@pytest.fixture
def old_snapshot() -> Iterator[None]:
    with other_session() as session:
        session.execute("SELECT txid_current()")
        yield


def leased_index_reads(action) -> tuple[int, list]:
    """Entries `action` read from the leased runs' indexes, counted in its own transaction."""
    query = (
        "SELECT coalesce(sum(pg_stat_get_xact_tuples_returned(i::regclass)), 0)"
        " FROM unnest(%s::text[]) AS i"
    )
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute(query, [list(LEASED_INDEXES)])
        before = cursor.fetchone()[0]
        outcomes = action()
        cursor.execute(query, [list(LEASED_INDEXES)])
        return cursor.fetchone()[0] - before, outcomes


def lease_and_finish(team, count: int) -> None:
    for _ in range(count // 100):
        leases = store.claim(
            queues=["q"], max_runs=100, worker_id="w", lease_seconds=60, team_ids=[team.pk]
        )
        store.complete([(x.id, x.fencing_token, None) for x in leases], team_ids=[team.pk])


@pytest.mark.parametrize("verb", ["complete", "fail", "heartbeat"])
def test_a_batch_reads_no_leased_index(team_a, old_snapshot, verb):
    add_ready_runs(make_definition(team_a, "snapshot.job", queue="q"), 1100)
    lease_and_finish(team_a, 1000)  # 1 000 leases: their entries stay in both indexes
    leases = store.claim(
        queues=["q"], max_runs=100, worker_id="w", lease_seconds=60, team_ids=[team_a.pk]
    )
    assert len(leases) == 100
    items = {
        "complete": [(x.id, x.fencing_token, None) for x in leases],
        "fail": [(x.id, x.fencing_token, {"message": "no"}, True) for x in leases],
        "heartbeat": [(x.id, x.fencing_token) for x in leases],
    }[verb]
    read, outcomes = leased_index_reads(lambda: getattr(store, verb)(items, team_ids=[team_a.pk]))
    assert [outcome.status for outcome in outcomes] == [200] * 100
    assert read == 0, read


def test_a_stale_token_is_still_refused(team_a, old_snapshot):
    add_ready_runs(make_definition(team_a, "snapshot.job", queue="q"), 2)
    first, second = store.claim(
        queues=["q"], max_runs=2, worker_id="w", lease_seconds=60, team_ids=[team_a.pk]
    )
    outcomes = store.complete(
        [(first.id, first.fencing_token + 1000, None), (second.id, second.fencing_token, None)],
        team_ids=[team_a.pk],
    )
    assert [outcome.status for outcome in outcomes] == [409, 200]
    again = store.complete([(second.id, second.fencing_token, None)], team_ids=[team_a.pk])
    assert [outcome.status for outcome in again] == [409]
    assert (
        store.complete([(first.id, first.fencing_token, None)], team_ids=[987654])[0].status == 404
    )
