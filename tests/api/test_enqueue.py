"""POST /api/v1/runs: bulk enqueue with a status per item, and the per-run rate limit."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
import time_machine
from django.core.cache import cache

from apps.audit.models import AuditEvent
from apps.runs.clock import format_utc
from apps.runs.models import Run
from tests.conftest import make_definition, stored, stored_one

pytestmark = [pytest.mark.shards, pytest.mark.django_db(transaction=True, databases="__all__")]


@pytest.fixture(autouse=True)
def _fresh_limits(settings):
    settings.SCHEDULER_API_RATES = {"worker": "", "manage": "20/s", "enqueue": "5000/s"}
    cache.clear()


JSON = {"Content-Type": "application/json"}


@pytest.fixture
def jobs(team_a, team_b):
    make_definition(team_a, "billing.send-invoice", queue="billing", payload={"kind": "x"})
    make_definition(team_a, "billing.remind", queue="billing")
    make_definition(team_b, "other.secret", queue="other")


def test_each_item_is_answered_in_order_and_nothing_half_written(api_a, jobs):
    assert (
        api_a.post(
            "/api/v1/runs", {"runs": [{"job": "billing.send-invoice", "idempotencyKey": "o-1"}]}
        ).json()["runs"][0]["status"]
        == 201
    )
    items = [
        {"job": "billing.send-invoice", "idempotencyKey": "o-2", "delaySeconds": 300,
         "payload": {"n": 2}},
        {"job": "billing.send-invoice", "idempotencyKey": "o-1"},  # existing, no payload asked
        {"job": "billing.send-invoice", "idempotencyKey": "o-1", "payload": {"other": 1}},
        {"job": "billing.remind", "runAt": "1970-01-01T00:00:00Z"},  # bad: long past
        {"job": "billing.remind", "delaySeconds": "soon"},  # bad type
        {"job": "no.such-job"},
        {"job": "other.secret"},  # another team's
        {"job": "billing.remind", "priority": "critical", "unknown": 1},  # unknown field
        {"job": "billing.remind", "priority": "critical"},
        5,  # not an object
        {"job": "billing.remind", "runAt": "2099-01-01t00:00:00z"},  # RFC 3339's lower case
    ]  # fmt: skip
    answer = api_a.post("/api/v1/runs", {"runs": items})
    assert answer.status_code == 200, answer.text
    runs = answer.json()["runs"]
    assert [item["status"] for item in runs] == [
        201, 200, 409, 400, 400, 404, 404, 400, 201, 400, 201
    ]  # fmt: skip
    assert runs[9]["errors"] == {"body": ["Expected a JSON object."]}
    assert runs[10]["run"]["dueAt"] == "2099-01-01T00:00:00Z"
    assert (
        runs[0]["run"]["job"] == "billing.send-invoice" and runs[0]["run"]["state"] == "scheduled"
    )
    assert runs[1]["run"]["idempotencyKey"] == "o-1"
    assert runs[2]["type"].endswith("/idempotency-conflict")
    assert "runAt" in runs[3]["errors"] and "delaySeconds" in runs[4]["errors"]
    assert "unknown" in runs[7]["errors"]
    assert runs[8]["run"]["priority"] == "critical"
    for refused in (runs[3], runs[5]):
        assert {"type", "title", "status", "detail"} <= set(refused)
    assert len(stored(Run)) == 4
    assert not stored(Run, definition__name="other.secret")


@pytest.mark.parametrize("others", [0, 4, 5, 6, 8, 10, 20])
def test_a_key_given_twice_in_one_batch_is_the_first_items_run(api_a, jobs, others):
    """The later item asks for the run the earlier one made: 409 with another payload. The
    insert sorts its rows by key; PostgreSQL's sort does not keep the order of equal keys, and
    with some neighbours (7 to 12 items in all) the later item's payload was stored instead."""
    key = f"twice-{others}"
    items = [
        {"job": "billing.remind", "idempotencyKey": key, "payload": {"i": 1}},
        {"job": "billing.remind", "idempotencyKey": key, "payload": {"i": 99}},
    ] + [{"job": "billing.remind"}] * others
    answer = api_a.post("/api/v1/runs", {"runs": items})
    assert answer.status_code == 200, answer.text
    first, other = answer.json()["runs"][:2]
    assert (first["status"], first["run"]["payload"]) == (201, {"i": 1})
    assert other["status"] == 409 and other["type"].endswith("/idempotency-conflict")
    assert stored_one(Run, idempotency_key=key).payload == {"i": 1}


