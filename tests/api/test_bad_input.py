"""Bad input gets a problem-details answer naming every bad field, and leaves no row behind."""

from __future__ import annotations

import pytest

from apps.audit.models import AuditEvent
from apps.jobs.models import JobDefinition
from apps.runs.ids import public_run_id
from apps.runs.models import Run
from tests.conftest import add_ready_runs, make_definition

JSON = {"Content-Type": "application/json"}

pytestmark = pytest.mark.django_db(transaction=True)


def assert_problem(answer, status: int, fields: set[str] = frozenset()) -> dict:
    assert answer.status_code == status, answer.text
    assert answer.headers["content-type"].startswith("application/problem+json")
    body = answer.json()
    assert {"type", "title", "status", "detail"} <= set(body)
    assert body["status"] == status
    assert fields <= set(body.get("errors", {})), body
    return body


def test_every_bad_field_is_named(api_a):
    answer = api_a.post(
        "/api/v1/jobs",
        {
            "name": "Bad Name!",
            "priority": "urgent",
            "timeoutSeconds": -5,
            "retry": {"maxAttempts": "three"},
            "concurrency": True,
            "schedule": {"cron": "61 * * * *", "timeZone": "Mars/Base"},
            "colour": "blue",
        },
    )
    body = assert_problem(
        answer,
        400,
        {
            "name",
            "priority",
            "timeoutSeconds",
            "retry.maxAttempts",
            "concurrency",
            "schedule.cron",
            "schedule.timeZone",
            "colour",
        },
    )
    assert "Mars/Base" in " ".join(body["errors"]["schedule.timeZone"])
    assert JobDefinition.objects.count() == 0 and AuditEvent.objects.count() == 0


def test_malformed_json_is_400(api_a):
    answer = api_a.post(
        "/api/v1/jobs", content=b'{"name": ', headers={"content-type": "application/json"}
    )
    assert_problem(answer, 400)


def test_a_non_object_body_is_400(api_a):
    assert_problem(api_a.post("/api/v1/jobs", [1, 2]), 400)


def test_two_megabyte_payload_is_413_and_writes_nothing(api_a):
    api_a.post("/api/v1/jobs", {"name": "big.job"})
    huge = {"blob": "x" * (2 * 1024 * 1024)}
    assert_problem(api_a.post("/api/v1/jobs/big.job/runs", {"payload": huge}), 413)
    assert_problem(api_a.post("/api/v1/jobs", {"name": "big.two", "payload": huge}), 413)
    assert Run.objects.count() == 0
    assert JobDefinition.objects.filter(name="big.two").count() == 0


def test_payload_just_over_the_cap_is_413(api_a):
    api_a.post("/api/v1/jobs", {"name": "big.job"})
    over = {"blob": "x" * (1024 * 1024)}
    assert_problem(api_a.post("/api/v1/jobs/big.job/runs", {"payload": over}), 413)


def test_missing_fencing_token_is_named(api_a, team_a):
    definition = make_definition(team_a, "jobs.x", queue="q")
    add_ready_runs(definition, 1)
    (lease,) = api_a.lease(["q"], 1)
    assert_problem(api_a.post(f"/api/v1/runs/{lease['runId']}/complete", {}), 400, {"fencingToken"})
    assert_problem(
        api_a.post(f"/api/v1/runs/{lease['runId']}/heartbeat", {"fencingToken": "41"}),
        400,
        {"fencingToken"},
    )
    assert Run.objects.get().state == "leased"


def test_bad_lease_requests(api_a):
    body = assert_problem(
        api_a.post(
            "/api/v1/leases", {"queues": [], "max": 0, "leaseSeconds": -1, "waitSeconds": 999}
        ),
        400,
        {"queues", "max", "workerId", "leaseSeconds", "waitSeconds"},
    )
    assert body["detail"].startswith("Invalid input")


def test_unknown_run_id_is_404(api_a):
    assert_problem(api_a.get("/api/v1/runs/run_ZZZZZZZ"), 404)
    assert_problem(api_a.post("/api/v1/runs/not-a-run/complete", {"fencingToken": 1}), 404)


