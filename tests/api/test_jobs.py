"""Job definitions through the management API, and ad-hoc runs with idempotency keys."""

from __future__ import annotations

from datetime import timedelta
from importlib import import_module

import pytest
from django.db import connection
from django.utils.dateparse import parse_datetime

from apps.audit.models import AuditEvent
from apps.audit.record import Actor
from apps.jobs.models import JobDefinition
from apps.runs import shards, store
from apps.runs.clock import format_utc
from apps.runs.ids import public_run_id
from apps.runs.models import Run
from tests.conftest import db_now, sent_behind_a_change

pytestmark = pytest.mark.django_db(transaction=True)

EXPORT = {
    "name": "billing.export-invoices",
    "schedule": {
        "cron": "0 2 * * *",
        "timeZone": "Europe/Berlin",
        "jitterSeconds": 0,
        "missedRunPolicy": "run_once",
        "overlapPolicy": "allow_all",
    },
    "queue": "billing",
    "priority": "critical",
    "timeoutSeconds": 900,
    "retry": {"maxAttempts": 5, "baseSeconds": 30, "maxSeconds": 1800},
    "concurrency": 1,
    "payload": {"format": "csv"},
}


def test_create_read_and_list(api_a):
    created = api_a.post("/api/v1/jobs", EXPORT)
    assert created.status_code == 201, created.text
    body = created.json()
    for key, value in EXPORT.items():
        assert body[key] == value
    assert body["nextDueAt"].endswith("Z")
    assert api_a.get("/api/v1/jobs/billing.export-invoices").json()["name"] == EXPORT["name"]
    assert [job["name"] for job in api_a.get("/api/v1/jobs").json()["results"]] == [EXPORT["name"]]
    assert AuditEvent.objects.get(action="job.create").source == "api"


def test_defaults_fill_in(api_a):
    body = api_a.post(
        "/api/v1/jobs", {"name": "ops.minimal", "schedule": {"cron": "*/5 * * * *"}}
    ).json()
    assert body["schedule"] == {
        "cron": "*/5 * * * *",
        "timeZone": "UTC",
        "jitterSeconds": 60,
        "missedRunPolicy": "run_once",
        "overlapPolicy": "allow_all",
    }
    assert body["priority"] == "default" and body["queue"] == "default"


def test_put_creates_then_replaces_and_audits_the_diff(api_a):
    first = api_a.put("/api/v1/jobs/billing.export-invoices", EXPORT)
    assert first.status_code == 201
    changed = {**EXPORT, "schedule": {**EXPORT["schedule"], "cron": "0 3 * * *"}}
    second = api_a.put("/api/v1/jobs/billing.export-invoices", changed)
    assert second.status_code == 200
    assert second.json()["schedule"]["cron"] == "0 3 * * *"
    event = AuditEvent.objects.get(action="job.update")
    assert (
        event.before["schedule"]["cron"] == "0 2 * * *"
        and event.after["schedule"]["cron"] == "0 3 * * *"
    )
    # The same body again changes nothing and records nothing.
    api_a.put("/api/v1/jobs/billing.export-invoices", changed)
    assert AuditEvent.objects.filter(action="job.update").count() == 1


def test_patch_merges_and_delete_removes(api_a):
    api_a.post("/api/v1/jobs", EXPORT)
    patched = api_a.patch(
        "/api/v1/jobs/billing.export-invoices", {"retry": {"maxAttempts": 9}, "priority": "bulk"}
    )
    assert patched.status_code == 200, patched.text
    assert patched.json()["retry"] == {"maxAttempts": 9, "baseSeconds": 30, "maxSeconds": 1800}
    assert patched.json()["priority"] == "bulk"
    assert api_a.delete("/api/v1/jobs/billing.export-invoices").status_code == 204
    assert api_a.get("/api/v1/jobs/billing.export-invoices").status_code == 404


def test_a_job_being_deleted_is_gone_and_its_name_not_yet_free(api_a):
    """Between the start of a delete and its end (its runs going in batches) the job answers
    404, and a create of its name, by any of the three calls that create, a 409 that says why;
    nothing is created."""
    api_a.post("/api/v1/jobs", EXPORT)
    name = EXPORT["name"]
    JobDefinition.objects.filter(name=name).update(deleting=True)  # the delete's first step
    path = f"/api/v1/jobs/{name}"
    assert api_a.get(path).status_code == 404
    assert api_a.patch(path, {"priority": "bulk"}).status_code == 404
    assert api_a.delete(path).status_code == 404
    assert name not in [job["name"] for job in api_a.get("/api/v1/jobs").json()["results"]]
    refusals = [
        api_a.post("/api/v1/jobs", EXPORT),
        api_a.put(path, EXPORT),
        api_a.put("/api/v1/jobs", {"jobs": [EXPORT, {"name": "other.job", "queue": "q"}]}),
    ]
    for refused in refusals:
        assert refused.status_code == 409, refused.text
        assert "is being deleted; create it again once it is gone" in refused.json()["detail"]
    assert not JobDefinition.objects.filter(name="other.job").exists()  # the sync changed nothing
    assert AuditEvent.objects.filter(action="job.create").count() == 1


def test_a_null_in_a_patch_drops_the_field_to_its_default_whatever_the_field(api_a):
    api_a.post("/api/v1/jobs", {**EXPORT, "owner": "ops", "priority": "bulk",
                                "retry": {"maxAttempts": 9, "baseSeconds": 5, "maxSeconds": 60}})  # fmt: skip
    path = "/api/v1/jobs/billing.export-invoices"
    patched = api_a.patch(
        path,
        {"owner": None, "priority": None, "timeoutSeconds": None, "retry": {"maxAttempts": None}},
    )
    assert patched.status_code == 200, patched.text
    job = patched.json()
    assert (job["owner"], job["priority"], job["timeoutSeconds"]) == ("", "default", 3600)
    assert job["retry"] == {"maxAttempts": 3, "baseSeconds": 5, "maxSeconds": 60}
    assert api_a.patch(path, {"retry": None}).json()["retry"] == {
        "maxAttempts": 3, "baseSeconds": 30, "maxSeconds": 1800,
    }  # fmt: skip


def test_a_null_for_a_field_no_job_has_is_a_400_not_a_quiet_200(api_a):
    """Nulls were dropped before the merged job was validated: a misspelt field meant to be
    cleared answered 200 and changed nothing."""
    api_a.post("/api/v1/jobs", {**EXPORT, "owner": "ops"})
    path = "/api/v1/jobs/billing.export-invoices"
    before = api_a.get(path).json()
    for body, field in [
        ({"ownr": None}, "ownr"),
        ({"": None}, "body"),  # a field without a name: the body is at fault
        ({"retry": {"maxAttempt": None}}, "retry.maxAttempt"),
        ({"schedule": {"timezone": None}}, "schedule.timezone"),
    ]:
        refused = api_a.patch(path, body)
        assert refused.status_code == 400, (body, refused.text)
        assert refused.json()["errors"] == {field: ["Unknown field."]}, refused.text
    assert api_a.get(path).json() == before
    assert api_a.patch(path, {"owner": None, "schedule": {"endAt": None}}).status_code == 200


