"""The worker protocol over real HTTP: lease, heartbeat, complete, fail, fencing and the reaper."""

from __future__ import annotations

import threading
import time
from datetime import datetime

import pytest
from django.db import connections

from apps.runs import shards, store
from apps.runs.ids import parse_run_id, public_run_id
from apps.runs.models import Attempt, Run
from tests.conftest import (
    add_ready_runs,
    claim,
    db_now,
    expire_lease,
    make_definition,
    stored,
    stored_one,
    stored_run,
)

pytestmark = [pytest.mark.shards, pytest.mark.django_db(transaction=True, databases="__all__")]

LEASE_FIELDS = {
    "runId",
    "job",
    "attempt",
    "idempotencyKey",
    "fencingToken",
    "leaseExpiresAt",
    "payload",
}


def test_lease_response_carries_the_designed_fields(api_a, team_a):
    definition = make_definition(
        team_a, "billing.export-invoices", queue="billing", payload={"format": "csv"}
    )
    add_ready_runs(definition, 1, prefix="billing.export-invoices@2026-03-15T02:00:00+01:00")
    (lease,) = api_a.lease(["billing"], 10, leaseSeconds=90)
    assert LEASE_FIELDS <= set(lease)
    assert lease["job"] == "billing.export-invoices"
    assert lease["attempt"] == 1
    assert lease["payload"] == {"format": "csv"}
    assert lease["idempotencyKey"] == "billing.export-invoices@2026-03-15T02:00:00+01:00-0"
    assert isinstance(lease["fencingToken"], int)
    assert lease["runId"].startswith("run_")
    assert lease["leaseExpiresAt"].endswith("Z")


@pytest.mark.parametrize(
    "payload",
    [
        {"n": 2**63, "text": "é ✓ \u2028", "nested": [1, 2.5, {"a": None, "b": [True, False]}]},
        [1, "two", {"three": 3}],
        "a string",
        0,
    ],
    ids=["object", "array", "string", "number"],
)
def test_a_lease_carries_its_runs_payload_as_stored(api_a, team_a, payload):
    """The claim passes each payload through as its stored JSON text, unparsed: whatever was
    stored comes back equal, integers past 53 bits and non-ASCII text included."""
    make_definition(team_a, "payload.job", queue="payloads")
    created = api_a.post("/api/v1/jobs/payload.job/runs", {"payload": payload})
    assert created.status_code == 201, created.text
    (lease,) = api_a.lease(["payloads"], 1)
    assert lease["payload"] == payload


def test_heartbeat_extends_and_complete_finishes(api_a, team_a):
    make = make_definition(team_a, "jobs.one", queue="q")
    add_ready_runs(make, 1)
    (lease,) = api_a.lease(["q"], 1, leaseSeconds=30)
    beat = api_a.post(
        f"/api/v1/runs/{lease['runId']}/heartbeat", {"fencingToken": lease["fencingToken"]}
    )
    assert beat.status_code == 200, beat.text
    assert beat.json()["leaseExpiresAt"] >= lease["leaseExpiresAt"]
    done = api_a.post(
        f"/api/v1/runs/{lease['runId']}/complete",
        {"fencingToken": lease["fencingToken"], "result": {"rows": 3}},
    )
    assert done.status_code == 200, done.text
    run = stored_run()
    assert run.state == "succeeded" and run.result == {"rows": 3} and run.finished_at is not None
    assert stored_one(Attempt).outcome == "succeeded"


@pytest.mark.parametrize("call", ["heartbeat", "complete", "fail"])
def test_stale_token_is_rejected_and_changes_nothing(api_a, team_a, call):
    definition = make_definition(team_a, "jobs.stale", queue="q", retry_max_attempts=5)
    add_ready_runs(definition, 1)
    (first,) = api_a.lease(["q"], 1)
    expire_lease(stored_run().pk)
    assert [r.outcome for r in store.reap()] == ["lease_expired"]
    _skip_backoff(stored_run())
    (second,) = api_a.lease(["q"], 1)
    assert second["runId"] == first["runId"]
    assert second["fencingToken"] > first["fencingToken"]
    assert second["attempt"] == 2
    before = _values(stored_run())

    body = {"fencingToken": first["fencingToken"]}
    if call == "fail":
        body["error"] = {"message": "late", "type": "RuntimeError"}
    response = api_a.post(f"/api/v1/runs/{first['runId']}/{call}", body)
    assert response.status_code == 409
    problem = response.json()
    assert problem["status"] == 409 and "stale" in problem["detail"]
    assert response.headers["content-type"].startswith("application/problem+json")
    assert _values(stored_run()) == before
    # The current holder still completes.
    ok = api_a.post(
        f"/api/v1/runs/{second['runId']}/complete", {"fencingToken": second["fencingToken"]}
    )
    assert ok.status_code == 200
    outcomes = [a.outcome for a in sorted(stored(Attempt), key=lambda a: a.fencing_token)]
    assert outcomes == ["lease_expired", "succeeded"]


