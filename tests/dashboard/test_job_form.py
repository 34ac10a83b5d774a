"""The definition form: validated by the API's serializer and the schedule module, never twice."""

from __future__ import annotations

import json

import pytest

from apps.api.parsers import parse_json
from apps.api.shapes.jobs import parse_definition
from apps.audit.models import AuditEvent
from apps.jobs.models import JobDefinition
from apps.jobs.schedule import shard_for
from tests.conftest import make_definition
from tests.dashboard.conftest import client_for

pytestmark = pytest.mark.django_db(transaction=True)

FORM = {
    "team": "team-a",
    "name": "billing.export-invoices",
    "kind": "cron",
    "cron": "0 2 * * *",
    "time_zone": "Europe/Berlin",
    "jitter_seconds": "0",
    "missed_run_policy": "run_once",
    "queue": "billing",
    "priority": "critical",
    "timeout_seconds": "900",
    "retry_max_attempts": "5",
    "retry_base_seconds": "30",
    "retry_max_seconds": "1800",
    "concurrency": "1",
    "payload": '{"format": "csv"}',
}


def test_an_editor_creates_a_definition_from_the_form(editor_a):
    response = client_for(editor_a).post("/jobs/new", FORM)
    assert response.status_code == 302
    assert response["Location"] == "/jobs/billing.export-invoices"
    job = JobDefinition.objects.get(name="billing.export-invoices")
    assert job.schedule == {
        "cron": "0 2 * * *",
        "timeZone": "Europe/Berlin",
        "jitterSeconds": 0,
        "missedRunPolicy": "run_once",
        "overlapPolicy": "allow_all",
    }
    assert (job.priority, job.concurrency, job.payload) == (0, 1, {"format": "csv"})
    assert job.shard == shard_for(job.name) and job.next_due_at is not None
    event = AuditEvent.objects.get(action="job.create")
    assert (event.source, event.actor) == ("dashboard", "erin-editor")


def test_a_name_whose_job_is_still_being_deleted_is_a_form_error(editor_a):
    client = client_for(editor_a)
    client.post("/jobs/new", FORM)
    JobDefinition.objects.filter(name=FORM["name"]).update(deleting=True)  # a delete under way
    assert client.get(f"/jobs/{FORM['name']}").status_code == 404
    response = client.post("/jobs/new", {**FORM, "queue": "other"})
    assert response.status_code == 200
    assert response.context["form"].errors["name"] == [
        "A job with this name is still being deleted; create it again once it is gone."
    ]
    assert JobDefinition.everything.get(name=FORM["name"]).queue == "billing"


def test_bad_input_is_refused_with_a_reason_beside_each_field(editor_a):
    bad = {**FORM, "name": "Bad Name", "cron": "0 25 * * *", "time_zone": "Mars/Olympus",
           "retry_base_seconds": "60", "retry_max_seconds": "10", "payload": "{nope"}  # fmt: skip
    response = client_for(editor_a).post("/jobs/new", bad)
    assert response.status_code == 200
    errors = response.context["form"].errors
    assert {"name", "cron", "time_zone", "retry_max_seconds", "payload"} <= set(errors)
    assert "25" in " ".join(errors["cron"])
    assert not JobDefinition.objects.exists()


def test_the_preview_shows_ten_times_and_marks_dst(editor_a):
    client = client_for(editor_a)
    # Every Sunday of March at 02:30: the next ten always include the last one, when Europe/Berlin
    # springs forward and 02:30 does not exist.
    query = {"kind": "cron", "cron": "30 2 * 3 0", "time_zone": "Europe/Berlin",
             "jitter_seconds": "0", "name": "x"}  # fmt: skip
    response = client.get("/jobs/-/preview", query, HTTP_HX_REQUEST="true")
    body = response.content.decode()
    assert response.status_code == 200
    assert body.count("<tr>") == 11  # a header and ten fire times
    assert "does not exist" in body and "T03:00:00+02:00" in body
    bad = client.get("/jobs/-/preview", {**query, "time_zone": "Nowhere/Special"}).content.decode()
    assert 'id="err-time_zone" hx-swap-oob="true">' in bad and "Nowhere/Special" in bad