def test_the_single_create_is_a_batch_of_one(api_a, jobs):
    first = api_a.post("/api/v1/jobs/billing.remind/runs", {"idempotencyKey": "k"})
    again = api_a.post("/api/v1/jobs/billing.remind/runs", {"idempotencyKey": "k"})
    bulk = api_a.post("/api/v1/runs", {"runs": [{"job": "billing.remind", "idempotencyKey": "k"}]})
    assert (first.status_code, again.status_code) == (201, 200)
    assert first.json() == again.json() == bulk.json()["runs"][0]["run"]
    assert api_a.post("/api/v1/jobs/billing.remind/runs", {"job": "x"}).status_code == 400


@pytest.mark.parametrize("number", ["1e25", "1e308", "12345678901234567890.5", "1e16", "-0.0"])
def test_the_same_body_sent_again_answers_its_run_whatever_its_numbers(api_a, jobs, number):
    # The database keeps numbers as decimals and writes 1e25 back as an integer: a retry of
    # the very same bytes must still find its run, not a conflict.
    body = '{"idempotencyKey": "k", "payload": {"f": NUMBER, "n": [NUMBER, true]}}'
    body = body.replace("NUMBER", number)
    answers = [
        api_a.post("/api/v1/jobs/billing.remind/runs", content=body, headers=JSON) for _ in range(2)
    ]
    assert [answer.status_code for answer in answers] == [201, 200], answers[1].text
    assert answers[0].json()["runId"] == answers[1].json()["runId"]
    other = body.replace(f'"f": {number}', '"f": 2e25')
    conflict = api_a.post("/api/v1/jobs/billing.remind/runs", content=other, headers=JSON)
    assert conflict.status_code == 409 and "fields that differ: f" in conflict.json()["detail"]
    assert len(stored(Run)) == 1


def test_a_runs_concurrency_key_and_priority_are_kept_and_shown_by_both_endpoints(api_a, jobs):
    bulk = api_a.post(
        "/api/v1/runs",
        {"runs": [
            {"job": "billing.remind", "idempotencyKey": "a", "concurrencyKey": "customer-42"},
            {"job": "billing.remind", "idempotencyKey": "b"},
            {"job": "billing.remind", "idempotencyKey": "c", "concurrencyKey": ""},
            {"job": "billing.remind", "idempotencyKey": "d", "concurrencyKey": "k" * 201},
            {"job": "billing.remind", "idempotencyKey": "e", "concurrencyKey": 42},
        ]},
    ).json()["runs"]  # fmt: skip
    assert [item["status"] for item in bulk] == [201, 201, 400, 400, 400]
    assert [bulk[0]["run"]["concurrencyKey"], bulk[1]["run"]["concurrencyKey"]] == [
        "customer-42",
        None,
    ]
    assert all("concurrencyKey" in refused["errors"] for refused in bulk[2:])
    single = api_a.post(
        "/api/v1/jobs/billing.remind/runs",
        {"idempotencyKey": "f", "concurrencyKey": "customer-7", "priority": "bulk"},
    )
    assert single.status_code == 201, single.text
    assert (single.json()["concurrencyKey"], single.json()["priority"]) == ("customer-7", "bulk")
    run = stored_one(Run, idempotency_key="f")
    assert run.concurrency_key == "customer-7"
    shown = api_a.get(f"/api/v1/runs/{single.json()['runId']}").json()
    assert shown["concurrencyKey"] == "customer-7"
    assert not stored(Run, idempotency_key__in=["c", "d", "e"])