def test_a_method_the_path_does_not_take_is_a_405_whatever_its_query_or_body(api_a):
    for method, path, kwargs in [
        ("DELETE", "/api/v1/runs", {"json": {"a": 1}}),
        ("PUT", "/api/v1/runs?limit=5", {}),
        ("POST", "/api/v1/jobs/x/why?count=3", {}),
    ]:
        answer = api_a.http.request(method, path, **kwargs)
        assert answer.status_code == 405, (method, path, answer.text)
        assert answer.headers["content-type"].startswith("application/problem+json")
        assert method not in answer.headers["Allow"]


def test_patch_of_a_cron_schedule_keeps_its_zone_and_another_kind_replaces_it(api_a):
    api_a.post("/api/v1/jobs", EXPORT)
    path = "/api/v1/jobs/billing.export-invoices"
    patched = api_a.patch(path, {"schedule": {"cron": "0 3 * * *"}})
    assert patched.status_code == 200, patched.text
    assert patched.json()["schedule"] == {**EXPORT["schedule"], "cron": "0 3 * * *"}
    # A null drops a field: the default comes back.
    patched = api_a.patch(path, {"schedule": {"jitterSeconds": None}})
    assert patched.json()["schedule"]["jitterSeconds"] == 60
    assert patched.json()["schedule"]["timeZone"] == "Europe/Berlin"
    # A schedule of another kind, or none, is not merged into the cron one.
    one_off = {"runAt": "2099-01-01T00:00:00Z"}
    assert api_a.patch(path, {"schedule": one_off}).json()["schedule"] == one_off
    assert api_a.patch(path, {"schedule": {}}).json()["schedule"] == {}


def test_pause_resume_and_trigger(api_a):
    api_a.post("/api/v1/jobs", {**EXPORT, "concurrency": None})
    assert api_a.post("/api/v1/jobs/billing.export-invoices/pause").json()["paused"] is True
    run = api_a.post("/api/v1/jobs/billing.export-invoices/trigger")
    assert run.status_code == 201 and run.json()["trigger"] == "api"
    assert api_a.lease(["billing"], 5) == []  # paused definitions are not leased
    resumed = api_a.post("/api/v1/jobs/billing.export-invoices/resume").json()
    assert resumed["paused"] is False
    assert [lease["runId"] for lease in api_a.lease(["billing"], 5)] == [run.json()["runId"]]
    assert list(
        AuditEvent.objects.filter(action__in=["job.pause", "job.resume"])
        .values_list("action", flat=True)
        .order_by("id")
    ) == ["job.pause", "job.resume"]


def test_same_idempotency_key_returns_the_same_run(api_a):
    api_a.post("/api/v1/jobs", {"name": "orders.ship", "queue": "orders"})
    first = api_a.post(
        "/api/v1/jobs/orders.ship/runs",
        {"idempotencyKey": "order-991", "delaySeconds": 300, "payload": {"order": 991}},
    )
    assert first.status_code == 201, first.text
    again = api_a.post(
        "/api/v1/jobs/orders.ship/runs", {"idempotencyKey": "order-991", "delaySeconds": 300}
    )
    assert again.status_code == 200
    assert again.json()["runId"] == first.json()["runId"]
    assert Run.objects.count() == 1
    body = first.json()
    assert (
        body["state"] == "scheduled"
        and body["payload"] == {"order": 991}
        and body["idempotencyKey"] == "order-991"
    )
    expected = {
        "runId",
        "job",
        "queue",
        "priority",
        "state",
        "attempt",
        "maxAttempts",
        "dueAt",
        "availableAt",
        "idempotencyKey",
        "fencingToken",
        "leaseExpiresAt",
        "workerId",
        "trigger",
        "dryRun",
        "payload",
        "lastError",
        "createdAt",
        "startedAt",
        "finishedAt",
    }
    assert expected <= set(body)


def test_run_at_creates_a_one_off_run(api_a):
    api_a.post("/api/v1/jobs", {"name": "orders.remind", "queue": "orders"})
    body = api_a.post("/api/v1/jobs/orders.remind/runs", {"runAt": "2030-01-01T10:00:00Z"}).json()
    assert body["dueAt"] == "2030-01-01T10:00:00Z" and body["state"] == "scheduled"


def test_runs_list_filters_and_pages(api_a, team_a):
    from tests.conftest import add_ready_runs, make_definition

    definition = make_definition(team_a, "list.me", queue="lq")
    add_ready_runs(definition, 7)
    page = api_a.get("/api/v1/runs", params={"job": "list.me", "state": "ready", "limit": 5}).json()
    assert len(page["results"]) == 5 and page["next"]
    rest = api_a.get(page["next"]).json()
    assert len(rest["results"]) == 2 and rest["next"] is None
    ids = [r["runId"] for r in page["results"] + rest["results"]]
    assert len(set(ids)) == 7
    assert api_a.get("/api/v1/runs", params={"state": "succeeded"}).json()["results"] == []
    detail = api_a.get(f"/api/v1/runs/{ids[0]}").json()
    assert detail["runId"] == ids[0] and detail["attempts"] == []


def test_a_page_whose_runs_go_while_it_is_read_is_short_and_the_walk_goes_on(api_a, team_a):
    """The list finds a page's ids, then reads their rows: runs deleted in between (retention,
    a job's delete) made the answer a 500 (the next cursor was the last run read, and there was
    none); a run that moved out of the filter meanwhile (a DLQ run requeued) was shown under it."""
    from unittest import mock

    from apps.jobs import runlist
    from apps.runs import transitions
    from tests.conftest import add_ready_runs, make_definition
    from tests.dashboard.conftest import failed_runs

    definition = make_definition(team_a, "list.gone", queue="lq")
    add_ready_runs(definition, 3)
    found_ids = runlist._page_ids

    def then_deleted(*args, **kwargs):
        found = found_ids(*args, **kwargs)
        Run.objects.filter(pk__in=found.ids[:2]).delete()
        return found

    with mock.patch.object(runlist, "_page_ids", then_deleted):
        page = api_a.get("/api/v1/runs", params={"job": "list.gone", "limit": 2})
    assert page.status_code == 200, page.text
    assert page.json()["results"] == [] and page.json()["next"]
    rest = api_a.get(page.json()["next"]).json()
    assert len(rest["results"]) == 1 and rest["next"] is None

    dead = failed_runs(make_definition(team_a, "list.dead", queue="ld"), 2)

    def then_requeued(*args, **kwargs):
        found = found_ids(*args, **kwargs)
        transitions.requeue([run for run in dead if run.pk in found.ids], Actor.cli("test"))
        return found

    with mock.patch.object(runlist, "_page_ids", then_requeued):
        listed = api_a.get("/api/v1/dlq", params={"job": "list.dead"})
    assert listed.status_code == 200 and listed.json()["results"] == []