def test_dry_run_toggle_and_trigger_now_go_through_the_domain(operator_a, editor_a, team_a):
    client_for(editor_a).post("/jobs/new", FORM)
    job = JobDefinition.objects.get()
    assert client_for(operator_a).post(f"/jobs/{job.name}/dry-run").status_code == 403
    client_for(editor_a).post(f"/jobs/{job.name}/dry-run")
    job.refresh_from_db()
    assert job.dry_run
    response = client_for(operator_a).post(f"/jobs/{job.name}/trigger")
    run = job.runs.get()
    assert response["Location"] == f"/runs/{run.run_id}"
    assert (run.trigger, run.dry_run) == ("manual", True)
    actions = list(AuditEvent.objects.order_by("pk").values_list("action", flat=True))
    assert actions == ["job.create", "job.update", "job.trigger"]


def test_delete_needs_the_typed_name(editor_a):
    client = client_for(editor_a)
    client.post("/jobs/new", FORM)
    client.post("/jobs/billing.export-invoices/delete", {"confirm_name": "billing"})
    assert JobDefinition.objects.exists()
    client.post("/jobs/billing.export-invoices/delete", {"confirm_name": "billing.export-invoices"})
    assert not JobDefinition.objects.exists()
    assert AuditEvent.objects.filter(action="job.delete").exists()


@pytest.mark.parametrize("depth", [64, 65, 300, 5000])
def test_a_payload_nested_past_the_limit_is_a_form_error_and_nothing_is_saved(editor_a, depth):
    # 64 levels of its own are 65 in the definition's JSON: the API could not take it back.
    payload = "[" * depth + "]" * depth
    response = client_for(editor_a).post("/jobs/new", {**FORM, "payload": payload})
    assert response.status_code == 200
    assert "Nested deeper than 6" in " ".join(response.context["form"].errors["payload"])
    assert not JobDefinition.objects.exists()


def test_a_payload_the_form_takes_goes_back_through_the_api_as_it_is(editor_a):
    client_for(editor_a).post("/jobs/new", {**FORM, "payload": "[" * 63 + "]" * 63})
    job = JobDefinition.objects.get()
    # What `PUT /api/v1/jobs/{name}` reads: the definition's JSON with the payload inside it.
    assert parse_json(json.dumps({"name": job.name, "payload": job.payload}).encode())


def test_a_payload_with_an_integer_past_64_bits_is_a_form_error_and_nothing_is_saved(editor_a):
    client = client_for(editor_a)
    response = client.post("/jobs/new", {**FORM, "payload": '{"id": 1180591620717411303424}'})
    assert response.status_code == 200
    assert "outside 64 bits" in " ".join(response.context["form"].errors["payload"])
    assert not JobDefinition.objects.exists()
    # A long number as a string, and the largest integer taken, are saved as they are.
    payload = '{"id": "1180591620717411303424", "max": 18446744073709551615}'
    assert client.post("/jobs/new", {**FORM, "payload": payload}).status_code == 302
    assert JobDefinition.objects.get().payload == {
        "id": "1180591620717411303424",
        "max": 2**64 - 1,
    }


def test_start_and_end_are_saved_in_the_schedule_and_shown_on_the_job_page(editor_a):
    client = client_for(editor_a)
    form = {**FORM, "cron": "0 2 L * *", "start_at": "2030-01-01T00:00:00+01:00",
            "end_at": "2030-12-31T23:00:00Z"}  # fmt: skip

    response = client.post("/jobs/new", form)

    assert response.status_code == 302, response.context["form"].errors
    job = JobDefinition.objects.get()
    assert job.schedule["startAt"] == "2029-12-31T23:00:00Z"
    assert job.schedule["endAt"] == "2030-12-31T23:00:00Z"
    page = client.get(f"/jobs/{job.name}").content.decode()
    assert 'id="job-bounds"' in page
    assert "2029-12-31T23:00:00Z" in page and "2030-12-31T23:00:00Z" in page
    assert "schedule_not_started" in page
    edit = client.get(f"/jobs/{job.name}/edit").content.decode()
    assert 'value="2029-12-31T23:00:00Z"' in edit and 'value="2030-12-31T23:00:00Z"' in edit