@pytest.mark.parametrize("accept", ["application/json", "application/json; indent=2"])
def test_prefer_return_minimal_answers_runs_by_id_on_both_dispatch_paths(api_a, jobs, accept):
    # The plain Accept takes the fast dispatch, the other DRF's: both honour the preference.
    api_a.post("/api/v1/runs", {"runs": [{"job": "billing.remind", "idempotencyKey": "old"}]})
    items = [
        {"job": "billing.remind", "idempotencyKey": "new"},
        {"job": "billing.remind", "idempotencyKey": "old"},
        {"job": "no.such-job"},
        {"job": "billing.send-invoice", "idempotencyKey": "old", "payload": {"kind": "x"}},
        {"job": "billing.remind", "idempotencyKey": "new"},  # twice in one batch
    ]
    answer = api_a.post(
        "/api/v1/runs",
        {"runs": items},
        headers={"Prefer": "respond-async, return=minimal; x=1", "Accept": accept},
    )
    assert answer.status_code == 200, answer.text
    assert answer.headers["Preference-Applied"] == "return=minimal"
    runs = answer.json()["runs"]
    assert [item["status"] for item in runs] == [201, 200, 404, 201, 200]
    ids = {run.idempotency_key + run.definition.name: run.run_id for run in stored(Run)}
    assert runs[0] == {"status": 201, "runId": ids["newbilling.remind"]}
    assert runs[1] == {"status": 200, "runId": ids["oldbilling.remind"]}
    assert runs[3] == {"status": 201, "runId": ids["oldbilling.send-invoice"]}
    assert runs[4] == {"status": 200, "runId": ids["newbilling.remind"]}
    assert set(runs[2]) >= {"type", "title", "detail"}
    # The new runs are audited as whole answers are: one event per job, naming the run.
    created = AuditEvent.objects.get(action="run.create", target=ids["newbilling.remind"])
    assert created.after["job"] == "billing.remind"
    assert created.after["idempotencyKey"] == "new"
    assert created.after["dueAt"] == format_utc(stored_one(Run, idempotency_key="new").due_at)
    # Without the preference, the whole run, and no Preference-Applied.
    full = api_a.post("/api/v1/runs", {"runs": items[:1]}, headers={"Accept": accept})
    assert full.json()["runs"][0]["run"]["runId"] == ids["newbilling.remind"]
    assert "Preference-Applied" not in full.headers


@pytest.mark.parametrize(
    "body",
    [{}, {"runs": []}, {"runs": {}}, {"runs": [1] * 1001}, {"runs": [{"job": "a"}], "extra": 1}],
)
def test_a_bad_batch_is_refused_whole(api_a, jobs, body):
    answer = api_a.post("/api/v1/runs", body)
    assert answer.status_code == 400, answer.text
    assert not stored(Run)


def test_enqueue_is_limited_per_run_created_not_per_request(api_a, jobs, settings):
    settings.SCHEDULER_API_RATES = {"worker": "", "manage": "20/s", "enqueue": "1500/min"}
    batch = [{"job": "billing.remind"} for _ in range(1000)]
    # Counted over the last minute, in slices: start just after a minute begins, so the
    # batches' slices are all still inside it.
    minute = datetime.now(UTC).replace(second=1, microsecond=0) + timedelta(minutes=1)
    with time_machine.travel(minute, tick=True):
        _over_budget(api_a, batch)


def test_items_that_create_nothing_leave_the_enqueue_budget_as_it_was(api_a, jobs, settings):
    """An existing run (200), a conflict (409) or a bad item (400) creates no run: only
    created ones count against SCHEDULER_API_RATE_ENQUEUE (a request is still refused when its
    items, were they all new, would pass it)."""
    settings.SCHEDULER_API_RATES = {"worker": "", "manage": "", "enqueue": "20/min"}
    keyed = [{"job": "billing.remind", "idempotencyKey": f"k{n}"} for n in range(8)]
    minute = datetime.now(UTC).replace(second=1, microsecond=0) + timedelta(minutes=1)
    with time_machine.travel(minute, tick=True):
        first = api_a.post("/api/v1/runs", {"runs": keyed})
        assert [item["status"] for item in first.json()["runs"]] == [201] * 8
        for _ in range(3):
            again = api_a.post("/api/v1/runs", {"runs": keyed})
            assert [item["status"] for item in again.json()["runs"]] == [200] * 8
        bad = api_a.post("/api/v1/runs", {"runs": [{"job": "billing.remind", "priority": "x"}]})
        assert bad.json()["runs"][0]["status"] == 400
        # 8 created so far: twelve more fit, a thirteenth does not.
        more = api_a.post("/api/v1/runs", {"runs": [{"job": "billing.remind"}] * 12})
        assert [item["status"] for item in more.json()["runs"]] == [201] * 12
        assert api_a.post("/api/v1/runs", {"runs": [{"job": "billing.remind"}]}).status_code == 429
    assert len(stored(Run)) == 20