def test_a_format_the_api_does_not_render_is_406_naming_json(api_a):
    for answer in (
        api_a.get("/api/v1/runs", params={"format": "xml"}),
        api_a.get("/api/v1/jobs", params={"format": "api"}),
        api_a.post("/api/v1/leases?format=xml", {"queues": ["q"], "workerId": "w"}),
    ):
        body = assert_problem(answer, 406)
        assert body["type"].endswith("/not-acceptable") and "json" in body["detail"], body
    assert api_a.get("/api/v1/jobs", params={"format": "json"}).status_code == 200


def test_json_weighed_zero_in_accept_is_refused_not_served(api_a):
    refused = api_a.get("/api/v1/jobs", headers={"Accept": "application/json;q=0, text/html"})
    assert_problem(refused, 406)
    posted = api_a.post(
        "/api/v1/leases", {"queues": ["q"], "workerId": "w"}, headers={"Accept": "*/*;q=0"}
    )
    assert_problem(posted, 406)
    # Refused by name, it stays refused whatever a wildcard beside it says.
    for accept in ("application/json;q=0, */*", "*/*, Application/JSON; q=0.0"):
        assert_problem(api_a.get("/api/v1/jobs", headers={"Accept": accept}), 406)
    # A weight above 0 is still JSON, and so is anything that accepts it.
    for accept in ("application/json;q=0.5", "text/html, */*;q=0.1", "*/*"):
        assert api_a.get("/api/v1/jobs", headers={"Accept": accept}).status_code == 200, accept


def test_a_call_that_takes_no_body_refuses_any_but_an_empty_object(api_a, team_a):
    definition = make_definition(team_a, "nobody.cancel", queue="q")
    (pk,) = add_ready_runs(definition, 1)
    run_id = Run.objects.get(pk=pk).run_id
    for sent in ("[]", "null", '""', "0", '{"x": 1}'):
        answer = api_a.http.post(
            f"/api/v1/runs/{run_id}/cancel",
            content=sent,
            headers={"Content-Type": "application/json"},
        )
        assert assert_problem(answer, 400, {"body"})["errors"]["body"] == [
            "This call takes no body."
        ]
    typed = {"Content-Type": "text/plain"}  # as its schema declares: 415
    assert_problem(
        api_a.http.post(f"/api/v1/runs/{run_id}/cancel", content="x", headers=typed), 415
    )
    assert Run.objects.get(pk=pk).state != "cancelled"
    assert api_a.post(f"/api/v1/runs/{run_id}/cancel", {}).status_code == 200
    assert Run.objects.get(pk=pk).state == "cancelled"


def test_bad_filters_and_counts(api_a):
    assert_problem(api_a.get("/api/v1/runs", params={"state": "sleeping"}), 400, {"state"})
    assert_problem(api_a.get("/api/v1/runs", params={"since": "yesterday"}), 400, {"since"})
    api_a.post("/api/v1/jobs", {"name": "p.q", "schedule": {"cron": "* * * * *"}})
    assert_problem(api_a.get("/api/v1/jobs/p.q/preview", params={"count": 5000}), 400, {"count"})
    both = api_a.get("/api/v1/jobs/p.q/preview", params={"count": "abc", "from": "xyz"})
    assert set(assert_problem(both, 400)["errors"]) == {"count", "from"}


def test_a_preview_from_the_calendars_edge_is_refused_not_answered_empty(api_a):
    api_a.post("/api/v1/jobs", {"name": "p.q", "schedule": {"cron": "0 3 * * *"}})
    for edge in ("0001-01-01T00:00:00Z", "9999-06-01T00:00:00Z"):
        saved = api_a.get("/api/v1/jobs/p.q/preview", params={"from": edge})
        assert assert_problem(saved, 400, {"from"})["errors"]["from"] == [
            "A time between the years 2 and 9998."
        ]
        unsaved = api_a.post("/api/v1/preview", {"schedule": {"cron": "0 3 * * *"}, "from": edge})
        assert_problem(unsaved, 400, {"from"})
    early = api_a.get("/api/v1/jobs/p.q/preview", params={"from": "0002-01-01T00:00:00Z"})
    assert early.json()["times"][0]["utc"] == "0002-01-01T03:00:00Z"


def test_never_firing_cron_is_400(api_a):
    assert_problem(
        api_a.post("/api/v1/jobs", {"name": "never.runs", "schedule": {"cron": "0 0 30 2 *"}}),
        400,
        {"schedule.cron"},
    )