@pytest.mark.parametrize(
    ("fields", "field", "says"),
    [
        ({"cron": "TZ=Europe/Berlin 0 2 * * *"}, "cron", "timeZone"),
        ({"cron": "0 2 * * 5#6"}, "cron", "day-of-week field"),
        ({"start_at": "2030-01-01T00:00:00"}, "start_at", "no UTC offset"),
        ({"start_at": "2030-02-01T00:00:00Z", "end_at": "2030-01-01T00:00:00Z"}, "end_at",
         "must be after startAt"),
        ({"cron": "0\t2 * * *"}, "cron", "separate the fields with spaces, not U+0009"),
        ({"cron": "0 0 1 1 *", "start_at": "2030-01-02T00:00:00Z",
          "end_at": "2030-01-03T00:00:00Z"}, "end_at", "would never run"),
    ],
)  # fmt: skip
def test_bad_cron_and_bounds_are_form_errors_beside_their_fields(editor_a, fields, field, says):
    response = client_for(editor_a).post("/jobs/new", {**FORM, **fields})

    assert response.status_code == 200
    assert says in " ".join(response.context["form"].errors[field])
    assert not JobDefinition.objects.exists()


def test_the_preview_says_when_a_bounded_schedule_starts_without_marking_dst(editor_a):
    query = {"kind": "cron", "cron": "0 9 * * FRI#3", "time_zone": "UTC", "jitter_seconds": "0",
             "name": "x", "start_at": "2030-01-01T00:00:00Z"}  # fmt: skip

    body = client_for(editor_a).get("/jobs/-/preview", query, HTTP_HX_REQUEST="true")

    text = body.content.decode()
    assert "2030-01-18T09:00:00+00:00" in text
    assert "first run: the schedule starts at 2030-01-01T00:00:00Z (startAt)" in text
    assert ">DST<" not in text
    bad = client_for(editor_a).get("/jobs/-/preview", {**query, "end_at": "2029-01-01T00:00:00Z"})
    assert 'id="err-end_at" hx-swap-oob="true">' in bad.content.decode()


def test_an_overlap_policy_is_chosen_saved_and_shown_on_the_job_page(editor_a):
    client = client_for(editor_a)
    form = client.get("/jobs/new").content.decode()
    assert '<option value="allow_all" selected>' in form
    assert "skip — no new run while one is waiting or running" in form

    response = client.post("/jobs/new", {**FORM, "overlap_policy": "skip"})

    assert response.status_code == 302, response.context["form"].errors
    job = JobDefinition.objects.get()
    assert job.schedule["overlapPolicy"] == "skip"
    page = client.get(f"/jobs/{job.name}").content.decode()
    assert '<dd id="job-overlap">skip — no new run while one is waiting or running</dd>' in page
    edit = client.get(f"/jobs/{job.name}/edit").content.decode()
    assert '<option value="skip" selected>' in edit
    client.post(f"/jobs/{job.name}/edit", {**FORM, "overlap_policy": "buffer_one"})
    job.refresh_from_db()
    assert job.schedule["overlapPolicy"] == "buffer_one"
    event = AuditEvent.objects.get(action="job.update")
    assert (
        event.before["schedule"]["overlapPolicy"],
        event.after["schedule"]["overlapPolicy"],
    ) == (
        "skip",
        "buffer_one",
    )