def test_a_parameter_given_twice_is_refused(api_a):
    """Its last value was used: `?state=dead&state=ready` listed ready runs."""
    for path in ("/api/v1/runs?state=dead&state=ready", "/api/v1/dlq?limit=600&limit=1",
                 "/api/v1/jobs?limit=1&limit=2", "/api/v1/workers?minutes=5&minutes=6"):  # fmt: skip
        answer = api_a.get(path)
        assert answer.status_code == 400, (path, answer.text)
        (field,) = answer.json()["errors"]
        assert answer.json()["errors"][field] == ["Given more than once."]
    assert api_a.get("/api/v1/runs?state=dead&limit=5").status_code == 200


def test_state_ready_lists_what_the_answers_show_as_ready(api_a, team_a):
    """A run made ready (requeue, retry now) gets available_at = now() of its own transaction,
    which may come after the list's clock: the list still shows it, as `ready`."""
    from django.db import connection

    from tests.conftest import add_ready_runs, make_definition

    definition = make_definition(team_a, "ready.now", queue="rq")
    due, just_made_ready, later = add_ready_runs(definition, 3)
    with connection.cursor() as cursor:
        cursor.execute(
            "UPDATE runs_run SET state = 'ready', available_at = now() + interval '2 seconds'"
            " WHERE id = %s",
            [just_made_ready],
        )
        cursor.execute(
            "UPDATE runs_run SET available_at = now() + interval '1 hour' WHERE id = %s", [later]
        )
    listed = api_a.get("/api/v1/runs", params={"job": "ready.now", "state": "ready"}).json()
    assert {run["runId"] for run in listed["results"]} == {
        public_run_id(due),
        public_run_id(just_made_ready),
    }
    assert {run["state"] for run in listed["results"]} == {"ready"}
    scheduled = api_a.get("/api/v1/runs", params={"job": "ready.now", "state": "scheduled"})
    assert [run["runId"] for run in scheduled.json()["results"]] == [public_run_id(later)]


def test_preview_of_a_saved_job(api_a):
    api_a.post(
        "/api/v1/jobs",
        {
            **EXPORT,
            "schedule": {"cron": "30 2 * * *", "timeZone": "Europe/Berlin", "jitterSeconds": 0},
        },
    )
    times = api_a.get(
        "/api/v1/jobs/billing.export-invoices/preview",
        params={"count": 3, "from": "2026-03-27T12:00:00Z"},
    ).json()["times"]
    assert [t["local"] for t in times] == [
        "2026-03-28T02:30:00+01:00",
        "2026-03-29T03:00:00+02:00",
        "2026-03-30T02:30:00+02:00",
    ]
    assert times[1]["utc"] == "2026-03-29T01:00:00Z" and times[1]["note"]
    assert times[0]["note"] == ""


def test_preview_of_an_unsaved_schedule(api_a):
    answer = api_a.post(
        "/api/v1/preview",
        {
            "name": "x.y",
            "schedule": {"cron": "30 2 * * *", "timeZone": "Europe/Berlin"},
            "from": "2026-10-24T12:00:00Z",
            "count": 2,
        },
    )
    assert answer.status_code == 200, answer.text
    times = answer.json()["times"]
    assert times[0]["local"] == "2026-10-25T02:30:00+02:00"
    assert times[1]["local"] == "2026-10-26T02:30:00+01:00"
    assert JobDefinition.objects.count() == 0


def test_a_delayed_jobs_preview_is_its_one_time_while_ahead_and_nothing_once_made(api_a):
    made = api_a.put("/api/v1/jobs/later.once", {"queue": "q", "schedule": {"delaySeconds": 300}})
    due = made.json()["nextDueAt"]
    preview = "/api/v1/jobs/later.once/preview"
    assert [t["utc"] for t in api_a.get(preview).json()["times"]] == [due]  # to the microsecond
    # A from past the time shows nothing (the answer writes milliseconds: one more is past it).
    past = format_utc(parse_datetime(due) + timedelta(milliseconds=1))
    assert api_a.get(preview, params={"from": past}).json()["times"] == []
    assert api_a.get(preview, params={"from": "9000-01-01T00:00:00Z"}).json()["times"] == []
    JobDefinition.objects.filter(name="later.once").update(next_due_at=None)  # its run was made
    assert api_a.get(preview).json()["times"] == []
    unsaved = api_a.post("/api/v1/preview", {"schedule": {"delaySeconds": 0},
                                             "from": "2031-01-01T00:00:00Z"})  # fmt: skip
    assert [t["utc"] for t in unsaved.json()["times"]] == ["2031-01-01T00:00:00Z"]


# --- cron day rules and schedule bounds ---------------------------------------------------------


def assert_problem(answer, field: str) -> str:
    assert answer.status_code == 400, answer.text
    assert answer.headers["content-type"].startswith("application/problem+json")
    errors = answer.json()["errors"]
    assert field in errors, errors
    return " ".join(errors[field])


@pytest.mark.parametrize(
    ("schedule", "field", "says"),
    [
        ({"cron": "TZ=Europe/Berlin 0 2 * * *"}, "schedule.cron", "set the schedule's timeZone"),
        ({"cron": "CRON_TZ=UTC 0 2 * * *"}, "schedule.cron", "timeZone field to 'UTC'"),
        ({"cron": "L 2 * * *"}, "schedule.cron", "minute field: 'L' is not allowed here"),
        ({"cron": "0 2 * * 5#6"}, "schedule.cron", "day-of-week field: '5#6'"),
        ({"cron": "0 2 32W * *"}, "schedule.cron", "day-of-month field: 32 in '32W'"),
        ({"cron": "0 2 * * LW"}, "schedule.cron", "day-of-week field: 'LW'"),
        (
            {
                "cron": "0 2 * * *",
                "startAt": "2026-06-01T00:00:00Z",
                "endAt": "2026-05-01T00:00:00Z",
            },
            "schedule.endAt",
            "must be after startAt",
        ),
        (
            {"cron": "0 2 * * *", "startAt": "2026-06-01T00:00:00"},
            "schedule.startAt",
            "no UTC offset",
        ),
        ({"cron": "0 2 * * *", "endAt": "9999-06-01T00:00:00Z"}, "schedule.endAt", "later than"),
        (
            {"runAt": "2030-01-01T00:00:00Z", "endAt": "2031-01-01T00:00:00Z"},
            "schedule.endAt",
            "cron",
        ),
        (
            {"cron": "0 2 * * *", "overlapPolicy": "queue"},
            "schedule.overlapPolicy",
            "must be one of allow_all, skip, buffer_one, cancel_other",
        ),
        ({"cron": "0 2 * * *", "overlapPolicy": None}, "schedule.overlapPolicy", "must be one of"),
        (
            {"runAt": "2030-01-01T00:00:00Z", "overlapPolicy": "skip"},
            "schedule.overlapPolicy",
            "only to a cron schedule",
        ),
        (
            {"delaySeconds": 60, "overlapPolicy": "cancel_other"},
            "schedule.overlapPolicy",
            "only to a cron schedule",
        ),
    ],
)
def test_a_bad_cron_or_bound_is_a_problem_naming_the_field(api_a, schedule, field, says):
    answer = api_a.post("/api/v1/jobs", {"name": "bad.schedule", "schedule": schedule})

    assert says in assert_problem(answer, field)
    preview = api_a.post("/api/v1/preview", {"schedule": schedule, "count": 3})
    assert says in assert_problem(preview, field)
    assert JobDefinition.objects.count() == 0