def test_a_batch_larger_than_the_whole_budget_is_a_400_not_a_429_to_wait_out(api_a, jobs, settings):
    settings.SCHEDULER_API_RATES = {"worker": "", "manage": "", "enqueue": "200/s"}
    answer = api_a.post("/api/v1/runs", {"runs": [{"job": "billing.remind"}] * 201})
    assert answer.status_code == 400, answer.text
    assert answer.json()["type"].endswith("/batch-over-rate")
    assert "send at most 200 a request" in answer.json()["detail"]
    assert not stored(Run)
    assert (
        api_a.post("/api/v1/runs", {"runs": [{"job": "billing.remind"}] * 200}).status_code == 200
    )


def _over_budget(api_a, batch: list[dict]) -> None:
    assert api_a.post("/api/v1/runs", {"runs": batch}).status_code == 200
    refused = api_a.post("/api/v1/runs", {"runs": batch})
    assert refused.status_code == 429
    assert int(refused.headers["Retry-After"]) >= 1
    assert len(stored(Run)) == 1000  # the refused batch created nothing
    # 500 more fit the budget; management calls have their own.
    assert api_a.post("/api/v1/runs", {"runs": batch[:500]}).status_code == 200
    assert api_a.get("/api/v1/jobs").status_code == 200
    assert len(stored(Run)) == 1500


def test_many_small_enqueues_are_not_held_to_the_management_rate(api_a, jobs):
    # 20 requests/s is the management budget; 40 single creates in a row stay within the
    # enqueue budget (runs per second), so none is refused.
    codes = [api_a.post("/api/v1/jobs/billing.remind/runs", {}).status_code for _ in range(40)]
    assert codes == [201] * 40


def test_a_run_enqueued_for_a_paused_job_is_created_and_held_until_the_resume(api_a, jobs):
    assert api_a.post("/api/v1/jobs/billing.remind/pause").status_code == 200
    answer = api_a.post("/api/v1/runs", {"runs": [{"job": "billing.remind"}]})
    (item,) = answer.json()["runs"]
    assert (item["status"], item["run"]["state"]) == (201, "ready")
    assert api_a.lease(["billing"], 10) == []
    why = api_a.get(f"/api/v1/runs/{item['run']['runId']}/why").json()
    assert "paused" in str(why).lower()
    assert api_a.post("/api/v1/jobs/billing.remind/resume").status_code == 200
    (lease,) = api_a.lease(["billing"], 10)
    assert lease["runId"] == item["run"]["runId"]


def test_a_key_of_the_form_of_the_jobs_fire_time_keys_is_refused(api_a, jobs):
    """Such a run held its fire time's key: the cron run of that time, its catch-up or its
    backfill was then skipped as made already, and the time had no run at it."""
    name = "billing.send-invoice"
    taken = f"{name}@2026-12-05T03:00:00+00:00"
    single = api_a.post(f"/api/v1/jobs/{name}/runs", {"idempotencyKey": taken})
    assert single.status_code == 400 and "idempotencyKey" in single.json()["errors"], single.text
    bulk = api_a.post(
        "/api/v1/runs",
        {
            "runs": [
                {"job": name, "idempotencyKey": taken},
                {"job": name, "idempotencyKey": f"{name}@order-1"},
            ]
        },
    ).json()["runs"]
    assert [item["status"] for item in bulk] == [400, 201]
    assert "the schedule's own" in bulk[0]["errors"]["idempotencyKey"][0]
    assert [run.idempotency_key for run in stored(Run)] == [f"{name}@order-1"]