def test_a_job_without_a_cron_shows_no_overlap_and_ignores_the_select(editor_a):
    client = client_for(editor_a)
    once = {**FORM, "kind": "once", "run_at": "2030-01-01T00:00:00Z", "overlap_policy": "skip"}

    response = client.post("/jobs/new", once)

    assert response.status_code == 302, response.context["form"].errors
    job = JobDefinition.objects.get()
    assert job.schedule == {"runAt": "2030-01-01T00:00:00Z"}
    assert 'id="job-overlap"' not in client.get(f"/jobs/{job.name}").content.decode()


def test_a_bad_overlap_policy_is_a_form_error_beside_its_select(editor_a):
    client = client_for(editor_a)

    response = client.post("/jobs/new", {**FORM, "overlap_policy": "queue"})

    assert response.status_code == 200
    errors = response.context["form"].errors
    assert list(errors) == ["overlap_policy"]
    assert "must be one of allow_all, skip, buffer_one, cancel_other" in errors["overlap_policy"][0]
    assert not JobDefinition.objects.exists()
    query = {"kind": "cron", "cron": "0 2 * * *", "name": "x", "overlap_policy": "queue"}
    preview = client.get("/jobs/-/preview", query, HTTP_HX_REQUEST="true").content.decode()
    assert 'id="err-overlap_policy" hx-swap-oob="true">must be one of' in preview


def test_limits_are_set_in_the_form_and_a_half_given_rate_limit_is_refused_beside_it(editor_a):
    client = client_for(editor_a)
    limited = {
        **FORM,
        "concurrency_per_key": "1",
        "concurrency_key_field": "customer",
        "rate_limit_count": "100",
        "rate_limit_period_seconds": "60",
    }

    response = client.post("/jobs/new", limited)

    assert response.status_code == 302, response.context["form"].errors
    job = JobDefinition.objects.get()
    assert (job.concurrency_per_key, job.concurrency_key_field) == (1, "customer")
    assert (job.rate_limit_count, job.rate_limit_period_seconds) == (100, 60)
    edit = client.get(f"/jobs/{job.name}/edit").content.decode()
    assert 'name="rate_limit_count" value="100"' in edit
    # Emptied, the limits go.
    cleared = {
        **FORM,
        "concurrency_per_key": "",
        "rate_limit_count": "",
        "rate_limit_period_seconds": "",
    }
    assert client.post(f"/jobs/{job.name}/edit", cleared).status_code == 302
    job.refresh_from_db()
    assert (job.concurrency_per_key, job.rate_limit_count) == (None, None)

    half = client.post(f"/jobs/{job.name}/edit", {**FORM, "rate_limit_count": "5"})
    assert half.status_code == 200
    assert "rate_limit_period_seconds" in half.context["form"].errors
    job.refresh_from_db()
    assert job.rate_limit_count is None  # nothing saved
    # A zero is out of range, not missing: the API's reason is shown beside the field.
    for field in ("rate_limit_count", "rate_limit_period_seconds"):
        zero = client.post(
            f"/jobs/{job.name}/edit",
            {**FORM, "rate_limit_count": "5", "rate_limit_period_seconds": "60", field: "0"},
        )
        assert zero.status_code == 200
        (reason,) = zero.context["form"].errors[field]
        assert "greater than or equal to 1" in reason, reason


@pytest.mark.parametrize(
    "payload, reason",
    [
        ('{"a": "\\u0000"}', "NUL"),
        ('{"\\u0000": 1}', "NUL"),
        ('{"a": NaN}', "Not valid JSON"),
        ('{"a": Infinity}', "Not valid JSON"),
        ('{"a": 1, "a": 2}', 'The key "a" is given twice'),
    ],
)
def test_a_payload_the_api_refuses_is_a_form_error_too(editor_a, payload, reason):
    # PostgreSQL cannot store these: read as json.loads reads them, saving answered 500.
    response = client_for(editor_a).post("/jobs/new", {**FORM, "payload": payload})
    assert response.status_code == 200
    assert reason in " ".join(response.context["form"].errors["payload"])
    assert not JobDefinition.objects.exists()