def test_a_bounded_last_weekday_job_previews_and_reads_back_its_bounds(api_a):
    schedule = {
        "cron": "30 2 LW * *",
        "timeZone": "Europe/Berlin",
        "jitterSeconds": 0,
        "startAt": "2030-01-15T00:00:00+01:00",
        "endAt": "2030-03-29T01:30:00Z",
    }
    created = api_a.post("/api/v1/jobs", {"name": "billing.month-end", "schedule": schedule})
    assert created.status_code == 201, created.text
    body = created.json()
    assert body["schedule"]["startAt"] == "2030-01-14T23:00:00Z"
    assert body["schedule"]["endAt"] == "2030-03-29T01:30:00Z"
    assert body["nextDueAt"] == "2030-01-31T01:30:00Z"

    times = api_a.get(
        "/api/v1/jobs/billing.month-end/preview",
        params={"count": 10, "from": "2029-12-01T00:00:00Z"},
    ).json()["times"]

    assert [(t["local"], t["note"]) for t in times] == [
        (
            "2030-01-31T02:30:00+01:00",
            "first run: the schedule starts at 2030-01-14T23:00:00Z (startAt)",
        ),
        ("2030-02-28T02:30:00+01:00", ""),
        (
            "2030-03-29T02:30:00+01:00",
            "last run: the schedule ends at 2030-03-29T01:30:00Z (endAt)",
        ),
    ]
    why = api_a.get("/api/v1/jobs/billing.month-end/why").json()
    (reason,) = [r for r in why["reasons"] if r["code"] == "schedule_not_started"]
    assert reason["message"].startswith("The schedule starts at 2030-01-14T23:00:00Z (startAt)")


def test_an_ended_schedule_has_no_next_due_time_and_why_says_it_ended(api_a):
    schedule = {"cron": "0 * * * *", "endAt": "2020-01-01T00:00:00Z"}
    created = api_a.post("/api/v1/jobs", {"name": "ops.retired", "schedule": schedule})
    assert created.status_code == 201, created.text
    assert created.json()["nextDueAt"] is None

    why = api_a.get("/api/v1/jobs/ops.retired/why").json()
    (reason,) = [r for r in why["reasons"] if r["code"] == "schedule_ended"]
    assert reason["message"] == "The schedule ended at 2020-01-01T00:00:00Z (endAt)."
    assert reason["detail"] == {"endAt": "2020-01-01T00:00:00Z"}
    assert api_a.get("/api/v1/jobs/ops.retired/preview").json()["times"] == []


def test_the_preview_of_an_unsaved_schedule_shows_the_day_rules(api_a):
    answer = api_a.post(
        "/api/v1/preview",
        {
            "schedule": {"cron": "0 9 * * FRI#3", "timeZone": "Europe/Berlin"},
            "from": "2028-01-01T00:00:00Z",
            "count": 3,
        },
    )

    assert answer.status_code == 200, answer.text
    assert [t["local"] for t in answer.json()["times"]] == [
        "2028-01-21T09:00:00+01:00",
        "2028-02-18T09:00:00+01:00",
        "2028-03-17T09:00:00+01:00",
    ]


# --- overlap policy ---------------------------------------------------------------------------


def test_an_overlap_policy_is_stored_answered_changed_and_audited(api_a):
    schedule = {"cron": "*/5 * * * *", "overlapPolicy": "skip"}
    created = api_a.post("/api/v1/jobs", {"name": "etl.load", "schedule": schedule})
    assert created.status_code == 201, created.text
    assert created.json()["schedule"] == {
        "cron": "*/5 * * * *",
        "timeZone": "UTC",
        "jitterSeconds": 60,
        "missedRunPolicy": "run_once",
        "overlapPolicy": "skip",
    }
    assert JobDefinition.objects.get().schedule["overlapPolicy"] == "skip"

    patched = api_a.patch(
        "/api/v1/jobs/etl.load", {"schedule": {**schedule, "overlapPolicy": "cancel_other"}}
    )

    assert patched.status_code == 200, patched.text
    assert patched.json()["schedule"]["overlapPolicy"] == "cancel_other"
    event = AuditEvent.objects.get(action="job.update")
    assert event.before["schedule"]["overlapPolicy"] == "skip"
    assert event.after["schedule"]["overlapPolicy"] == "cancel_other"
    # The fire times are the cron's, whatever the policy.
    preview = api_a.post(
        "/api/v1/preview",
        {"schedule": {**schedule, "jitterSeconds": 0}, "from": "2030-01-01T00:00:00Z", "count": 2},
    )
    assert preview.status_code == 200, preview.text
    assert [t["utc"] for t in preview.json()["times"]] == [
        "2030-01-01T00:05:00Z",
        "2030-01-01T00:10:00Z",
    ]


def test_a_definition_stored_before_overlap_policies_gets_the_default_from_the_migration(api_a):
    api_a.post("/api/v1/jobs", EXPORT)
    api_a.post("/api/v1/jobs", {"name": "ops.once", "schedule": {"runAt": "2030-01-01T00:00:00Z"}})
    before = {key: value for key, value in EXPORT["schedule"].items() if key != "overlapPolicy"}
    JobDefinition.objects.filter(name=EXPORT["name"]).update(schedule=before)
    migration = import_module("apps.jobs.migrations.0009_overlap_policy_default").Migration

    with connection.cursor() as cursor:
        cursor.execute(migration.operations[0].sql)

    job = api_a.get("/api/v1/jobs/billing.export-invoices").json()
    assert job["schedule"] == EXPORT["schedule"]
    assert api_a.get("/api/v1/jobs/ops.once").json()["schedule"] == {
        "runAt": "2030-01-01T00:00:00Z"
    }
    # Stated again as it was, the definition has not changed: nothing is recorded.
    api_a.put("/api/v1/jobs/billing.export-invoices", EXPORT)
    assert not AuditEvent.objects.filter(action="job.update").exists()


