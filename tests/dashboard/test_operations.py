"""The operations pages: why a run or a job is not running, lateness, backfill, owner and runbook
beside every failure, late and missed runs. The answers come from the domain functions
(apps.jobs.diagnosis, apps.jobs.backfill, apps.jobs.alerts); these tests check that the dashboard
shows exactly those answers, to the right people, escaped, and that backfill needs the operator role
and a confirmation."""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta
from html import escape
from unittest import mock
from zoneinfo import ZoneInfo

import pytest
from playwright.sync_api import expect

from apps.audit.models import AuditEvent
from apps.dashboard.live import render as render_live
from apps.dashboard.templatetags.dashboard import instants
from apps.dashboard.views import alerts as alerts_page
from apps.jobs import alerts, diagnosis
from apps.jobs import schedule as sched
from apps.jobs.models import JobDefinition
from apps.runs import store
from apps.runs.ids import public_run_id
from apps.runs.models import Run
from apps.runs.store import NewRun, insert_runs
from tests.conftest import add_ready_runs, db_now, make_definition
from tests.dashboard.conftest import XSS, client_for, failed_runs, live_scope

# Server-side tests share one transaction per test (fast); the browser test needs commits.
pytestmark = pytest.mark.django_db

RUNBOOK = "https://wiki.example.com/runbooks/billing?step=1&who=oncall"
# Four cron times of "0 */6 * * *" in Europe/Berlin (UTC+1 in January) in this range.
RANGE = {"start": "2026-01-01T00:00", "end": "2026-01-02T00:00"}
EXPECTED_DUE = [datetime(2026, 1, 1, hour, tzinfo=UTC) for hour in (5, 11, 17, 23)]


def _cron_job(team, name="billing.nightly-export", **fields):
    schedule = {"cron": "0 */6 * * *", "timeZone": "Europe/Berlin", "jitterSeconds": 0}
    return make_definition(team, name, queue="billing", schedule=schedule, **fields)


def _held_job(team):
    """A job at its concurrency limit: one leased run holds it, one ready run waits."""
    job = make_definition(team, "billing.charge", queue="billing", concurrency=1)
    holder_pk, waiting_pk = add_ready_runs(job, 2, prefix="held")
    (lease,) = store.claim(
        queues=["billing"], max_runs=2, worker_id="w-1", lease_seconds=60, team_ids=[team.pk]
    )
    assert lease.id == holder_pk
    return job, Run.objects.get(pk=holder_pk), Run.objects.get(pk=waiting_pk)


def _backfill_runs(job) -> list[datetime]:
    return sorted(
        Run.objects.filter(definition=job, trigger="backfill").values_list("due_at", flat=True)
    )


# --- why is this not running? ---------------------------------------------------------------


@pytest.mark.django_db(transaction=True)  # the live render closes old connections
def test_a_waiting_run_shows_why_with_the_holders_linked(viewer_a, team_a):
    job, holder, waiting = _held_job(team_a)
    client = client_for(viewer_a)
    body = client.get(f"/runs/{waiting.run_id}").content.decode()
    assert "Why is this not running?" in body
    reasons = diagnosis.why_run(Run.objects.get(pk=waiting.pk), db_now())
    assert "concurrency_limit" in [reason.code for reason in reasons]
    for reason in reasons:  # every reason the domain gives, and its words, escaped
        assert f'data-code="{reason.code}"' in body
        assert escape(reason.message) in body
    held_by = re.search(r'<span class="held-by">(.*?)</span>', body, re.S).group(1)
    assert f'href="/runs/{holder.run_id}"' in held_by
    # The panel is part of the page's live region, so it follows the run without a reload.
    live = render_live(live_scope(viewer_a), f"/runs/{waiting.run_id}")
    assert "<html" not in live and 'id="why"' in live

    # Only a waiting run gets the panel: not the leased holder, not a finished run.
    assert "Why is this not running?" not in client.get(f"/runs/{holder.run_id}").content.decode()
    (dead,) = failed_runs(make_definition(team_a, "billing.other", queue="other"))
    assert "Why is this not running?" not in client.get(f"/runs/{dead.run_id}").content.decode()