def test_a_job_saved_while_another_session_holds_its_row_keeps_the_form_and_says_why(
    editor_a, settings, caplog
):
    """The web process's statements wait at most SCHEDULER_DB_LOCK_TIMEOUT for a lock: the
    save is rolled back and the form stays, saying so (it waited as long as the lock lived)."""
    import psycopg
    from django.db import connection

    client = client_for(editor_a)
    assert client.post("/jobs/new", FORM).status_code == 302
    settings.DB_LOCK_TIMEOUT = 1
    with connection.cursor() as cursor:  # the test client's requests use this session
        cursor.execute("SET lock_timeout = '300ms'")
    params = connection.get_connection_params()
    with psycopg.connect(**params) as holder:
        holder.execute(
            "SELECT 1 FROM jobs_jobdefinition WHERE name = %s FOR UPDATE", [FORM["name"]]
        )
        answer = client.post(
            f"/jobs/{FORM['name']}/edit", {**FORM, "timeout_seconds": "77", "owner": "k@x.io"}
        )
        page = client.post(f"/jobs/{FORM['name']}/pause")
    with connection.cursor() as cursor:
        cursor.execute("RESET lock_timeout")
    assert answer.status_code == 200, answer.content[:300]
    text = answer.content.decode()
    assert "Another session held a lock this request needs for over 1 s" in text
    assert 'value="k@x.io"' in text
    # An action without a form: a page that says what happened, not "server error".
    assert page.status_code == 503
    assert page["Retry-After"] == "1"
    assert "Another session held a lock this request needs" in page.content.decode()
    job = JobDefinition.objects.get(name=FORM["name"])
    assert (job.timeout_seconds, job.paused) == (900, False)
    # The documented answer to a bound this process sets: a warning, not an error's trace.
    waits = [r for r in caplog.records if r.getMessage().startswith("database wait answered")]
    assert [r.levelname for r in waits] == ["WARNING", "WARNING"]
    assert not [r for r in caplog.records if r.exc_info]


def test_a_save_over_a_change_made_since_the_form_was_opened_is_refused_and_kept(editor_a):
    """An edit form opened before a pause (an incident's) and saved after it wrote the job
    back as the form had read it: unpaused. The save is refused, with what was typed kept;
    saving again, knowing, goes through."""
    import re

    from apps.audit.record import Actor
    from apps.jobs import services

    client = client_for(editor_a)
    assert client.post("/jobs/new", FORM).status_code == 302
    opened = client.get(f"/jobs/{FORM['name']}/edit").content.decode()
    (seen,) = re.findall(r'name="seen" value="([0-9a-f]+)"', opened)
    job = JobDefinition.objects.get(name=FORM["name"])
    services.set_paused(job, True, Actor.system("incident"))

    edit = {**FORM, "timeout_seconds": "77", "seen": seen}  # the form had it unpaused
    refused = client.post(f"/jobs/{FORM['name']}/edit", edit)
    assert refused.status_code == 200
    html = refused.content.decode()
    assert "someone changed this job since this form was opened" in html
    assert 'value="77"' in html
    # The pause, a field the editor left alone, is in the form now (saving again as it was
    # refused unpaused the job), and the refusal names it.
    assert re.search(r'<input[^>]*name="paused"[^>]*checked', html)
    assert "Their change to Paused is now in the form" in html
    job.refresh_from_db()
    assert (job.paused, job.timeout_seconds) == (True, 900)

    (again,) = re.findall(r'name="seen" value="([0-9a-f]+)"', html)
    assert again != seen
    saved = client.post(f"/jobs/{FORM['name']}/edit", {**edit, "seen": again, "paused": "on"})
    assert saved.status_code == 302
    job.refresh_from_db()
    assert (job.paused, job.timeout_seconds) == (True, 77)
    # Without a change in between, a save goes through at once.
    (fresh,) = re.findall(
        r'name="seen" value="([0-9a-f]+)"',
        client.get(f"/jobs/{FORM['name']}/edit").content.decode(),
    )
    assert client.post(f"/jobs/{FORM['name']}/edit", {**edit, "seen": fresh, "paused": "on",
                       "timeout_seconds": "78"}).status_code == 302  # fmt: skip