def test_a_changed_schedule_drops_the_runs_made_ahead_by_the_old_one(api_a):
    """The materialiser makes cron runs up to a minute ahead: once the schedule changes (here
    an endAt before them), the unclaimed ones go, and the rest stay: a run already leased, an
    API run, a cron run already due."""
    created = api_a.post("/api/v1/jobs", {"name": "ops.ending", "schedule": {"cron": "* * * * *"}})
    assert created.status_code == 201, created.text
    job = JobDefinition.objects.get(name="ops.ending")
    now = db_now()

    def run(trigger: str, seconds: int) -> int:
        due = now + timedelta(seconds=seconds)
        with shards.using(shards.alias_of_shard(job.shard)):
            (made,) = store.insert_runs([store.NewRun(job.pk, trigger, due, due, f"k{seconds}")])
        return made

    ahead, leased, api_made, due = (
        run("cron", 40),
        run("cron", 50),
        run("api", 45),
        run("cron", -30),
    )
    Run.objects.filter(pk=leased).update(state="leased", attempt=1)
    ended = api_a.patch(
        "/api/v1/jobs/ops.ending", {"schedule": {"endAt": format_utc(now + timedelta(seconds=1))}}
    )
    assert ended.status_code == 200, ended.text
    assert set(Run.objects.filter(definition=job).values_list("pk", flat=True)) == {
        leased,
        api_made,
        due,
    }
    assert ahead not in Run.objects.values_list("pk", flat=True)
    # A change that leaves the schedule as it was drops nothing: a field runs do not take a
    # copy of, or the same schedule with its defaults written out (as the dashboard's form).
    kept = run("cron", 55)
    assert api_a.patch("/api/v1/jobs/ops.ending", {"owner": "ops"}).status_code == 200
    stored = JobDefinition.objects.get(pk=job.pk).schedule
    terse = {key: stored[key] for key in ("cron", "endAt")}  # as older rows hold it
    JobDefinition.objects.filter(pk=job.pk).update(schedule=terse)
    defaults = {"timeZone": "UTC", "missedRunPolicy": "run_once", "overlapPolicy": "allow_all"}
    updates = AuditEvent.objects.filter(action="job.update").count()
    same = api_a.patch("/api/v1/jobs/ops.ending", {"schedule": defaults})
    assert same.status_code == 200, same.text
    assert Run.objects.filter(pk=kept).exists()
    # Nor is it a change: the stored JSON stays as it was and no update is audited.
    assert JobDefinition.objects.get(pk=job.pk).schedule == terse
    assert AuditEvent.objects.filter(action="job.update").count() == updates


@pytest.mark.parametrize(
    "change",
    [{"dryRun": True}, {"queue": "elsewhere"}, {"priority": "critical"}, {"payload": {"v": 2}}],
)
def test_runs_made_ahead_are_made_again_as_the_job_now_is(api_a, change):
    """A run keeps what it was made with: switched to a dry run (or another queue, priority,
    payload) a minute before its fire, the job's next run ran for real, where it had been."""
    made = api_a.post(
        "/api/v1/jobs",
        {
            "name": "ops.every",
            "queue": "here",
            "schedule": {"cron": "* * * * *", "jitterSeconds": 0},
        },
    )
    assert made.status_code == 201, made.text
    job = JobDefinition.objects.get(name="ops.every")
    due = db_now().replace(second=0, microsecond=0) + timedelta(minutes=1)
    with shards.using(shards.alias_of_shard(job.shard)):
        (ahead,) = store.insert_runs([store.NewRun(job.pk, "cron", due, due, "ops.every@m")])
    JobDefinition.objects.filter(pk=job.pk).update(next_due_at=due + timedelta(minutes=1))
    changed = api_a.patch("/api/v1/jobs/ops.every", change)
    assert changed.status_code == 200, changed.text
    assert not Run.objects.filter(pk=ahead).exists()
    assert JobDefinition.objects.get(pk=job.pk).next_due_at == due  # made again from its time
    # Another change of the kind, with nothing made ahead, leaves the next fire time alone.
    api_a.patch("/api/v1/jobs/ops.every", {"owner": "ops"})
    assert JobDefinition.objects.get(pk=job.pk).next_due_at == due


@pytest.mark.parametrize(
    ("method", "suffix", "body"),
    [
        ("PATCH", "", {"concurrency": 2}),
        ("POST", "/pause", None),
        ("POST", "/trigger", None),
        ("DELETE", "", None),
    ],
    ids=["patch", "pause", "trigger", "delete"],
)
def test_a_change_waiting_on_a_job_deleted_meanwhile_is_a_404(api_a, method, suffix, body):
    """Another client's delete commits while the call waits for the job's row: 404, never a
    500 (the call had read the job before the delete; its lock then found no row)."""
    assert api_a.put("/api/v1/jobs/gone.soon", {"queue": "q"}).status_code == 201
    pk = JobDefinition.objects.get(name="gone.soon").pk
    answer = sent_behind_a_change(
        pk,
        "DELETE FROM jobs_jobdefinition WHERE id = %s",
        lambda: api_a.http.request(method, f"/api/v1/jobs/gone.soon{suffix}", json=body),
    )
    assert answer.status_code == 404, answer.text
    assert "deleted meanwhile" in answer.json()["detail"]


def test_the_same_new_job_put_at_once_is_created_once_and_replaced_by_the_rest(api_a):
    """Two deploys applying the same file: one 201, the others 200 (the last one's fields)."""
    from tests.runs.test_claim_concurrency import run_in_threads

    for round_ in range(5):
        name = f"both.deploy{round_}"
        statuses = run_in_threads(
            4,
            lambda i, name=name: (
                api_a.http.put(
                    f"/api/v1/jobs/{name}", json={"queue": "q", "priority": "critical"}
                ).status_code
            ),
        )
        assert sorted(statuses) == [200, 200, 200, 201], statuses
        assert JobDefinition.objects.filter(name=name).count() == 1


@pytest.mark.parametrize(
    ("meanwhile", "kept"),
    [
        ("paused = true", {"paused": True, "timeoutSeconds": 77}),
        ("payload = '{\"v\": 2}'", {"payload": {"v": 2}, "timeoutSeconds": 77}),
    ],
    ids=["a-pause", "another-patch"],
)
def test_a_patch_waiting_on_the_job_keeps_what_another_client_changed_meanwhile(
    api_a, meanwhile, kept
):
    """A PATCH merged its fields into the job as read before the row's lock, and wrote the
    others back as read: a pause (or another PATCH's field) committed while it waited was
    undone, though every call answered 200 and the pause was audited."""
    assert (
        api_a.put("/api/v1/jobs/kept.job", {"queue": "q", "payload": {"v": 0}}).status_code == 201
    )
    pk = JobDefinition.objects.get(name="kept.job").pk
    answer = sent_behind_a_change(
        pk,
        f"UPDATE jobs_jobdefinition SET {meanwhile} WHERE id = %s",
        lambda: api_a.patch("/api/v1/jobs/kept.job", {"timeoutSeconds": 77}),
    )
    assert answer.status_code == 200, answer.text
    for field, value in kept.items():
        assert answer.json()[field] == value, field
        assert api_a.get("/api/v1/jobs/kept.job").json()[field] == value, field


