"""A lease request that carries the worker's finished results: applied first, answered per item,
and no lease when they cannot be applied."""

from __future__ import annotations

import threading
import time

import pytest
from django.db import connections

from apps.runs import shards
from apps.runs.ids import parse_run_id
from apps.runs.models import Run
from tests.conftest import add_ready_runs, make_definition, stored, stored_run

pytestmark = [pytest.mark.shards, pytest.mark.django_db(transaction=True, databases="__all__")]


def _succeeded(lease: dict, **extra) -> dict:
    return {
        "runId": lease["runId"],
        "fencingToken": lease["fencingToken"],
        "outcome": "succeeded",
        **extra,
    }


def _lease(api, results: list[dict], max_runs: int = 1, **extra):
    return api.post(
        "/api/v1/leases",
        {"queues": ["q"], "max": max_runs, "workerId": "w-1", "results": results, **extra},
    )


def test_results_are_applied_before_the_claim_and_answered_per_item(api_a, team_a):
    # Concurrency 1: the second run can only be leased once the first one's result has freed
    # the job's one slot, in the same request.
    one = make_definition(team_a, "jobs.serial", queue="q", concurrency=1)
    other = make_definition(team_a, "jobs.flaky", queue="q", retry_max_attempts=3)
    add_ready_runs(one, 2)
    add_ready_runs(other, 2)
    leases = api_a.lease(["q"], 4)
    assert sorted(lease["job"] for lease in leases) == ["jobs.flaky", "jobs.flaky", "jobs.serial"]
    (first,) = [lease for lease in leases if lease["job"] == "jobs.serial"]
    flaky = next(lease for lease in leases if lease["job"] == "jobs.flaky")

    answer = _lease(
        api_a,
        [
            _succeeded(first, result={"rows": 3}),
            {
                "runId": flaky["runId"],
                "fencingToken": flaky["fencingToken"],
                "outcome": "failed",
                "error": {"message": "boom", "type": "ValueError"},
            },
            _succeeded(flaky | {"runId": "run_ZZZZZZ"}),
        ],
        max_runs=5,
    )
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert [item["status"] for item in body["results"]] == [200, 200, 404]
    assert body["results"][0]["state"] == "succeeded"
    assert body["results"][1]["state"] == "retrying" and body["results"][1]["availableAt"]
    # The serial job's second run, leasable only because the first one's slot was freed.
    assert [lease["job"] for lease in body["leases"]] == ["jobs.serial"]
    assert body["leases"][0]["runId"] != first["runId"]
    assert stored_run(parse_run_id(first["runId"])).result == {"rows": 3}


def test_a_stale_token_in_the_results_is_refused_alone(api_a, team_a):
    definition = make_definition(team_a, "jobs.stale", queue="q")
    add_ready_runs(definition, 2)
    held, _ = api_a.lease(["q"], 2)
    answer = _lease(api_a, [_succeeded(held | {"fencingToken": held["fencingToken"] + 1000})])
    assert answer.status_code == 200, answer.text
    body = answer.json()
    (refused,) = body["results"]
    assert refused["status"] == 409 and "current token" in refused["detail"]
    assert stored_run(parse_run_id(held["runId"])).state == "leased"
    assert body["leases"] == []  # both runs are leased already: nothing else to claim


def test_a_bad_result_refuses_the_whole_request_and_leases_nothing(api_a, team_a):
    definition = make_definition(team_a, "jobs.bad", queue="q")
    add_ready_runs(definition, 2)
    (held,) = api_a.lease(["q"], 1)
    before = {run.pk: (run.state, run.fencing_token) for run in stored(Run)}

    bad_outcome = _lease(api_a, [_succeeded(held), {**_succeeded(held), "outcome": "maybe"}])
    assert bad_outcome.status_code == 400
    assert bad_outcome.headers["content-type"].startswith("application/problem+json")
    assert "results[1].outcome" in bad_outcome.json()["errors"]

    repeated = _lease(api_a, [_succeeded(held), _succeeded(held)])
    assert repeated.status_code == 400
    assert "results[1].runId" in repeated.json()["errors"]

    empty = _lease(api_a, [])
    assert empty.status_code == 400

    assert {run.pk: (run.state, run.fencing_token) for run in stored(Run)} == before


def test_no_lease_when_the_results_fail_to_commit(api_a, team_a):
    """A result whose transaction fails at COMMIT (a deferred trigger raises there) fails the
    whole request: the worker is not handed new runs it would hold beside an unreported one."""
    definition = make_definition(team_a, "jobs.commit", queue="q")
    add_ready_runs(definition, 3)
    (held,) = api_a.lease(["q"], 1)
    alias = shards.alias_of_run(parse_run_id(held["runId"]))
    with connections[alias].cursor() as cursor:
        cursor.execute(
            """
            CREATE FUNCTION refuse_success() RETURNS trigger LANGUAGE plpgsql AS $$
            BEGIN RAISE EXCEPTION 'refused at commit' USING ERRCODE = '40001'; END $$;
            CREATE CONSTRAINT TRIGGER refuse_success AFTER UPDATE ON runs_run
                DEFERRABLE INITIALLY DEFERRED FOR EACH ROW
                WHEN (NEW.state = 'succeeded') EXECUTE FUNCTION refuse_success();
            """
        )
    try:
        answer = _lease(api_a, [_succeeded(held)], max_runs=2)
    finally:
        with connections[alias].cursor() as cursor:
            cursor.execute(
                "DROP TRIGGER refuse_success ON runs_run; DROP FUNCTION refuse_success();"
            )
    if shards.physical():
        # Shards on databases of their own: each database's results are answered apart.
        assert answer.status_code == 200, answer.text
        assert [item["status"] for item in answer.json()["results"]] == [503]
        assert answer.json()["leases"] == []
    else:
        assert answer.status_code == 503, answer.text
        assert answer.headers["content-type"].startswith("application/problem+json")
        assert answer.headers["retry-after"] == "1"
    leased = [run.pk for run in stored(Run) if run.state == "leased"]
    assert leased == [parse_run_id(held["runId"])]  # still leased, and no other run is
    # Once the database takes it, the same request reports and leases.
    again = _lease(api_a, [_succeeded(held)], max_runs=2)
    assert again.status_code == 200, again.text
    assert [item["status"] for item in again.json()["results"]] == [200]
    assert len(again.json()["leases"]) == 2