def test_a_field_both_changed_since_the_form_was_opened_keeps_what_was_typed_and_says_so(
    editor_a,
):
    """Someone else set the timeout and the queue (through the API) after the form was opened;
    the editor changed the timeout too. The refused form keeps the editor's timeout with the
    other value beside it, takes the other's queue, and a save of it writes both."""
    import re

    from apps.audit.record import Actor
    from apps.jobs import services

    client = client_for(editor_a)
    assert client.post("/jobs/new", FORM).status_code == 302
    opened = client.get(f"/jobs/{FORM['name']}/edit").content.decode()
    (seen,) = re.findall(r'name="seen" value="([0-9a-f]+)"', opened)
    job = JobDefinition.objects.get(name=FORM["name"])
    services.set_paused(job, True, Actor.system("incident"))  # two changes in the trail
    services.update_definition(
        job,
        lambda fields: parse_definition({**fields, "timeoutSeconds": 50, "queue": "billing-slow"}),
        Actor.system("api"),
    )

    refused = client.post(
        f"/jobs/{FORM['name']}/edit", {**FORM, "timeout_seconds": "77", "seen": seen}
    )
    html = refused.content.decode()
    assert "You both changed Timeout (s): check beside each." in html
    assert "Changed meanwhile to “50”; saving again writes what you typed over it." in html
    # A note beside the field, apart from its errors, which the form's check as one types puts
    # again (it wiped the note when it was one of them).
    assert 'id="note-timeout_seconds">Changed meanwhile to “50”' in html
    checked = client.post(
        "/jobs/-/check", {**FORM, "timeout_seconds": "77", "editing": FORM["name"]}
    ).content.decode()
    assert 'id="err-timeout_seconds" hx-swap-oob="true"></span>' in checked
    assert 'id="note-' not in checked
    assert 'value="77"' in html and 'value="billing-slow"' in html
    assert re.search(r'<input[^>]*name="paused"[^>]*checked', html)
    job.refresh_from_db()
    assert (job.timeout_seconds, job.queue, job.paused) == (50, "billing-slow", True)

    (again,) = re.findall(r'name="seen" value="([0-9a-f]+)"', html)
    resent = {**FORM, "timeout_seconds": "77", "queue": "billing-slow", "paused": "on"}
    assert client.post(f"/jobs/{FORM['name']}/edit", {**resent, "seen": again}).status_code == 302
    job.refresh_from_db()
    assert (job.timeout_seconds, job.queue, job.paused) == (77, "billing-slow", True)


def test_a_payload_left_alone_takes_a_change_made_meanwhile_whatever_its_line_ends(editor_a):
    """A browser sends a text area's lines ended by CRLF, where the form shows the payload's
    with LF: a payload left alone read as changed by both, and saving again wrote the form's
    old payload over the one changed meanwhile."""
    import re
    from html import unescape

    from apps.audit.record import Actor
    from apps.jobs import services

    client = client_for(editor_a)
    assert client.post("/jobs/new", FORM).status_code == 302
    opened = client.get(f"/jobs/{FORM['name']}/edit").content.decode()
    (seen,) = re.findall(r'name="seen" value="([0-9a-f]+)"', opened)
    (shown,) = re.findall(r'<textarea name="payload"[^>]*>\n?(.*?)</textarea>', opened, re.S)
    assert "\n" in unescape(shown)  # several lines, as the browser sends them back
    job = JobDefinition.objects.get(name=FORM["name"])
    services.update_definition(
        job, lambda fields: parse_definition({**fields, "payload": {"b": [1, 2]}}), Actor.cli()
    )

    sent = {**FORM, "owner": "me", "payload": unescape(shown).replace("\n", "\r\n"), "seen": seen}
    html = client.post(f"/jobs/{FORM['name']}/edit", sent).content.decode()
    assert "Their change to Payload is now in the form" in html
    assert "You both changed" not in html
    (kept,) = re.findall(r'<textarea name="payload"[^>]*>\n?(.*?)</textarea>', html, re.S)
    assert json.loads(unescape(kept)) == {"b": [1, 2]}


