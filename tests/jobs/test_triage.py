"""Failures grouped by error (apps/jobs/triage.py): counts, first and last seen, jobs, a sample."""

from __future__ import annotations

import pytest

from apps.jobs import triage
from apps.runs import fingerprints, store
from apps.runs.filters import BulkFilter
from apps.runs.models import Run
from tests.conftest import add_ready_runs, make_definition
from tests.triage_runs import insert_failed

pytestmark = pytest.mark.django_db

EVERYTHING = BulkFilter(everything=True)


def test_failures_are_grouped_by_fingerprint_largest_first_with_their_jobs(team_a, team_b):
    charge = make_definition(team_a, "billing.charge", queue="billing")
    refund = make_definition(team_a, "billing.refund", queue="billing")
    theirs = make_definition(team_b, "search.reindex", queue="search")
    keyed = insert_failed(charge, 30)
    insert_failed(refund, 12, prefix="refund-")
    insert_failed(refund, 4, state="retrying", prefix="retry-")
    timed = insert_failed(charge, 7, error_type="TimeoutError", message="after %s s", prefix="t-")
    insert_failed(theirs, 50)

    grouping = triage.groups([team_a.pk], ["retrying", "dead"], EVERYTHING)
    assert (grouping.total_groups, grouping.total_runs) == (2, 53)
    first, second = grouping.groups
    assert (first.fingerprint, first.count, second.fingerprint, second.count) == (
        keyed,
        46,
        timed,
        7,
    )
    assert first.jobs == {"billing.charge": 30, "billing.refund": 16}
    assert first.job_names == ["billing.charge", "billing.refund"]
    assert first.label == "KeyError: '<str>'"
    assert second.label == "TimeoutError: after <n> s"
    assert first.key == fingerprints.to_hex(keyed)
    runs = Run.objects.filter(error_fingerprint=keyed, team=team_a)
    assert first.first_at == min(run.failed_at for run in runs)
    assert first.last_at == max(run.failed_at for run in runs)
    assert first.sample.pk == max(run.pk for run in runs)

    dead_only = triage.groups([team_a.pk], ["dead"], BulkFilter(job="billing.refund"))
    assert [(g.fingerprint, g.count) for g in dead_only.groups] == [(keyed, 12)]
    assert triage.groups([team_a.pk], [], EVERYTHING).groups == []
    shown = triage.groups([team_a.pk, team_b.pk], ["dead"], EVERYTHING, limit=1)
    assert (len(shown.groups), shown.total_groups, shown.groups[0].count) == (1, 2, 92)


def test_runs_failed_through_the_worker_path_group_with_their_sample(team_a):
    job = make_definition(team_a, "etl.load", queue="etl", retry_max_attempts=1)
    add_ready_runs(job, 3)
    leases = store.claim(queues=["etl"], max_runs=3, worker_id="w/1", lease_seconds=60)
    store.fail(
        [
            (lease.id, lease.fencing_token, {"type": "KeyError", "message": f"'user {n}'"}, True)
            for n, lease in enumerate(leases)
        ],
        team_ids=[team_a.pk],
    )
    (group,) = triage.groups([team_a.pk], ["dead"], EVERYTHING).groups
    assert group.count == 3
    assert group.sample.last_error["message"] == "'user 2'"