def test_completion_committed_while_the_reaper_runs_wins(team_a):
    """The completion holds the row when the reaper looks: the reaper skips it, the run succeeds."""
    definition = make_definition(team_a, "jobs.race", queue="q")
    add_ready_runs(definition, 1)
    (lease,) = claim(queues=["q"], max_runs=1, worker_id="w")
    expire_lease(lease.id)
    completing = threading.Event()
    release = threading.Event()

    def complete_slowly() -> None:
        from django.db import transaction

        try:
            with transaction.atomic(using=shards.alias_of_run(lease.id)):
                store.complete(
                    [(lease.id, lease.fencing_token, {"ok": True})], team_ids=[team_a.pk]
                )
                completing.set()
                release.wait(10)
        finally:
            connections.close_all()

    thread = threading.Thread(target=complete_slowly)
    thread.start()
    assert completing.wait(10)
    assert store.reap() == []  # the row is locked by the uncommitted completion: skipped
    release.set()
    thread.join(10)
    assert store.reap() == []
    run = stored_run()
    assert run.state == "succeeded"
    assert stored_one(Attempt).outcome == "succeeded"


def test_reaper_reading_before_a_completion_commits_leaves_it_succeeded(team_a):
    """The reaper's UPDATE re-checks state, token and expiry, so a read-then-write race is harmless."""
    definition = make_definition(team_a, "jobs.race2", queue="q")
    add_ready_runs(definition, 1)
    (lease,) = claim(queues=["q"], max_runs=1, worker_id="w")
    expire_lease(lease.id)
    with connections[shards.alias_of_run(lease.id)].cursor() as cursor:
        cursor.execute(
            "SELECT id FROM runs_run WHERE state = 'leased' AND lease_expires_at <= now()"
        )
        seen = [row[0] for row in cursor.fetchall()]
    assert seen == [lease.id]
    store.complete([(lease.id, lease.fencing_token, None)], team_ids=[team_a.pk])
    assert store.reap() == []
    assert stored_run().state == "succeeded"


def test_timeout_fails_a_run_even_while_it_heartbeats(api_a, team_a):
    definition = make_definition(
        team_a, "jobs.slow", queue="q", timeout_seconds=1, retry_max_attempts=3
    )
    add_ready_runs(definition, 1)
    (lease,) = api_a.lease(["q"], 1, leaseSeconds=60)
    beat = api_a.post(
        f"/api/v1/runs/{lease['runId']}/heartbeat", {"fencingToken": lease["fencingToken"]}
    )
    assert beat.status_code == 200
    time.sleep(1.2)
    late = api_a.post(
        f"/api/v1/runs/{lease['runId']}/heartbeat", {"fencingToken": lease["fencingToken"]}
    )
    assert late.status_code == 409
    (reaped,) = store.reap()
    assert reaped.outcome == "timed_out" and reaped.state == "retrying"
    attempt = stored_one(Attempt)
    assert attempt.outcome == "timed_out"
    assert stored_run().last_error["type"] == "timed_out"


def test_lease_is_bounded_by_the_timeout(api_a, team_a):
    definition = make_definition(team_a, "jobs.bounded", queue="q", timeout_seconds=5)
    add_ready_runs(definition, 1)
    api_a.lease(["q"], 1, leaseSeconds=600)
    run = stored_run()
    assert (run.lease_expires_at - run.started_at).total_seconds() <= 5.5