def test_a_job_whose_stored_payload_is_lost_is_shown_saying_so_and_not_edited(
    editor_a, payload_folder
):
    """Its page answered 500; it says why the payload is not shown. Its edit form, which would
    write the payload back as null, is a 503 page saying what to do."""
    big = {"rows": ["v" * 100 for _ in range(100)]}
    client = client_for(editor_a)
    assert client.post("/jobs/new", {**FORM, "payload": json.dumps(big)}).status_code == 302
    job = JobDefinition.objects.get()
    (payload_folder / job.payload_key).unlink()
    page = client.get(f"/jobs/{job.name}")
    assert page.status_code == 200
    assert f"Unreadable: the payload {job.payload_key} cannot be read" in page.content.decode()
    edit = client.get(f"/jobs/{job.name}/edit")
    assert (edit.status_code, edit["Retry-After"]) == (503, "1")
    assert "can still be replaced as a whole" in edit.content.decode()


def test_job_names_are_ordered_by_code_point_in_every_database():
    """The dashboard's jobs pager compares names in Python: in a database made under en_US
    ("b-1" after "b_0" there, before it in Python) it showed one job twice and skipped another."""
    from django.db import connections

    from apps.runs import shards

    for alias in shards.databases():
        with connections[alias].cursor() as cursor:
            cursor.execute(
                "SELECT collation_name FROM information_schema.columns"
                " WHERE table_name = 'jobs_jobdefinition' AND column_name = 'name'"
            )
            assert cursor.fetchone() == ("C",), alias


def test_the_fields_outside_the_schedule_are_checked_as_they_are_typed(editor_a, viewer_a, team_b):
    """Each reason goes beside its field before saving, for a new job and an edited one; the
    check acts on nothing and is the editor's alone."""
    client = client_for(editor_a)
    typed = {**FORM, "payload": '{"a": 1, oops', "queue": "bad queue!", "timeout_seconds": "0"}
    answer = client.post("/jobs/-/check", typed, HTTP_HX_REQUEST="true")
    assert answer.status_code == 200
    text = answer.content.decode()
    assert 'id="err-payload" hx-swap-oob="true">Not valid JSON' in text
    assert 'id="err-queue" hx-swap-oob="true"></span>' not in text
    assert 'id="err-timeout_seconds" hx-swap-oob="true"></span>' not in text
    assert 'id="err-owner" hx-swap-oob="true"></span>' in text  # a field with nothing wrong
    assert 'id="err-cron"' not in text  # the preview's
    assert not JobDefinition.objects.exists()

    assert client.post("/jobs/new", FORM).status_code == 302
    edited = {**FORM, "editing": FORM["name"], "payload": "[1, 2"}
    text = client.post("/jobs/-/check", edited, HTTP_HX_REQUEST="true").content.decode()
    assert 'id="err-payload" hx-swap-oob="true">Not valid JSON' in text
    assert 'id="err-name" hx-swap-oob="true"></span>' in text  # its own name is no conflict
    assert client_for(viewer_a).post("/jobs/-/check", edited).status_code == 403
    # The session ended while typing: nothing is checked, and the page is not sent away from
    # (to the sign-in page, with what was typed) by a check; Save keeps what was typed.
    from django.test import Client

    signed_out = Client().post("/jobs/-/check", edited, HTTP_HX_REQUEST="true")
    assert signed_out.status_code == 204 and "HX-Redirect" not in signed_out.headers
    theirs = make_definition(team_b, "search.reindex", queue="search")
    other = {**FORM, "editing": theirs.name}
    assert client.post("/jobs/-/check", other).status_code == 404