def test_the_instants_a_reason_names_are_times_the_page_shows_in_the_readers_zone(viewer_a, team_a):
    """A reason's words are built on the server, in UTC; the page writes every other time in
    the reader's zone. Its instants are `<time>`s the page's script writes likewise."""
    from django.utils.safestring import mark_safe

    from apps.runs.clock import format_utc

    job = make_definition(team_a, "billing.later", queue="billing")
    (pk,) = add_ready_runs(job, 1)
    Run.objects.filter(pk=pk).update(available_at=db_now() + timedelta(minutes=5))
    stamp = format_utc(Run.objects.get(pk=pk).available_at)
    body = client_for(viewer_a).get(f"/runs/{public_run_id(pk)}").content.decode()
    messages = re.findall(r'<span class="reason-message">(.*?)</span>', body, re.S)
    (message,) = [message for message in messages if stamp in message]
    assert stamp not in message.split("<time")[0]  # no instant left as text
    assert f'<time datetime="{stamp}" title="{stamp}" data-when="long">' in message

    # Words are escaped; what is already HTML, and what only looks like an instant, is left.
    assert instants("<b> at 2026-03-15T02:00:03.250Z") == (
        '&lt;b&gt; at <time datetime="2026-03-15T02:00:03.250Z" title="2026-03-15T02:00:03.250Z"'
        ' data-when="long">2026-03-15 02:00:03 UTC</time>'
    )
    assert instants("hour 2026-03-15T25:00:00Z") == "hour 2026-03-15T25:00:00Z"
    assert instants(mark_safe("<b>")) == "<b>"


def test_a_run_later_than_its_slo_carries_a_late_badge(viewer_a, team_a):
    job = make_definition(team_a, "billing.watched", queue="billing", lateness_slo_seconds=30)
    late, on_time = add_ready_runs(job, 2)
    Run.objects.filter(pk=late).update(late_seconds=42.5)
    Run.objects.filter(pk=on_time).update(late_seconds=12.0)
    client = client_for(viewer_a)
    assert (
        "late by 42.5 s (SLO 30 s)" in client.get(f"/runs/{public_run_id(late)}").content.decode()
    )
    assert 'id="late-badge"' not in client.get(f"/runs/{public_run_id(on_time)}").content.decode()
    # Without an SLO nothing is late, however long it waited.
    JobDefinition.objects.filter(pk=job.pk).update(lateness_slo_seconds=None)
    assert 'id="late-badge"' not in client.get(f"/runs/{public_run_id(late)}").content.decode()


def test_the_job_page_shows_why_definition(viewer_a, team_a):
    job, holder, _ = _held_job(team_a)
    JobDefinition.objects.filter(pk=job.pk).update(paused=True)
    job.refresh_from_db()
    body = client_for(viewer_a).get(f"/jobs/{job.name}").content.decode()
    reasons = diagnosis.why_definition(job, db_now())
    assert {"definition_paused", "concurrency_limit", "no_schedule"} <= {r.code for r in reasons}
    for reason in reasons:
        assert f'data-code="{reason.code}"' in body
        assert escape(reason.message) in body
    assert f'href="/runs/{holder.run_id}"' in body


def test_the_job_page_states_its_rate_limit_and_its_limit_per_key(viewer_a, team_a):
    limited = make_definition(
        team_a,
        "export.limited",
        queue="exports",
        rate_limit_count=100,
        rate_limit_period_seconds=60,
        concurrency_per_key=1,
        concurrency_key_field="customer",
    )
    body = client_for(viewer_a).get(f"/jobs/{limited.name}").content.decode()
    assert '<dd id="job-rate-limit">100 starts per 60 s (sliding window)</dd>' in body
    assert "1 leased run per concurrency key; cron runs keyed by the payload" in body
    assert '<span class="mono">customer</span>' in body
    plain = make_definition(team_a, "export.plain", queue="exports")
    body = client_for(viewer_a).get(f"/jobs/{plain.name}").content.decode()
    assert 'id="job-rate-limit"' not in body and 'id="job-per-key"' not in body