def test_batch_endpoints_answer_per_item(api_a, team_a):
    definition = make_definition(team_a, "jobs.batch", queue="q", retry_max_attempts=1)
    add_ready_runs(definition, 3)
    a, b, c = api_a.lease(["q"], 3)
    beats = api_a.post(
        "/api/v1/heartbeats",
        {
            "leases": [
                {"runId": a["runId"], "fencingToken": a["fencingToken"]},
                {"runId": b["runId"], "fencingToken": b["fencingToken"] + 1000},
                {"runId": "run_ZZZZZZ", "fencingToken": 1},
            ]
        },
    )
    assert beats.status_code == 200
    assert [item["status"] for item in beats.json()["leases"]] == [200, 409, 404]
    results = api_a.post(
        "/api/v1/results",
        {
            "results": [
                {
                    "runId": a["runId"],
                    "fencingToken": a["fencingToken"],
                    "outcome": "succeeded",
                    "result": {"n": 1},
                },
                {
                    "runId": b["runId"],
                    "fencingToken": b["fencingToken"],
                    "outcome": "failed",
                    "error": {"message": "boom", "type": "ValueError"},
                    "retryable": True,
                },
                {
                    "runId": c["runId"],
                    "fencingToken": c["fencingToken"] + 1,
                    "outcome": "succeeded",
                },
            ]
        },
    )
    assert results.status_code == 200
    items = results.json()["results"]
    assert [item["status"] for item in items] == [200, 200, 409]
    assert items[1]["state"] == "dead"  # maxAttempts 1: no attempts left
    states = {run.pk: run.state for run in stored(Run)}
    assert sorted(states.values()) == ["dead", "leased", "succeeded"]
    assert public_run_id(next(pk for pk, s in states.items() if s == "leased")) == c["runId"]


def test_an_outcome_sent_again_learns_the_state_it_left_and_no_other_does(api_a, team_a):
    definition = make_definition(team_a, "jobs.again", queue="q", retry_max_attempts=3)
    add_ready_runs(definition, 4)
    other, done, failed, expired = sorted(
        api_a.lease(["q"], 4), key=lambda lease: lease["fencingToken"]
    )

    def report(lease: dict, outcome: str, token: int | None = None) -> dict:
        item = {"runId": lease["runId"], "fencingToken": lease["fencingToken"]}
        if token is not None:
            item["fencingToken"] = token
        item["outcome"] = outcome
        if outcome == "failed":
            item |= {"error": {"message": "boom", "type": "ValueError"}, "retryable": True}
        answer = api_a.post("/api/v1/results", {"results": [item]})
        assert answer.status_code == 200
        return answer.json()["results"][0]

    assert report(done, "succeeded")["status"] == 200
    assert report(failed, "failed")["state"] == "retrying"
    again = report(done, "succeeded")
    assert (again["status"], again["state"]) == (409, "succeeded")
    assert "not leased" in again["detail"]
    again = report(failed, "failed")
    assert (again["status"], again["state"]) == (409, "retrying")
    # A token that is not the run's current one learns nothing of the run.
    stale = report(done, "succeeded", token=other["fencingToken"])
    assert stale["status"] == 409 and "state" not in stale
    # That token was another run's: the detail does not say this run was leased again.
    assert stale["detail"].endswith("is stale: the run's current lease is newer")
    # A lease that expired was ended by the reaper, not by an outcome: nothing was recorded.
    expire_lease(parse_run_id(expired["runId"]))
    assert [r.outcome for r in store.reap()] == ["lease_expired"]
    late = report(expired, "succeeded")
    assert late["status"] == 409 and "state" not in late


@pytest.mark.parametrize("stranger", ["run_8000000000000", "run_ZZZZZZZZZZZZZZZZ"])
def test_an_id_past_a_bigint_is_no_run_and_spoils_no_batch(api_a, team_a, stranger):
    add_ready_runs(make_definition(team_a, "jobs.big", queue="q"), 1)
    (lease,) = api_a.lease(["q"], 1)
    single = api_a.post(f"/api/v1/runs/{stranger}/heartbeat", {"fencingToken": 1})
    assert single.status_code == 404, single.text
    results = api_a.post(
        "/api/v1/results",
        {
            "results": [
                {"runId": lease["runId"], "fencingToken": lease["fencingToken"],
                 "outcome": "succeeded"},
                {"runId": stranger, "fencingToken": 1, "outcome": "succeeded"},
            ]
        },
    )  # fmt: skip
    assert results.status_code == 200, results.text
    assert [item["status"] for item in results.json()["results"]] == [200, 404]
    assert stored_one(Run).state == "succeeded"


