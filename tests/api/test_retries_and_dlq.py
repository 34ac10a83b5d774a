"""Failures, backoff, the dead-letter queue and requeue."""

from __future__ import annotations

from datetime import timedelta

import pytest

from apps.audit.models import AuditEvent
from apps.runs import store
from apps.runs.models import Attempt, Run
from tests.conftest import add_ready_runs, claim, everywhere, make_definition, stored, stored_run

pytestmark = [pytest.mark.shards, pytest.mark.django_db(transaction=True, databases="__all__")]


def make_available() -> None:
    everywhere("UPDATE runs_run SET available_at = now() WHERE state = 'retrying'")


def fail_lease(api, lease, retryable=True, message="boom"):
    return api.post(
        f"/api/v1/runs/{lease['runId']}/fail",
        {
            "fencingToken": lease["fencingToken"],
            "error": {"message": message, "type": "RuntimeError"},
            "retryable": retryable,
        },
    )


def test_after_max_attempts_the_run_is_dead_listed_and_requeueable(api_a, team_a):
    definition = make_definition(
        team_a, "jobs.flaky", queue="q", retry_max_attempts=3, retry_base_seconds=1
    )
    add_ready_runs(definition, 1)
    for attempt in range(1, 4):
        (lease,) = api_a.lease(["q"], 1)
        assert lease["attempt"] == attempt
        answer = fail_lease(api_a, lease, message=f"failure {attempt}")
        assert answer.status_code == 200
        assert answer.json()["state"] == ("retrying" if attempt < 3 else "dead")
        make_available()
    run = stored_run()
    assert run.state == "dead"
    assert run.last_error == {"message": "failure 3", "type": "RuntimeError"}
    assert api_a.lease(["q"], 1) == []

    dlq = api_a.get("/api/v1/dlq").json()["results"]
    assert [item["runId"] for item in dlq] == [run.run_id]
    assert dlq[0]["lastError"]["message"] == "failure 3"

    requeued = api_a.post("/api/v1/dlq/requeue", {"runIds": [run.run_id]})
    assert requeued.json() == {"count": 1, "runIds": [run.run_id]}
    assert AuditEvent.objects.filter(action="dlq.requeue", target=run.run_id).exists()
    (lease,) = api_a.lease(["q"], 1)
    assert lease["attempt"] == 4
    assert stored_run(run.pk).max_attempts == 6  # a fresh budget of maxAttempts more
    assert api_a.get("/api/v1/dlq").json()["results"] == []


def test_not_retryable_goes_straight_to_dead(api_a, team_a):
    definition = make_definition(team_a, "jobs.fatal", queue="q", retry_max_attempts=5)
    add_ready_runs(definition, 1)
    (lease,) = api_a.lease(["q"], 1)
    assert fail_lease(api_a, lease, retryable=False).json()["state"] == "dead"
    assert stored_run().state == "dead"


def test_a_failure_reported_without_an_error_reads_the_same_on_the_run_and_its_attempt(
    api_a, team_a
):
    definition = make_definition(team_a, "jobs.quiet", queue="q", retry_max_attempts=5)
    add_ready_runs(definition, 2)
    single, batched = api_a.lease(["q"], 2)
    answer = api_a.post(
        f"/api/v1/runs/{single['runId']}/fail",
        {"fencingToken": single["fencingToken"], "retryable": False},
    )
    assert answer.status_code == 200
    item = {"runId": batched["runId"], "fencingToken": batched["fencingToken"]}
    answer = api_a.post("/api/v1/results", {"results": [{**item, "outcome": "failed"}]})
    assert answer.status_code == 200
    for lease in (single, batched):
        detail = api_a.get(f"/api/v1/runs/{lease['runId']}").json()
        assert detail["lastError"] == {"message": "", "type": ""}
        assert [attempt["error"] for attempt in detail["attempts"]] == [detail["lastError"]]