def test_if_match_changes_only_the_version_the_client_read(api_a):
    """Optimistic concurrency, opt-in: every answer of a job carries its version as the ETag;
    a change naming an older one in If-Match is refused (412, the version now as the ETag) and
    changes nothing; `*`, a current tag or no header goes through."""
    path = f"/api/v1/jobs/{EXPORT['name']}"
    created = api_a.post("/api/v1/jobs", EXPORT)
    first = created.headers["ETag"]
    assert first.startswith('"') and api_a.get(path).headers["ETag"] == first
    patched = api_a.patch(path, {"timeoutSeconds": 60}, headers={"If-Match": first})
    assert patched.status_code == 200, patched.text
    second = patched.headers["ETag"]
    assert second != first and api_a.get(path).headers["ETag"] == second
    for refused in (
        api_a.put(path, {**EXPORT, "timeoutSeconds": 5}, headers={"If-Match": first}),
        api_a.patch(path, {"timeoutSeconds": 5}, headers={"If-Match": f"{first}, W/{second}"}),
        api_a.post(f"{path}/pause", headers={"If-Match": first}),
        api_a.delete(path, headers={"If-Match": first}),
    ):
        assert refused.status_code == 412, refused.text
        assert refused.headers["ETag"] == second
        assert refused.headers["Content-Type"] == "application/problem+json"
        assert "Nothing was changed" in refused.json()["detail"]
    job = api_a.get(path).json()
    assert (job["timeoutSeconds"], job["paused"]) == (60, False)
    assert AuditEvent.objects.filter(action__in=["job.update", "job.pause"]).count() == 1
    bare = second.strip('"')  # a tag sent without its quotes is read as one
    paused = api_a.post(f"{path}/pause", headers={"If-Match": f'"other", {bare}'})
    assert paused.status_code == 200 and paused.headers["ETag"] not in (first, second)
    assert api_a.patch(path, {"owner": "ops"}, headers={"If-Match": "*"}).status_code == 200
    assert api_a.patch(path, {"owner": "oncall"}).status_code == 200
    current = api_a.get(path).headers["ETag"]
    assert api_a.delete(path, headers={"If-Match": current}).status_code == 204


def test_put_with_preconditions_replaces_or_creates_only_as_asked(api_a):
    path = "/api/v1/jobs/deploy.only-new"
    missing = api_a.put(path, {"queue": "q"}, headers={"If-Match": '"abc"'})
    assert missing.status_code == 412, missing.text  # no job to match: not created
    assert not JobDefinition.objects.filter(name="deploy.only-new").exists()
    created = api_a.put(path, {"queue": "q"}, headers={"If-None-Match": "*"})
    assert created.status_code == 201, created.text
    again = api_a.put(path, {"queue": "other"}, headers={"If-None-Match": "*"})
    assert again.status_code == 412 and again.headers["ETag"] == created.headers["ETag"]
    assert JobDefinition.objects.get(name="deploy.only-new").queue == "q"
    replaced = api_a.put(path, {"queue": "other"}, headers={"If-Match": created.headers["ETag"]})
    assert replaced.status_code == 200 and replaced.json()["queue"] == "other"


def test_an_if_match_is_compared_under_the_jobs_lock(api_a):
    """A PATCH naming the version it read, held on the job's row while a pause commits, is
    refused: the pause stays, and the PATCH writes nothing."""
    read = api_a.put("/api/v1/jobs/kept.job", {"queue": "q"})
    pk = JobDefinition.objects.get(name="kept.job").pk
    answer = sent_behind_a_change(
        pk,
        "UPDATE jobs_jobdefinition SET paused = true WHERE id = %s",
        lambda: api_a.patch(
            "/api/v1/jobs/kept.job",
            {"timeoutSeconds": 77},
            headers={"If-Match": read.headers["ETag"]},
        ),
    )
    assert answer.status_code == 412, answer.text
    job = api_a.get("/api/v1/jobs/kept.job")
    assert job.json()["paused"] is True and job.json()["timeoutSeconds"] != 77
    assert answer.headers["ETag"] == job.headers["ETag"]


def test_a_replacement_that_leaves_the_switches_unsaid_keeps_them(api_a):
    """A jobs-as-code file that never mentions `paused` or `dryRun` (the reference's job JSON
    does not) must not resume a job paused in an incident, nor take a job out of dry run, on
    every deploy: PUT and the sync keep what the body leaves unsaid, and apply what it says."""
    body = {k: v for k, v in EXPORT.items() if k != "name"}
    path = f"/api/v1/jobs/{EXPORT['name']}"
    created = api_a.put(path, body)
    assert created.status_code == 201 and created.json()["paused"] is False
    api_a.post(f"{path}/pause")
    api_a.patch(path, {"dryRun": True})
    events = AuditEvent.objects.count()

    replaced = api_a.put(path, body)
    assert replaced.status_code == 200, replaced.text
    assert (replaced.json()["paused"], replaced.json()["dryRun"]) == (True, True)
    assert AuditEvent.objects.count() == events  # nothing changed, nothing audited
    synced = api_a.put("/api/v1/jobs", {"jobs": [EXPORT]})
    assert synced.json()["summary"]["unchanged"] == 1, synced.text
    job = api_a.get(path).json()
    assert (job["paused"], job["dryRun"]) == (True, True)

    said = api_a.put("/api/v1/jobs", {"jobs": [{**EXPORT, "paused": False}]}).json()
    assert [c["fields"] for c in said["changes"]] == [{"paused": {"before": True, "after": False}}]
    assert api_a.put(path, {**body, "dryRun": False}).json()["dryRun"] is False
    assert api_a.get(path).json()["paused"] is False
    # A PATCH's null still drops a switch to its default.
    api_a.post(f"{path}/pause")
    assert api_a.patch(path, {"paused": None}).json()["paused"] is False


def test_a_replacement_waiting_on_the_job_keeps_a_pause_made_meanwhile(api_a):
    api_a.put("/api/v1/jobs/kept.job", {"queue": "q"})
    pk = JobDefinition.objects.get(name="kept.job").pk
    answer = sent_behind_a_change(
        pk,
        "UPDATE jobs_jobdefinition SET paused = true WHERE id = %s",
        lambda: api_a.put("/api/v1/jobs/kept.job", {"queue": "q", "timeoutSeconds": 77}),
    )
    assert answer.status_code == 200, answer.text
    assert (answer.json()["paused"], answer.json()["timeoutSeconds"]) == (True, 77)