def test_results_are_committed_before_the_long_poll_waits(api_a, team_a):
    definition = make_definition(team_a, "jobs.poll", queue="q")
    add_ready_runs(definition, 1)
    (held,) = api_a.lease(["q"], 1)
    pk = parse_run_id(held["runId"])
    answers: list = []
    waiting = threading.Thread(
        target=lambda: answers.append(_lease(api_a, [_succeeded(held)], waitSeconds=10))
    )
    waiting.start()
    try:
        deadline = time.monotonic() + 5
        while stored_run(pk).state != "succeeded":
            assert time.monotonic() < deadline, "the result waited with the long poll"
            time.sleep(0.05)
        assert waiting.is_alive()  # still polling: nothing to claim yet
        add_ready_runs(definition, 1, prefix="late")
    finally:
        waiting.join(15)
    (answer,) = answers
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert [item["status"] for item in body["results"]] == [200]
    assert len(body["leases"]) == 1 and body["leases"][0]["runId"] != held["runId"]


def test_a_lease_request_without_results_answers_as_before(api_a, team_a):
    definition = make_definition(team_a, "jobs.plain", queue="q")
    add_ready_runs(definition, 1)
    answer = api_a.post("/api/v1/leases", {"queues": ["q"], "max": 1, "workerId": "w"})
    assert answer.status_code == 200
    assert set(answer.json()) == {"leases"}


def test_a_claim_that_fails_after_the_results_committed_still_answers_them(
    api_a, team_a, monkeypatch
):
    """The results are committed before the claim: an answer that cannot be built (a lease that
    cannot be rendered) rolls the claim back, and the request answers the results, no leases,
    never a 5xx that would have the worker send them again."""
    from apps.api import views_worker

    definition = make_definition(team_a, "jobs.render", queue="q")
    add_ready_runs(definition, 3)
    (held,) = api_a.lease(["q"], 1)

    def lease_json_that_breaks(lease):
        raise RuntimeError("cannot render this lease")

    monkeypatch.setattr(views_worker, "lease_json", lease_json_that_breaks)
    answer = _lease(api_a, [_succeeded(held)], max_runs=2)
    assert answer.status_code == 200, answer.text
    assert [item["status"] for item in answer.json()["results"]] == [200]
    assert answer.json()["leases"] == []
    states = sorted(run.state for run in stored(Run))
    assert states.count("succeeded") == 1 and "leased" not in states  # the claim rolled back


@pytest.mark.parametrize("path", ["/api/v1/results", "/api/v1/leases"])
def test_failures_refused_after_the_completions_committed_answer_alone(api_a, team_a, path):
    """A batch's completions and failures are two transactions: the failures' refused (a lock
    wait past its bound, a lost connection, a commit refused) after the completions had
    committed answered the whole request 503, "nothing was changed"."""
    job = make_definition(team_a, "jobs.halves", queue="q", retry_max_attempts=3)
    add_ready_runs(job, 2)
    done, failing = api_a.lease(["q"], 2)
    alias = shards.alias_of_run(parse_run_id(done["runId"]))
    items = [
        _succeeded(done),
        {"runId": failing["runId"], "fencingToken": failing["fencingToken"],
         "outcome": "failed", "error": {"message": "boom"}, "retryable": True},
    ]  # fmt: skip
    with connections[alias].cursor() as cursor:  # refuses a failed run's row at its commit
        cursor.execute(
            "CREATE FUNCTION refuse_failed() RETURNS trigger LANGUAGE plpgsql"
            " AS $$ BEGIN RAISE EXCEPTION 'refused at commit'; END $$;"
            " CREATE CONSTRAINT TRIGGER refuse_failed AFTER UPDATE ON runs_run"
            " DEFERRABLE INITIALLY DEFERRED FOR EACH ROW"
            " WHEN (NEW.state IN ('retrying', 'dead')) EXECUTE FUNCTION refuse_failed()"
        )
    try:
        if path == "/api/v1/results":
            answer = api_a.post(path, {"results": items})
        else:
            answer = _lease(api_a, items)
    finally:
        with connections[alias].cursor() as cursor:
            cursor.execute("DROP TRIGGER refuse_failed ON runs_run; DROP FUNCTION refuse_failed()")
    assert answer.status_code == 200, answer.text
    made, refused = answer.json()["results"]
    assert (made["status"], made["state"]) == (200, "succeeded")
    assert refused["status"] == 503 and "refused" in refused["detail"]
    assert stored_run(parse_run_id(done["runId"])).state == "succeeded"
    assert stored_run(parse_run_id(failing["runId"])).state == "leased"
    if path == "/api/v1/leases":
        assert answer.json()["leases"] == []  # no new work while a result is unsettled