def test_a_trigger_through_the_api_is_an_event_of_the_job(api_a, jobs):
    """It was audited as `run.create`, as a producer's run: a filter on `job.trigger` and the
    job's history left it out."""
    name = "billing.send-invoice"
    run_id = api_a.post(f"/api/v1/jobs/{name}/trigger").json()["runId"]
    (event,) = AuditEvent.objects.filter(action="job.trigger")
    assert (event.target_type, event.target, event.after) == ("job", name, {"runIds": [run_id]})
    assert not AuditEvent.objects.filter(action="run.create").exists()


def _big(fill: str) -> dict:
    return {"rows": [fill * 100 for _ in range(60)]}  # 6 KB: kept in storage


def _blobs(folder) -> set[str]:
    return {path.name for path in folder.rglob("*.json")}


def test_an_enqueue_that_makes_no_run_leaves_no_stored_payload(api_a, jobs, payload_folder):
    """A key sent again with another large payload (409), alone or twice in a batch: its
    payload was stored before the insert found the key taken, and stayed, referred to by
    nothing, for ever. The run's own payload stays."""
    from apps.runs.models import PayloadBlob

    path = "/api/v1/jobs/billing.remind/runs"
    made = api_a.post(path, {"idempotencyKey": "big", "payload": _big("a")})
    assert made.status_code == 201, made.text
    kept = _blobs(payload_folder)
    assert len(kept) == 1
    assert api_a.post(path, {"idempotencyKey": "big", "payload": _big("b")}).status_code == 409
    assert api_a.post(path, {"idempotencyKey": "big", "payload": _big("a")}).status_code == 200
    items = [{"job": "billing.remind", "idempotencyKey": "big", "payload": _big(f)} for f in "cd"]
    answer = api_a.post("/api/v1/runs", {"runs": items})
    assert [item["status"] for item in answer.json()["runs"]] == [409, 409]
    assert _blobs(payload_folder) == kept
    assert {key.split("/")[-1] for key in PayloadBlob.objects.values_list("key", flat=True)} <= kept
    (run,) = stored(Run)
    assert api_a.get(f"/api/v1/runs/{run.run_id}").json()["payload"] == _big("a")


def test_a_refused_enqueue_gives_back_its_charge_and_its_stored_payloads(
    api_a, jobs, settings, payload_folder
):
    """The database refused the batch (here at its commit; a lock waited out is the same): no
    run was made, so the enqueue budget is as it was (the client's retry of the 503 was a 429
    for the whole window) and the large payloads stored for it are gone."""
    from django.db import connections

    from apps.jobs.models import JobDefinition
    from apps.runs import shards

    settings.SCHEDULER_API_RATES = {"worker": "", "manage": "", "enqueue": "6/min"}
    (job,) = stored(JobDefinition, name="billing.remind")
    alias = shards.alias_of_shard(job.shard)
    items = [{"job": "billing.remind", "payload": _big(str(n))} for n in range(6)]
    minute = datetime.now(UTC).replace(second=1, microsecond=0) + timedelta(minutes=1)
    with time_machine.travel(minute, tick=True):
        with connections[alias].cursor() as cursor:
            cursor.execute(
                "CREATE FUNCTION refuse_at_commit() RETURNS trigger LANGUAGE plpgsql"
                " AS $$ BEGIN RAISE EXCEPTION 'refused at commit'; END $$;"
                " CREATE CONSTRAINT TRIGGER refuse_at_commit AFTER INSERT ON runs_run"
                " DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION refuse_at_commit()"
            )
        try:
            refused = api_a.post("/api/v1/runs", {"runs": items})
        finally:
            with connections[alias].cursor() as cursor:
                cursor.execute("DROP TRIGGER refuse_at_commit ON runs_run;"
                               " DROP FUNCTION refuse_at_commit()")  # fmt: skip
        # One database: the request is refused; shards on their own: each of its items.
        if refused.status_code == 200:
            assert [item["status"] for item in refused.json()["runs"]] == [503] * 6
        else:
            assert refused.status_code == 503, refused.text
        assert not stored(Run) and not _blobs(payload_folder)
        again = api_a.post("/api/v1/runs", {"runs": items})
        assert [item["status"] for item in again.json()["runs"]] == [201] * 6, again.text
    assert len(_blobs(payload_folder)) == 6