def test_the_queues_page_shows_each_rate_limit_and_its_use(viewer_a, team_a):
    from apps.jobs.models import Queue, QueueStart

    add_ready_runs(make_definition(team_a, "mail.out", queue="mail"), 1)
    add_ready_runs(make_definition(team_a, "mail.free", queue="free"), 1)
    queue = Queue.objects.create(
        team=team_a, name="mail", rate_limit_count=2, rate_limit_period_seconds=60
    )
    body = client_for(viewer_a).get("/queues").content.decode()
    mail = body[body.index('id="queue-team-a-mail"') :].split("</tr>")[0]
    assert "0 of 2</span> per 60 s" in mail and "next slot" not in mail
    free = body[body.index('id="queue-team-a-free"') :].split("</tr>")[0]
    assert '<span class="muted">none</span>' in free
    QueueStart.objects.bulk_create(
        [QueueStart(queue=queue, started_at=db_now() - timedelta(seconds=s)) for s in (10, 20)]
    )
    body = client_for(viewer_a).get("/queues").content.decode()
    mail = body[body.index('id="queue-team-a-mail"') :].split("</tr>")[0]
    assert "2 of 2</span> per 60 s" in mail and "state-failed" in mail
    assert re.search(r"next slot in (39|40)\.\d s", mail), mail  # the oldest: 20 s ago


# --- owner and runbook ----------------------------------------------------------------------


def test_owner_and_runbook_beside_every_failure(viewer_a, team_a):
    job = make_definition(
        team_a, "billing.refunds", queue="billing", owner=f"payments {XSS}", runbook_url=RUNBOOK
    )
    (run,) = failed_runs(job)
    client = client_for(viewer_a)
    link = f'href="{escape(RUNBOOK)}" target="_blank" rel="noopener noreferrer"'
    for path in ("/failures", "/dlq", f"/runs/{run.run_id}", f"/jobs/{job.name}"):
        body = client.get(path).content.decode()
        assert escape(f"payments {XSS}") in body, path
        assert XSS not in body, path
        assert link in body, path

    # Only http(s) becomes a link; anything else (stored behind the API's back) is plain text.
    JobDefinition.objects.filter(pk=job.pk).update(runbook_url="javascript:alert(1)")
    for path in ("/failures", "/dlq", f"/runs/{run.run_id}", f"/jobs/{job.name}"):
        body = client.get(path).content.decode()
        assert 'href="javascript:' not in body, path
        assert "javascript:alert(1)" in body, path


# --- backfill -------------------------------------------------------------------------------


def test_a_viewer_gets_403_on_backfill_even_by_hand(viewer_a, operator_b, team_a, team_b):
    job = _cron_job(team_a)
    client = client_for(viewer_a)
    assert "Preview backfill" not in client.get(f"/jobs/{job.name}").content.decode()
    assert client.get(f"/jobs/{job.name}/backfill").status_code == 403
    assert client.post(f"/jobs/{job.name}/backfill", RANGE).status_code == 403
    assert client.post(f"/jobs/{job.name}/backfill", {**RANGE, "confirm": "yes"}).status_code == 403
    # Another team's operator does not even learn that the job exists.
    other = client_for(operator_b)
    assert other.post(f"/jobs/{job.name}/backfill", {**RANGE, "confirm": "yes"}).status_code == 404
    assert not Run.objects.exists()
    assert not AuditEvent.objects.filter(action="job.backfill").exists()


@pytest.mark.django_db(transaction=True)  # the live render closes old connections
def test_preview_creates_nothing_and_confirm_creates_each_cron_time_once(operator_a, team_a):
    job = _cron_job(team_a)
    # One cron time of the range already ran: the backfill must not make it twice.
    due = EXPECTED_DUE[1]
    key = sched.idempotency_key(job.name, due.astimezone(ZoneInfo("Europe/Berlin")))
    insert_runs([NewRun(job.pk, "cron", due, due, key)])
    client = client_for(operator_a)
    assert "Preview backfill" in client.get(f"/jobs/{job.name}").content.decode()
    # Live updates redraw the job's regions around the backfill panel, never a preview being read.
    live = render_live(live_scope(operator_a), f"/jobs/{job.name}")
    assert 'id="job-body"' in live and 'id="job-history"' in live and 'id="why"' in live
    assert 'id="backfill"' not in live

    preview = client.post(f"/jobs/{job.name}/backfill", RANGE)
    assert preview.status_code == 200
    body = preview.content.decode()
    assert "Will create 3 runs</strong>, 1 already exists." in body
    assert "2026-01-01T06:00:00+01:00" in body  # the first local time
    assert "Create 3 runs" in body and 'name="confirm" value="yes"' in body
    assert Run.objects.filter(definition=job).count() == 1  # a preview creates nothing
    assert not AuditEvent.objects.filter(action="job.backfill").exists()

    confirmed = client.post(f"/jobs/{job.name}/backfill", {**RANGE, "confirm": "yes"}, follow=True)
    assert confirmed.redirect_chain == [(f"/jobs/{job.name}", 302)]
    assert "created 3 runs; 1 cron time already had a run" in confirmed.content.decode()
    assert _backfill_runs(job) == [EXPECTED_DUE[0], *EXPECTED_DUE[2:]]
    event = AuditEvent.objects.get(action="job.backfill")
    assert (event.actor, event.source, event.target) == ("oscar-operator", "dashboard", job.name)
    assert event.after["created"] == 3

    again = client.post(f"/jobs/{job.name}/backfill", {**RANGE, "confirm": "yes"}, follow=True)
    assert "created 0 runs; 4 cron times already had a run" in again.content.decode()
    assert Run.objects.filter(definition=job).count() == 4
    assert AuditEvent.objects.filter(action="job.backfill").count() == 2