def test_discard_by_filter_empties_the_dlq(api_a, team_a):
    definition = make_definition(team_a, "jobs.discard", queue="q", retry_max_attempts=1)
    add_ready_runs(definition, 3)
    for lease in api_a.lease(["q"], 3):
        fail_lease(api_a, lease)
    answer = api_a.post("/api/v1/dlq/discard", {"filter": {"job": "jobs.discard"}})
    assert answer.json()["count"] == 3
    assert not stored(Run, state="dead")
    assert AuditEvent.objects.filter(action="dlq.discard").count() == 3


@pytest.mark.parametrize(
    "attempt,ceiling",
    [(1, 30), (2, 60), (3, 120), (4, 240), (5, 480), (6, 960), (7, 1800), (12, 1800)],
)
def test_backoff_is_full_jitter_within_the_ceiling(team_a, attempt, ceiling):
    definition = make_definition(
        team_a,
        "jobs.backoff",
        queue="q",
        retry_max_attempts=100,
        retry_base_seconds=30,
        retry_max_seconds=1800,
    )
    add_ready_runs(definition, 40)
    everywhere("UPDATE runs_run SET attempt = %s", [attempt - 1])
    leases = claim(queues=["q"], max_runs=40, worker_id="w", lease_seconds=60)
    assert {lease.attempt for lease in leases} == {attempt}
    outcomes = store.fail(
        [(lease.id, lease.fencing_token, {"message": "x"}, True) for lease in leases],
        team_ids=[team_a.pk],
    )
    # The attempt ended at the failing transaction's now(): the delay is measured from there.
    ended = {attempt.run_id: attempt.ended_at for attempt in stored(Attempt)}
    delays = [(o.available_at - ended[o.id]).total_seconds() for o in outcomes]
    assert all(0 <= delay <= ceiling for delay in delays), delays
    # Full jitter spreads across the whole range, not just near the ceiling.
    assert min(delays) < ceiling / 2 < max(delays)


def test_cancel_takes_a_waiting_run_at_once_and_asks_a_leased_one_to_stop(api_a, team_a):
    definition = make_definition(team_a, "jobs.cancel", queue="q")
    add_ready_runs(definition, 2)
    first, second = stored(Run)
    assert api_a.post(f"/api/v1/runs/{first.run_id}/cancel").json()["state"] == "cancelled"
    (lease,) = api_a.lease(["q"], 5)
    assert lease["runId"] == second.run_id
    asked = api_a.post(f"/api/v1/runs/{second.run_id}/cancel")
    assert asked.status_code == 202 and asked.json()["cancelRequested"] is True
    again = api_a.post(f"/api/v1/runs/{first.run_id}/cancel")
    assert again.status_code == 409 and "cancelled" in again.json()["detail"]
    assert AuditEvent.objects.filter(action="run.cancel").count() == 1
    assert AuditEvent.objects.filter(action="run.cancel_request").count() == 1


def test_retry_skips_the_backoff(api_a, team_a):
    definition = make_definition(
        team_a, "jobs.retry", queue="q", retry_base_seconds=3600, retry_max_seconds=3600
    )
    add_ready_runs(definition, 1)
    (lease,) = api_a.lease(["q"], 1)
    fail_lease(api_a, lease)
    everywhere("UPDATE runs_run SET available_at = now() + interval '1 hour'")
    assert api_a.lease(["q"], 1) == []
    run = stored_run()
    assert api_a.post(f"/api/v1/runs/{run.run_id}/retry").json()["state"] == "ready"
    assert len(api_a.lease(["q"], 1)) == 1
    assert timedelta(0) <= stored_run().available_at - run.created_at


def test_a_refused_retry_names_the_state_as_the_api_shows_it(api_a, team_a):
    definition = make_definition(team_a, "jobs.due", queue="q")
    add_ready_runs(definition, 1)  # stored `scheduled`, due: shown as `ready`
    run = stored_run()
    assert api_a.get(f"/api/v1/runs/{run.run_id}").json()["state"] == "ready"
    refused = api_a.post(f"/api/v1/runs/{run.run_id}/retry")
    assert refused.status_code == 409
    assert refused.json()["detail"] == "cannot retry a run that is ready"