def test_a_payload_the_database_rewrites_answers_the_etag_a_read_answers(api_a):
    """PostgreSQL keeps 1e25 as 10000000000000000000000000: the ETag of the PUT's answer was
    taken from the number as sent, so it was not the job's version (a GET's), and If-Match with
    it failed; the same PUT again was audited as a change each time."""
    path = "/api/v1/jobs/etag.number"
    body = {"queue": "q", "payload": {"x": 1e25, "y": 1.50, "z": "1e25"}}
    created = api_a.put(path, body)
    assert created.status_code == 201, created.text
    assert created.headers["ETag"] == api_a.get(path).headers["ETag"]
    events = AuditEvent.objects.count()
    again = api_a.put(path, body, headers={"If-Match": created.headers["ETag"]})
    assert again.status_code == 200, again.text
    assert AuditEvent.objects.count() == events  # the same body: no change, none audited
    assert again.headers["ETag"] == created.headers["ETag"]
    synced = api_a.put("/api/v1/jobs", {"jobs": [{"name": "etag.number", **body}]}).json()
    assert synced["summary"]["unchanged"] == 1
    changed = api_a.put(path, {**body, "payload": {"x": 1e25, "y": 1.50, "z": 1e25}})
    assert changed.headers["ETag"] != created.headers["ETag"]  # a string is not a number
    # Read back, 1e25 is written out whole: sent back as it was read, it is the same job (before:
    # a 400, "outside 64 bits").
    read = api_a.get(path)
    assert '"x":10000000000000000000000000' in read.text.replace(" ", "")
    sent_back = api_a.put(path, read.json(), headers={"If-Match": read.headers["ETag"]})
    assert sent_back.status_code == 200, sent_back.text
    assert sent_back.headers["ETag"] == read.headers["ETag"]


def test_a_sync_that_prunes_a_job_makes_it_gone_when_it_commits_and_deletes_its_runs_after(
    api_a, team_a
):
    """The jobs-as-code sync deleted a pruned job's runs inside its one transaction: the job
    stayed readable and its runs leasable until all were gone. Now it is marked in the sync's
    transaction and its runs go after, in batches; a name still being deleted is refused by
    the dry run as by the sync itself."""
    from apps.runs import retention
    from tests.conftest import add_ready_runs, make_definition

    doomed = make_definition(team_a, "prune.me", queue="q")
    add_ready_runs(doomed, 12)
    batches: list[int] = []
    real = retention.delete_runs_of

    def watched(definition_id: int, batch: int = 5000) -> int:
        # What the rest of the world sees while the runs go: the job is already gone.
        batches.append(api_a.get("/api/v1/jobs/prune.me").status_code)
        return real(definition_id, batch=5)

    from unittest import mock

    with mock.patch.object(retention, "delete_runs_of", watched):
        answer = api_a.put("/api/v1/jobs", {"jobs": [], "prune": True})
    assert answer.status_code == 200, answer.text
    assert batches and set(batches) == {404}  # before: 200 until the sync returned
    assert not JobDefinition.everything.filter(pk=doomed.pk).exists()
    assert not Run.objects.filter(definition_id=doomed.pk).exists()

    going = make_definition(team_a, "going.job", queue="q")
    (left,) = add_ready_runs(going, 1)
    JobDefinition.objects.filter(pk=going.pk).update(deleting=True)
    for dry in (True, False):
        refused = api_a.put("/api/v1/jobs", {"jobs": [{"name": "going.job", "queue": "q"}],
                                             "dryRun": dry})  # fmt: skip
        assert refused.status_code == 409, refused.text
        assert "is being deleted" in refused.json()["detail"]
    why = api_a.get(f"/api/v1/runs/{public_run_id(left)}/why")
    assert [reason["code"] for reason in why.json()["reasons"]] == ["job_deleted"]


def test_a_delete_answers_204_when_the_storage_fails_to_delete_its_payload(
    api_a, payload_deletes_failing
):
    """A job's large payload is deleted from storage once the job is gone, after the commit: a
    storage that fails then is no longer the caller's failure (it answered 500, the job gone).
    The blob is kept as stranded, and retention deletes it once the storage answers."""
    from apps.runs import payloads, retention
    from apps.runs.models import PayloadBlob
    from tests.conftest import DeletesFailingStorage

    big = {"rows": ["x" * 100 for _ in range(100)]}  # 10 KB: kept in storage
    made = api_a.post("/api/v1/jobs", {**EXPORT, "payload": big})
    assert made.status_code == 201, made.text
    (key,) = JobDefinition.objects.values_list("payload_key", flat=True)
    assert (payload_deletes_failing / key).exists()

    assert api_a.delete(f"/api/v1/jobs/{EXPORT['name']}").status_code == 204
    assert api_a.get(f"/api/v1/jobs/{EXPORT['name']}").status_code == 404
    assert (payload_deletes_failing / key).exists()
    assert PayloadBlob.objects.get(key=key).stranded_at is not None

    retention.handle_one_round()  # the storage still fails: kept, and tried again later
    assert (payload_deletes_failing / key).exists()
    DeletesFailingStorage.failing = False
    assert retention.handle_one_round() >= 1
    assert not (payload_deletes_failing / key).exists()
    assert not PayloadBlob.objects.filter(key=key).exists()
    assert payloads.sweep_stranded(10) == 0


def test_a_stranded_payload_used_again_is_kept(api_a, payload_deletes_failing):
    """A blob the storage failed to delete that a new run then refers to (same content) is not
    deleted by the retention that tries the stranded blobs again."""
    from apps.runs import payloads
    from apps.runs.models import PayloadBlob
    from tests.conftest import DeletesFailingStorage

    big = {"rows": ["y" * 100 for _ in range(100)]}
    api_a.post("/api/v1/jobs", {**EXPORT, "payload": big})
    (key,) = JobDefinition.objects.values_list("payload_key", flat=True)
    assert api_a.delete(f"/api/v1/jobs/{EXPORT['name']}").status_code == 204
    assert PayloadBlob.objects.get(key=key).stranded_at is not None

    api_a.post("/api/v1/jobs", EXPORT)
    enqueued = api_a.post(f"/api/v1/jobs/{EXPORT['name']}/runs", {"payload": big})
    assert enqueued.status_code == 201, enqueued.text
    DeletesFailingStorage.failing = False
    assert payloads.sweep_stranded(10) == 0
    assert (payload_deletes_failing / key).exists()
    assert PayloadBlob.objects.get(key=key).stranded_at is None
    assert api_a.get(f"/api/v1/runs/{enqueued.json()['runId']}").json()["payload"] == big