def test_a_capped_backfill_preview_says_where_it_stops(operator_a, team_a, settings):
    """Past the cap it said the range ran to the `to` asked for, "(now: the end asked for is
    ahead …)" beside it."""
    settings.SCHEDULER_BACKFILL_CAP = 2
    job = _cron_job(team_a)
    body = client_for(operator_a).post(f"/jobs/{job.name}/backfill", RANGE).content.decode()
    assert "only the first 2 are considered, up to 2026-01-01 11:00:00 UTC" in body
    assert "to 2026-01-01 11:00:00 UTC" in body and "(now:" not in body


def test_backfill_mistakes_are_shown_beside_the_form(operator_a, team_a):
    job = _cron_job(team_a)
    client = client_for(operator_a)
    url = f"/jobs/{job.name}/backfill"
    backwards = {"start": RANGE["end"], "end": RANGE["start"], "confirm": "yes"}
    # An HTMX request gets the panel alone; the reason comes from apps.jobs.backfill.
    response = client.post(url, backwards, HTTP_HX_REQUEST="true", HTTP_HX_TARGET="backfill")
    body = response.content.decode()
    assert response.status_code == 200 and "<html" not in body
    assert 'id="backfill-errors"' in body and "To: Must not be before from." in body
    assert (
        "Enter a valid date/time" in client.post(url, {"start": "soon", "end": ""}).content.decode()
    )
    # A range at the ends of the calendar is a mistake beside the form, as in the API.
    for start, end in [
        ("0001-01-01T00:00", "9999-12-31T23:59"),
        ("0001-01-01T00:00", "0001-01-01T00:01"),
    ]:
        for confirm in ("", "yes"):
            ends = client.post(url, {"start": start, "end": end, "confirm": confirm})
            assert ends.status_code == 200
            assert (
                "From: The range reaches the first or last instants a time can hold (in 0001-01-01 or 9999-12-31, in the zone of the schedule): fire times cannot be computed there."
                in ends.content.decode()
            )
    # A job without a cron schedule has no backfill form, and the domain refuses it by hand too.
    manual = make_definition(team_a, "billing.manual", queue="billing")
    assert "Preview backfill" not in client.get(f"/jobs/{manual.name}").content.decode()
    refused = client.post(f"/jobs/{manual.name}/backfill", {**RANGE, "confirm": "yes"})
    assert "Only cron jobs can be backfilled." in refused.content.decode()
    assert not Run.objects.exists()


# --- late and missed ------------------------------------------------------------------------


def _watched_job(team, name, **fields):
    """An hourly job with an SLO, created two hours ago: its past cron times had no run."""
    job = make_definition(
        team, name, queue="billing", schedule={"cron": "0 * * * *", "jitterSeconds": 0},
        lateness_slo_seconds=30, timeout_seconds=60, **fields,
    )  # fmt: skip
    JobDefinition.objects.filter(pk=job.pk).update(created_at=db_now() - timedelta(hours=2))
    (late,) = add_ready_runs(job, 1, prefix=name)
    Run.objects.filter(pk=late).update(started_at=db_now(), late_seconds=95.0)
    job.refresh_from_db()
    return job, public_run_id(late)


