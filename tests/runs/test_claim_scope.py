"""The claim's scope (queues, jobs, teams) reaches SQL as array literals: names that need quoting
in a literal must select exactly their own runs."""

from __future__ import annotations

import pytest

from apps.runs import store
from tests.conftest import add_ready_runs, make_definition

pytestmark = pytest.mark.django_db(transaction=True)

AWKWARD = ["a,b", 'q"uote', "back\\slash", "{braces}", "NULL", "sp ace", "ünï"]


@pytest.mark.parametrize("queue", AWKWARD)
def test_a_queue_name_selects_only_its_runs(team_a, queue):
    wanted = make_definition(team_a, "wanted.job", queue=queue)
    # Neighbours a naive literal would match: the name's parts and the unquoted NULL.
    for index, other in enumerate(["a", "b", "q", "back", "braces", "", "sp"]):
        add_ready_runs(make_definition(team_a, f"other{index}.job", queue=other or "x"), 2)
    add_ready_runs(wanted, 3)
    leases = store.claim(queues=[queue], max_runs=50, worker_id="w", lease_seconds=60)
    assert sorted(lease.queue for lease in leases) == [queue] * 3


def test_job_and_team_filters_narrow_the_claim(team_a, team_b):
    ours = make_definition(team_a, 'etl."load"', queue="etl")
    other_job = make_definition(team_a, "etl.other", queue="etl")
    other_team = make_definition(team_b, "etl.theirs", queue="etl")
    for definition in (ours, other_job, other_team):
        add_ready_runs(definition, 4)
    leases = store.claim(
        queues=["etl"],
        jobs=['etl."load"'],
        team_ids=[team_a.pk],
        max_runs=50,
        worker_id="w",
        lease_seconds=60,
    )
    assert len(leases) == 4
    assert {lease.job for lease in leases} == {'etl."load"'}
    assert {
        lease.job
        for lease in store.claim(
            queues=["etl"], team_ids=[team_b.pk], max_runs=50, worker_id="w", lease_seconds=60
        )
    } == {"etl.theirs"}
    assert (
        store.claim(queues=["etl"], team_ids=[], max_runs=50, worker_id="w", lease_seconds=60) == []
    )