def test_large_payload_round_trips_through_storage(api_a, team_a, payload_folder):
    api_a.post("/api/v1/jobs", {"name": "big.job", "queue": "big"})
    payload = {"rows": ["x" * 100 for _ in range(1000)]}  # about 100 KB
    created = api_a.post("/api/v1/jobs/big.job/runs", {"payload": payload})
    assert created.status_code == 201, created.text
    assert created.json()["payload"] == payload
    run = Run.objects.get()
    assert run.payload is None and run.payload_key.startswith("payloads/")
    assert (payload_folder / run.payload_key).exists()
    (lease,) = api_a.lease(["big"], 1)
    assert lease["payload"] == payload
    small = api_a.post("/api/v1/jobs/big.job/runs", {"payload": {"a": 1}}).json()
    assert Run.objects.get(pk__gt=run.pk).payload == {"a": 1} and small["payload"] == {"a": 1}


@pytest.mark.parametrize(
    ("content", "headers", "status", "says"),
    [
        (b'{"runs": []}', {"Content-Type": "text/plain"}, 415, "with Content-Type: application"),
        (b'{"runs": [{"job": "\xff\xfe"}]}', JSON, 400, "not UTF-8 text (byte 19 is not)"),
        (b'{"runs": [{"job": "\\ud800"}]}', JSON, 400, "surrogate"),
    ],
    ids=["text", "not-utf8", "lone-surrogate"],
)
def test_a_body_that_is_not_json_text_is_refused_saying_why(api_a, content, headers, status, says):
    answer = api_a.http.post("/api/v1/runs", content=content, headers=headers)
    body = assert_problem(answer, status)
    assert says in body["detail"], body


@pytest.mark.parametrize(
    "at",
    ["２０３０-01-01T00:00:00Z", "2030-01-01T00:00:00+05:30:15", "2030-01-01T00:00:00+0530:15"],
)
def test_a_run_time_in_other_digits_or_with_offset_seconds_is_refused(api_a, team_a, at):
    make_definition(team_a, "odd.time", queue="odd")
    body = {"runs": [{"job": "odd.time", "runAt": at}]}
    (item,) = api_a.post("/api/v1/runs", body).json()["runs"]
    assert (item["status"], list(item["errors"])) == (400, ["runAt"])
    accepted = {"runs": [{"job": "odd.time", "runAt": "2030-01-01T00:00:00+05:30"}]}
    (item,) = api_a.post("/api/v1/runs", accepted).json()["runs"]
    assert item["status"] == 201
    assert item["run"]["dueAt"] == "2029-12-31T18:30:00Z"


def test_a_path_that_is_no_job_name_is_404_saying_why(api_a):
    body = assert_problem(api_a.post("/api/v1/jobs/A%20B/runs", {}), 404)
    assert "No job named 'A B'" in body["detail"] and "lowercase" in body["detail"], body


def test_a_query_parameter_a_call_does_not_take_is_a_400_naming_it(api_a, team_a):
    """`?error=boom` or `?stat=dead` listed every run, as if no filter had been asked for."""
    (dead,) = add_ready_runs(make_definition(team_a, "billing.listed", queue="q"), 1)
    Run.objects.filter(pk=dead).update(state="dead")
    for url, unknown, takes in (
        ("/api/v1/runs?stat=dead", "stat", "it takes cursor, job, limit, queue, since, state"),
        ("/api/v1/dlq?stat=dead", "stat", "it takes cursor, job, limit, queue, since, state"),
        ("/api/v1/jobs?name=billing.listed", "name", "it takes none"),
        ("/api/v1/alerts?limits=5", "limits", "it takes cursor, limit"),
        ("/api/v1/workers?minute=5", "minute", "it takes minutes"),
        ("/api/v1/jobs/billing.listed/preview?counts=3", "counts", "it takes count, from"),
    ):
        body = assert_problem(api_a.get(url), 400)
        assert body["errors"] == {unknown: [f"Not a parameter of this call ({takes})."]}, url
    assert api_a.get("/api/v1/runs?state=dead&format=json").status_code == 200
    # The DLQ is filtered like the run list: `state` too (dead runs in that state).
    assert api_a.get("/api/v1/dlq?state=ready").json()["results"] == []
    listed = api_a.get("/api/v1/dlq?state=dead").json()["results"]
    assert [run["runId"] for run in listed] == [public_run_id(dead)]
    assert api_a.get("/api/v1/jobs/billing.listed/preview?count=3").status_code == 200