def test_late_and_missed_lists_the_alerts_of_my_teams(operator_a, team_a, team_b):
    job, late_run = _watched_job(team_a, "billing.hourly", owner=f"ops {XSS}", runbook_url=RUNBOOK)
    _watched_job(team_b, "search.hourly")
    client = client_for(operator_a)
    body = client.get("/alerts").content.decode()
    found = alerts.alerts_for(team_a, db_now(), limit=500).alerts
    assert {alert.kind for alert in found} == {"late", "missed"}
    for alert in found:
        about = alert.as_json()
        assert instants(about["message"]) in body  # its instants as times
    assert body.count('class="alert-row') == len(found)
    assert f'href="/runs/{late_run}"' in body and f'href="/jobs/{job.name}"' in body
    assert escape(f"ops {XSS}") in body and XSS not in body
    assert f'href="{escape(RUNBOOK)}" target="_blank" rel="noopener noreferrer"' in body
    assert "search.hourly" not in body  # team B's

    # The overview loads the panel after the page; HTMX gets the table alone, at most `limit`.
    overview = client.get("/").content.decode()
    assert 'id="late-and-missed"' in overview and 'hx-get="/alerts?limit=10"' in overview
    panel = client.get("/alerts?limit=1", HTTP_HX_REQUEST="true", HTTP_HX_TARGET="alerts-table")
    panel_body = panel.content.decode()
    assert "<html" not in panel_body and panel_body.count('class="alert-row') == 1
    assert f"{len(found) - 1} more" in panel_body and 'href="/alerts"' in panel_body
    # The page shows the newest it can; its count of the rest links nowhere (it led to itself).
    with mock.patch.object(alerts_page, "MOST_SHOWN", 1):
        page = client.get(
            "/alerts", HTTP_HX_REQUEST="true", HTTP_HX_TARGET="alerts-table"
        ).content.decode()
    assert page.count('class="alert-row') == 1
    assert f"{len(found) - 1} more, older, not shown" in page and 'href="/alerts"' not in page


def test_new_pages_keep_the_csp(operator_a, team_a):
    job = _cron_job(team_a)
    client = client_for(operator_a)
    for path in ("/alerts", f"/jobs/{job.name}/backfill"):
        response = client.get(path)
        assert response.status_code == 200, path
        assert "script-src 'self'" in response["Content-Security-Policy"]
        assert "<script>" not in response.content.decode()
        assert " style=" not in response.content.decode()


# --- in the browser -------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_why_panel_then_backfill_preview_and_confirm_in_the_browser(web, operator_a, team_a):
    _, holder, waiting = _held_job(team_a)
    job = _cron_job(team_a, owner="payments on-call", runbook_url=RUNBOOK)
    web.sign_in(operator_a)
    page = web.page

    web.goto(f"/runs/{waiting.run_id}")
    why = page.locator("#why")
    expect(why.locator("[data-code=concurrency_limit]")).to_contain_text(
        "concurrency limit (1) is held by"
    )
    expect(why.locator(f"a[href='/runs/{holder.run_id}']")).to_be_visible()
    web.screenshot("operations-run-why")

    web.goto(f"/jobs/{job.name}")
    page.fill("#id_start", RANGE["start"])
    page.fill("#id_end", RANGE["end"])
    page.get_by_role("button", name="Preview backfill").click()
    expect(page.locator("#backfill-impact")).to_contain_text("Will create 4 runs, 0 already exist.")
    expect(page.locator("#backfill-preview tbody tr").first).to_contain_text(
        "2026-01-01T06:00:00+01:00"
    )
    web.screenshot("operations-backfill-preview")
    assert _backfill_runs(job) == []  # nothing before the confirmation

    page.get_by_role("button", name="Create 4 runs").click()
    expect(page.locator(".messages")).to_contain_text(f"Backfilled {job.name}: created 4 runs.")
    expect(page.locator("#job-history")).to_contain_text("job.backfill")
    web.screenshot("operations-backfill-done")
    assert _backfill_runs(job) == EXPECTED_DUE

    # The overview fetches its "Late and missed" panel after loading (htmx, under the CSP).
    watched, late_run = _watched_job(team_a, "billing.hourly", owner="payments on-call")
    web.goto("/")
    panel = page.locator("#late-and-missed")
    expect(panel.locator(f"a[href='/runs/{late_run}']")).to_be_visible()
    expect(panel.locator(".alert-missed").first).to_contain_text(watched.name)
    web.screenshot("operations-overview-late-and-missed")
    assert web.console_errors == []