def test_a_job_whose_stored_payload_is_lost_is_shown_paused_replaced_and_deleted(
    api_a, payload_folder
):
    """A blob lost from storage made every answer about its job a 503, also a pause's, after
    the pause had committed; and the job could be neither replaced nor deleted. It is shown
    with a null payload (the dashboard says why); a change of some fields, which would write the
    payload back, still waits for the storage (503, nothing changed)."""
    big = {"rows": ["z" * 100 for _ in range(100)]}
    name, path = EXPORT["name"], f"/api/v1/jobs/{EXPORT['name']}"
    assert api_a.post("/api/v1/jobs", {**EXPORT, "payload": big}).status_code == 201
    (key,) = JobDefinition.objects.values_list("payload_key", flat=True)
    (payload_folder / key).unlink()  # a storage that lost it

    shown = api_a.get(path)
    assert shown.status_code == 200 and shown.json()["payload"] is None
    paused = api_a.post(f"{path}/pause")
    assert paused.status_code == 200, paused.text
    assert paused.json()["paused"] is True and paused.json()["payload"] is None
    (event,) = AuditEvent.objects.filter(action="job.pause")

    patched = api_a.patch(path, {"priority": "bulk"})
    assert patched.status_code == 503 and patched.json()["type"].endswith("/payload-unavailable")
    assert JobDefinition.objects.get(name=name).priority_name != "bulk"

    replaced = api_a.put(path, {**EXPORT, "payload": {"small": True}})
    assert replaced.status_code == 200, replaced.text
    assert replaced.json()["payload"] == {"small": True} and replaced.json()["paused"] is True
    (update,) = AuditEvent.objects.filter(action="job.update")
    assert update.before["payload"] is None and key in update.before["payloadUnavailable"]

    assert (
        api_a.post("/api/v1/jobs", {**EXPORT, "name": "lost.blob", "payload": big}).status_code
        == 201
    )
    (payload_folder / key).unlink()
    assert api_a.delete("/api/v1/jobs/lost.blob").status_code == 204
    assert not JobDefinition.objects.filter(name="lost.blob").exists()


def test_a_payload_the_storage_cannot_write_is_a_503_and_nothing_is_created(api_a, payload_folder):
    import shutil

    shutil.rmtree(payload_folder)
    payload_folder.write_text("not a folder")  # the storage's folder replaced by a file
    big = {"rows": ["w" * 100 for _ in range(100)]}
    answer = api_a.post("/api/v1/jobs", {**EXPORT, "payload": big})
    assert answer.status_code == 503, answer.text
    assert answer.json()["type"].endswith("/payload-unavailable")
    assert "cannot be written to storage" in answer.json()["detail"]
    assert not JobDefinition.objects.exists() and not AuditEvent.objects.exists()


def test_a_replaced_payload_is_deleted_once_nothing_refers_to_it(api_a, team_a, payload_folder):
    """A PUT or PATCH that replaced a job's stored payload left the old one in storage for good
    (nothing referred to it, and nothing would look at it again); one a run still uses stays."""
    from apps.runs.models import PayloadBlob

    first, second = ({"rows": [letter * 100 for _ in range(100)]} for letter in "ab")
    job = {key: value for key, value in EXPORT.items() if key != "name"}
    assert api_a.put("/api/v1/jobs/blob.swap", {**job, "payload": first}).status_code == 201
    (first_key,) = JobDefinition.objects.values_list("payload_key", flat=True)
    assert api_a.put("/api/v1/jobs/blob.swap", {**job, "payload": second}).status_code == 200
    (second_key,) = JobDefinition.objects.values_list("payload_key", flat=True)
    assert not (payload_folder / first_key).exists()
    assert not PayloadBlob.objects.filter(key=first_key).exists()
    # A run made with the second payload keeps it when the job's is replaced again.
    assert api_a.post("/api/v1/jobs/blob.swap/trigger").status_code == 201
    small = api_a.patch("/api/v1/jobs/blob.swap", {"payload": {"small": True}})
    assert small.status_code == 200, small.text
    assert (payload_folder / second_key).exists()
    assert JobDefinition.objects.get().payload_key == ""


def test_a_jobs_file_entry_states_its_queue(api_a):
    """An entry of a name alone was a job of defaults: a forgotten line moved a production job
    to queue `default` and dropped its schedule and limits. It is a 400, as a PUT's is."""
    job = {"name": "ops.stated", "queue": "ops", "schedule": {"cron": "0 2 * * *"},
           "concurrency": 3}  # fmt: skip
    assert api_a.put("/api/v1/jobs", {"jobs": [job]}).status_code == 200
    for dry in (True, False):
        answer = api_a.put("/api/v1/jobs", {"jobs": [{"name": "ops.stated"}], "dryRun": dry})
        assert answer.status_code == 400, answer.text
        assert "jobs[0].queue" in answer.json()["errors"]
    kept = JobDefinition.objects.get(name="ops.stated")
    assert (kept.queue, kept.concurrency, kept.schedule["cron"]) == ("ops", 3, "0 2 * * *")


@pytest.mark.parametrize("how", ["patch", "put", "sync"])
def test_a_pause_however_stated_drops_the_runs_made_ahead_and_is_not_back_filled(api_a, how):
    """Only the pause endpoint dropped them: paused through a PUT, a PATCH or a sync, the runs
    made ahead stayed, and were claimable once it resumed (the pause back-filled)."""
    body = {"name": "ops.paused", "queue": "ops", "schedule": {"cron": "* * * * *"}}
    assert api_a.put("/api/v1/jobs/ops.paused", body).status_code == 201
    job = JobDefinition.objects.get(name="ops.paused")
    due = db_now() + timedelta(seconds=40)
    with shards.using(shards.alias_of_shard(job.shard)):
        (ahead,) = store.insert_runs([store.NewRun(job.pk, "cron", due, due, "ahead")])
    if how == "patch":
        answer = api_a.patch("/api/v1/jobs/ops.paused", {"paused": True})
    elif how == "put":
        answer = api_a.put("/api/v1/jobs/ops.paused", {**body, "paused": True})
    else:
        answer = api_a.put("/api/v1/jobs", {"jobs": [{**body, "paused": True}]})
    assert answer.status_code == 200, answer.text
    assert JobDefinition.objects.get(pk=job.pk).paused
    assert not Run.objects.filter(pk=ahead).exists()


def test_a_sync_sent_again_after_its_deletes_were_applied_is_answered(team_a):
    """A client resending a prune after its timeout, when the first had applied it: the plan
    named jobs another sync had deleted meanwhile, and the whole body answered 404."""
    from apps.api.shapes.jobs import parse_entry
    from apps.jobs import sync

    keep = {"name": "ops.keep", "queue": "ops"}
    gone = {"name": "ops.gone", "queue": "ops"}
    first = sync.plan_sync(team_a, sync.validate([keep, gone], parse_entry), prune=False)
    sync.apply_sync(first, Actor.cli("deploy"))
    specs = sync.validate([keep], parse_entry)
    plans = [sync.plan_sync(team_a, specs, prune=True) for _ in range(2)]  # both made first
    for plan in plans:
        sync.apply_sync(plan, Actor.cli("deploy"))
    assert list(JobDefinition.objects.values_list("name", flat=True)) == ["ops.keep"]
    assert AuditEvent.objects.filter(action="job.delete").count() == 1


def test_a_sync_naming_a_job_twice_is_refused_naming_the_second(api_a):
    job = {"name": "ops.twice", "queue": "ops"}
    answer = api_a.put("/api/v1/jobs", {"jobs": [job, {**job, "queue": "other"}]})
    assert answer.status_code == 400, answer.text
    assert answer.json()["errors"]["jobs[1].name"] == ["'ops.twice' appears twice."]
    assert not JobDefinition.objects.filter(name="ops.twice").exists()