def test_a_run_has_one_id_a_batch_cannot_name_it_twice(api_a, team_a):
    add_ready_runs(make_definition(team_a, "jobs.alias", queue="q"), 1)
    (lease,) = api_a.lease(["q"], 1)
    run_id, token = lease["runId"], lease["fencingToken"]
    digits = run_id.removeprefix("run_")
    # Zero-padded, the id is no run's; in lower case it is the same run, once per batch.
    assert api_a.get(f"/api/v1/runs/run_0{digits}").status_code == 404
    padded = api_a.post(
        "/api/v1/results",
        {
            "results": [
                {"runId": run_id, "fencingToken": token, "outcome": "failed", "retryable": True},
                {"runId": f"run_0{digits}", "fencingToken": token, "outcome": "succeeded"},
            ]
        },
    )
    assert [item["status"] for item in padded.json()["results"]] == [200, 404]
    assert stored_one(Run).state == "retrying"
    twice = api_a.post(
        "/api/v1/heartbeats",
        {"leases": [{"runId": "run_5F1J5", "fencingToken": 1},
                    {"runId": "run_5f1j5", "fencingToken": 1}]},
    )  # fmt: skip
    assert twice.status_code == 400, twice.text
    assert "leases[1].runId" in twice.json()["errors"]


def test_a_batch_item_takes_only_the_fields_of_its_outcome_as_the_single_calls_do(api_a, team_a):
    add_ready_runs(make_definition(team_a, "jobs.strict", queue="q"), 2)
    a, b = api_a.lease(["q"], 2)
    items = [
        {"runId": a["runId"], "fencingToken": a["fencingToken"], "outcome": "succeeded",
         "retryable": False, "error": {"message": "not read"}},
        {"runId": b["runId"], "fencingToken": b["fencingToken"], "outcome": "failed",
         "result": {"not": "read"}},
    ]  # fmt: skip
    for path, body in (
        ("/api/v1/results", {"results": items}),
        ("/api/v1/leases", {"queues": ["q"], "workerId": "w", "results": items}),
    ):
        refused = api_a.post(path, body)
        assert refused.status_code == 400, refused.text
        assert set(refused.json()["errors"]) == {
            "results[0].error",
            "results[0].retryable",
            "results[1].result",
        }
    single = api_a.post(f"/api/v1/runs/{a['runId']}/complete",
                        {"fencingToken": a["fencingToken"], "retryable": False})  # fmt: skip
    assert single.status_code == 400
    assert {run.state for run in stored(Run)} == {"leased"}


def test_lease_can_ask_for_some_jobs_only(api_a, team_a):
    wanted = make_definition(team_a, "jobs.wanted", queue="mixed")
    other = make_definition(team_a, "jobs.other", queue="mixed")
    add_ready_runs(other, 3, age_seconds=60)
    add_ready_runs(wanted, 2)
    leases = api_a.lease(["mixed"], 10, jobs=["jobs.wanted"])
    assert [lease["job"] for lease in leases] == ["jobs.wanted", "jobs.wanted"]
    assert stored(Run, definition=other.pk, state="leased") == []
    bad = api_a.post("/api/v1/leases", {"queues": ["mixed"], "workerId": "w", "jobs": []})
    assert bad.status_code == 400 and "jobs" in bad.json()["errors"]


def test_a_queue_or_job_named_twice_is_asked_for_once(api_a, team_a):
    limited = make_definition(team_a, "twice.limited", queue="twice", concurrency=5)
    other = make_definition(team_a, "twice.other", queue="twice", concurrency=2)
    add_ready_runs(limited, 8)
    add_ready_runs(other, 4, prefix="o")
    # Every slot the limits leave is filled in one request, as with each name once.
    leases = api_a.lease(
        ["twice", "twice", "twice"], 10, jobs=["twice.limited"] * 2 + ["twice.other"]
    )
    assert sorted(lease["job"] for lease in leases) == ["twice.limited"] * 5 + ["twice.other"] * 2
    assert api_a.lease(["twice", "twice"], 10) == []


def _values(run: Run) -> dict:
    return {field.attname: getattr(run, field.attname) for field in Run._meta.concrete_fields}


def _skip_backoff(run: Run) -> None:
    Run.objects.using(shards.alias_of_run(run.pk)).filter(pk=run.pk).update(
        available_at=run.created_at
    )


def test_a_lease_without_lease_seconds_lasts_the_configured_default(api_a, team_a, settings):
    """`SCHEDULER_DEFAULT_LEASE_SECONDS` was read and checked, and every such lease lasted 60 s."""
    settings.SCHEDULER_DEFAULT_LEASE_SECONDS = 300
    definition = make_definition(team_a, "billing.long", queue="long")
    add_ready_runs(definition, 2)
    lasting = []
    for extra in ({}, {"leaseSeconds": 30}):
        (lease,) = api_a.lease(["long"], 1, **extra)
        expires = datetime.fromisoformat(lease["leaseExpiresAt"])
        lasting.append((expires - db_now()).total_seconds())
    assert 295 <= lasting[0] <= 300 and 25 <= lasting[1] <= 30, lasting
