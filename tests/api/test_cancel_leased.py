"""Cancelling a run that is leased: the worker is told at its next heartbeat, and the run ends
`cancelled` whatever the worker reports, or when its lease expires; never retried."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.db import connections

from apps.audit.models import AuditEvent
from apps.runs import shards, store
from apps.runs.models import Attempt, Run
from tests.conftest import (
    add_ready_runs,
    db_now,
    expire_lease,
    make_definition,
    stored,
    stored_one,
    stored_run,
)

pytestmark = [pytest.mark.shards, pytest.mark.django_db(transaction=True, databases="__all__")]


@pytest.fixture
def leased(api_a, team_a) -> dict:
    definition = make_definition(team_a, "jobs.long", queue="q", retry_max_attempts=5)
    add_ready_runs(definition, 1)
    (lease,) = api_a.lease(["q"], 1)
    return lease


def _cancel(api, lease) -> dict:
    answer = api.post(f"/api/v1/runs/{lease['runId']}/cancel")
    assert answer.status_code == 202, answer.text
    return answer.json()


def test_a_leased_run_is_asked_to_stop_and_its_heartbeats_say_so(api_a, leased):
    answer = _cancel(api_a, leased)
    assert (answer["state"], answer["cancelRequested"]) == ("leased", True)
    again = api_a.post(f"/api/v1/runs/{leased['runId']}/cancel")
    assert again.status_code == 202  # asked once is asked: no second audit event
    events = AuditEvent.objects.filter(action="run.cancel_request", target=leased["runId"])
    assert [e.after for e in events] == [{"state": "leased", "cancelRequested": True}]

    token = {"fencingToken": leased["fencingToken"]}
    single = api_a.post(f"/api/v1/runs/{leased['runId']}/heartbeat", token)
    assert single.status_code == 409
    assert single.json()["type"].endswith("/cancelled")
    batch = api_a.post("/api/v1/heartbeats", {"leases": [{"runId": leased["runId"], **token}]})
    (item,) = batch.json()["leases"]
    assert item["status"] == 409 and item["type"].endswith("/cancelled")
    # Another token is only refused, not told about the cancel.
    stale = api_a.post(
        f"/api/v1/runs/{leased['runId']}/heartbeat", {"fencingToken": leased["fencingToken"] + 1}
    )
    assert stale.status_code == 409 and not stale.json()["type"].endswith("/cancelled")


@pytest.mark.parametrize("report", ["complete", "fail"])
def test_whatever_the_worker_reports_the_run_ends_cancelled_with_its_attempt(api_a, leased, report):
    _cancel(api_a, leased)
    body = {"fencingToken": leased["fencingToken"], "result": {"partial": True}}
    if report == "fail":
        body = {
            "fencingToken": leased["fencingToken"],
            "error": {"message": "stopped", "type": "RunCancelled"},
            "retryable": True,
        }
    answer = api_a.post(f"/api/v1/runs/{leased['runId']}/{report}", body)
    assert answer.status_code == 200, answer.text
    assert answer.json()["state"] == "cancelled"
    run = stored_run()
    assert run.state == "cancelled" and run.finished_at is not None
    (attempt,) = stored(Attempt)
    assert (attempt.outcome, attempt.ended_at is not None) == ("cancelled", True)
    assert api_a.lease(["q"], 1) == []  # never retried
    listed = api_a.get("/api/v1/runs?state=cancelled").json()["results"]
    assert [item["runId"] for item in listed] == [leased["runId"]]


def test_a_cancelled_runs_heartbeats_keep_its_lease_so_a_handler_that_runs_on_is_reported(
    api_a, leased
):
    """A handler that checks for no cancel runs to its end and is reported: its heartbeats
    were refused and the lease left to run out, so a handler longer than what was left of it
    had its result refused, and the reaper said its lease expired "without a heartbeat"."""
    _cancel(api_a, leased)
    pk = stored_run().pk
    with connections[shards.alias_of_run(pk)].cursor() as cursor:
        cursor.execute(
            "UPDATE runs_run SET lease_expires_at = now() + interval '1 second' WHERE id = %s",
            [pk],
        )
    path = f"/api/v1/runs/{leased['runId']}"
    beat = api_a.post(f"{path}/heartbeat", {"fencingToken": leased["fencingToken"]})
    assert beat.status_code == 409 and beat.json()["type"].endswith("/cancelled")
    extended = stored_run().lease_expires_at
    assert extended > db_now() + timedelta(seconds=30), extended  # its lease's length again
    done = api_a.post(
        f"{path}/complete", {"fencingToken": leased["fencingToken"], "result": {"rows": 3}}
    )
    assert done.status_code == 200 and done.json()["state"] == "cancelled", done.text
    assert stored_run().result == {"rows": 3}


def test_a_cancelled_run_whose_worker_never_answers_ends_cancelled_when_its_lease_expires(
    api_a, team_a, leased
):
    _cancel(api_a, leased)
    run = stored_run()
    expire_lease(run.pk)
    (reaped,) = store.reap()
    assert (reaped.id, reaped.state) == (run.pk, "cancelled")
    run = stored_run()
    assert run.state == "cancelled" and run.attempt < run.max_attempts  # attempts left, unused
    assert stored_one(Attempt).outcome == "lease_expired"
    assert api_a.lease(["q"], 1) == []


def test_a_run_that_is_not_leased_any_more_is_not_asked(api_a, leased):
    assert (
        api_a.post(
            f"/api/v1/runs/{leased['runId']}/complete", {"fencingToken": leased["fencingToken"]}
        ).status_code
        == 200
    )
    refused = api_a.post(f"/api/v1/runs/{leased['runId']}/cancel")
    assert refused.status_code == 409 and "succeeded" in refused.json()["detail"]
    assert not stored(Run, cancel_requested=True)
