"""The dashboard in a real headless Chromium against uvicorn (HTTP and WebSocket) on PostgreSQL.

Each test saves screenshots to test-artifacts/screenshots/ for a reviewer to look at.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime

import httpx
import pytest
from playwright.sync_api import expect

from apps.audit.models import AuditEvent
from apps.jobs import services
from apps.jobs.models import JobDefinition
from apps.runs.models import Run
from apps.teams.models import ApiToken, Membership
from tests.conftest import add_ready_runs, make_definition
from tests.dashboard.conftest import PASSWORD, XSS, BrowserPage, failed_runs, make_user

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]


def test_sign_in_and_every_screen_renders(web, admin_a, job_a):
    failed_runs(job_a, 2, message="connection reset by peer")
    add_ready_runs(job_a, 3, prefix="ready")
    page = web.page
    web.goto("/failures")
    expect(page).to_have_url(re.compile(r"/accounts/login/\?next=/failures$"))
    web.screenshot("sign-in")
    page.fill("#id_username", admin_a.username)
    page.fill("#id_password", PASSWORD)
    page.click("button[type=submit]")
    expect(page).to_have_url(re.compile(r"/failures$"))
    expect(page.locator("header .who")).to_contain_text(admin_a.username)

    run = Run.objects.filter(state="dead").first()
    screens = {
        "overview": "/",
        "failures": "/failures",
        "runs": "/runs",
        "run-detail": f"/runs/{run.run_id}",
        "dlq": "/dlq",
        "jobs": "/jobs",
        "job-detail": f"/jobs/{job_a.name}",
        "job-new": "/jobs/new",
        "job-edit": f"/jobs/{job_a.name}/edit",
        "queues": "/queues",
        "audit": "/audit",
        "teams": "/teams",
        "team-admin": "/teams/team-a",
    }
    for name, path in screens.items():
        response = web.goto(path)
        assert response.status == 200, path
        expect(page.locator("h1").first).to_be_visible()
        web.screenshot(name)
    assert web.console_errors == []  # no CSP violation, no failed script


def test_a_failed_run_appears_without_reload_then_is_inspected_and_retried(web, operator_a, team_a):
    job = make_definition(team_a, "billing.charge", queue="billing", retry_max_attempts=2)
    web.sign_in(operator_a)
    page = web.page
    web.goto("/failures")
    web.wait_live()
    expect(page.locator("td.empty")).to_be_visible()
    page.evaluate("window.__sameDocument = true")

    (run,) = failed_runs(
        job, retryable=False, message=f"{XSS} card declined", payload={"html": XSS}
    )
    row = page.locator(f"#run-row-{run.pk}")
    expect(row).to_be_visible(timeout=10_000)
    assert page.evaluate("window.__sameDocument") is True  # swapped in, not reloaded
    expect(row).to_contain_text("dead")
    expect(row).to_contain_text(f"{XSS} card declined")  # shown as text
    web.screenshot("failures-live-update")

    row.locator("a", has_text=run.run_id).click()
    expect(page).to_have_url(re.compile(rf"/runs/{run.run_id}$"))
    expect(page.locator("#last-error")).to_have_text(f"{XSS} card declined")
    expect(page.locator("#payload")).to_contain_text(XSS)
    timeline = page.locator("#timeline li")
    expect(timeline).to_have_count(1)
    expect(timeline.first).to_contain_text("Attempt 1")
    expect(timeline.first).to_contain_text("failed")
    expect(timeline.first).to_contain_text("worker-1/4242")
    expect(timeline.first).to_contain_text(str(Run.objects.get(pk=run.pk).fencing_token))
    expect(page.locator("dd.mono", has_text=run.idempotency_key)).to_be_visible()
    web.screenshot("run-detail-dead")

    # A dead run offers one way back (Requeue, with a fresh budget), not Retry beside it.
    expect(page.get_by_role("button", name="Retry")).to_have_count(0)
    page.get_by_role("button", name="Requeue").click()
    expect(page.locator(".messages")).to_contain_text(f"Requeued {run.run_id}")
    expect(page.locator("#run-body .state").first).to_have_text("ready")
    assert Run.objects.get(pk=run.pk).state == "ready"
    assert AuditEvent.objects.filter(target=run.run_id, source="dashboard").exists()
    web.screenshot("run-detail-retried")
    assert web.dialogs == []  # the <script> never ran
    assert web.console_errors == []


def test_a_reader_scrolled_down_the_failures_keeps_their_place_as_new_ones_arrive(
    web, operator_a, job_a
):
    """New failures arrive at the top of the list: the row the reader was looking at stays
    where it was on the screen (before: pushed down by each new row), and the new rows are
    marked as such."""
    failed_runs(job_a, 40, prefix="old")
    web.sign_in(operator_a)
    page = web.page
    web.goto("/failures")
    web.wait_live()
    # In the page, not through element handles: an update may replace the rows at any time
    # (the socket's first render comes about a second after it opens).
    row = page.locator("tbody tr[id]").nth(15).get_attribute("id")
    top_of_row = f"document.getElementById('{row}').getBoundingClientRect().top"
    page.evaluate(f"document.getElementById('{row}').scrollIntoView()")
    page.mouse.wheel(0, -120)  # a little back, as a reader scrolls
    expect(page.locator(f"#{row}")).to_be_in_viewport()
    top = page.evaluate(top_of_row)
    updates = int(page.locator("body").get_attribute("data-live-updates") or 0)

    newer = failed_runs(job_a, 3, prefix="new")
    expect(page.locator(f"#run-row-{newer[0].pk}")).to_be_attached(timeout=10_000)
    assert int(page.locator("body").get_attribute("data-live-updates")) > updates
    assert abs(page.evaluate(top_of_row) - top) <= 1  # before: three rows lower
    for run in newer:
        expect(page.locator(f"#run-row-{run.pk}")).to_have_class(re.compile(r"\barrived\b"))
    expect(page.locator("tr.arrived")).to_have_count(3)
    web.screenshot("failures-reader-kept-in-place")
    assert web.console_errors == []


def test_the_due_filter_is_typed_in_the_readers_zone(browser, asgi_server, operator_a, job_a):
    """A reader in New York types 10:00 as the page shows times: in their zone, said beside
    the field, and kept in the link."""
    early, late = failed_runs(job_a, 2)
    Run.objects.filter(pk=early.pk).update(due_at=datetime(2026, 1, 10, 11, 0, tzinfo=UTC))
    Run.objects.filter(pk=late.pk).update(due_at=datetime(2026, 1, 10, 16, 0, tzinfo=UTC))
    context = browser.new_context(timezone_id="America/New_York")
    try:
        web = BrowserPage(context, asgi_server)
        web.sign_in(operator_a)
        page = web.page
        web.goto("/failures")
        expect(page.get_by_text("Due from (America/New_York)")).to_be_visible()
        page.locator("input[name=due_from]").fill("2026-01-10T10:00")
        page.get_by_role("button", name="Filter").click()
        expect(page).to_have_url(re.compile(r"tz=America%2FNew_York"))
        expect(page.locator(f"#run-row-{late.pk}")).to_be_visible()
        expect(page.locator(f"#run-row-{early.pk}")).to_have_count(0)  # 06:00 there
        expect(page.locator(f"#run-row-{late.pk} time")).to_contain_text("11:00:00")
        # A link with times and no zone was read in UTC: it says so, and keeps meaning that.
        web.goto("/failures?due_from=2026-01-10T10:00")
        expect(page.get_by_text("Due from (UTC)")).to_be_visible()
        expect(page.locator(f"#run-row-{early.pk}")).to_be_visible()
        page.get_by_role("button", name="Filter").click()
        expect(page).to_have_url(re.compile(r"tz=UTC"))
        expect(page.locator(f"#run-row-{early.pk}")).to_be_visible()
        assert web.console_errors == []
    finally:
        context.close()


def test_a_live_update_keeps_the_readers_ticks_and_focus(web, operator_a, job_a):
    """Ticked runs pushed off the page by new failures stay selected, and say so; the link a
    keyboard reader was on keeps the focus (before: both were lost at the update)."""
    failed_runs(job_a, 50, prefix="old")
    web.sign_in(operator_a)
    page = web.page
    web.goto("/failures")
    web.wait_live()
    rows = page.locator("tbody tr[id]")
    last_two = [rows.nth(i).locator("input[name=ids]") for i in (48, 49)]
    picked = [box.get_attribute("value") for box in last_two]
    for box in last_two:
        box.check()
    rows.nth(5).locator("input[name=ids]").check()  # one that stays on the page
    row = rows.nth(10).get_attribute("id")  # focused in the page: the rows may be replaced
    href = page.evaluate(f"(a => (a.focus(), a.getAttribute('href')))"
                         f"(document.querySelector('#{row} a'))")  # fmt: skip

    newer = failed_runs(job_a, 3, prefix="new")
    expect(page.locator(f"#run-row-{newer[0].pk}")).to_be_attached(timeout=10_000)
    for value in picked:  # off the page now, still in the form
        expect(page.locator(f"#bulk-form input[type=hidden][name=ids][value='{value}']")
               ).to_have_count(1)  # fmt: skip
    expect(page.locator(".kept-ticked")).to_contain_text("2 ticked runs are no longer on this page")
    assert page.evaluate("document.activeElement.getAttribute('href')") == href
    select_all = page.locator("[data-select-all]")  # one of the page's runs is ticked
    assert select_all.evaluate("box => [box.checked, box.indeterminate]") == [False, True]
    page.get_by_role("button", name="Retry selected…").click()
    expect(page.locator("#dialog")).to_contain_text("Retry 3 runs?")
    web.screenshot("failures-ticks-kept")
    assert web.console_errors == []


def test_two_dlq_runs_are_requeued_in_one_confirmed_bulk_action(web, operator_a, job_a):
    first, second, third = failed_runs(job_a, 3)
    web.sign_in(operator_a)
    page = web.page
    web.goto("/dlq")
    page.check(f"#pick-{first.pk}")
    page.check(f"#pick-{second.pk}")
    page.get_by_role("button", name="Requeue selected…").click()
    dialog = page.get_by_role("dialog")
    expect(dialog).to_contain_text("Requeue 2 runs?")
    expect(dialog).to_contain_text(first.run_id)
    expect(dialog).to_contain_text(second.run_id)
    web.screenshot("dlq-bulk-confirm")
    assert Run.objects.filter(state="dead").count() == 3  # nothing changes before the confirmation
    dialog.get_by_role("button", name="Requeue 2 runs").click()
    expect(page.locator(".messages")).to_contain_text("Requeued 2 runs.")
    expect(page.locator(f"#run-row-{third.pk}")).to_be_visible()
    expect(page.locator(f"#run-row-{first.pk}")).to_have_count(0)
    web.screenshot("dlq-after-requeue")
    states = dict(Run.objects.values_list("pk", "state"))
    assert (states[first.pk], states[second.pk], states[third.pk]) == ("ready", "ready", "dead")
    assert AuditEvent.objects.filter(action="dlq.requeue", source="dashboard").count() == 2


def test_a_paused_definition_is_refused_to_the_api(web, operator_a, job_a, asgi_server):
    add_ready_runs(job_a, 1)
    raw = ApiToken.issue(job_a.team, ["worker"])[1]
    web.sign_in(operator_a)
    page = web.page
    web.goto(f"/jobs/{job_a.name}")
    page.get_by_role("button", name="Pause").click()
    expect(page.locator(".messages")).to_contain_text(f"Paused {job_a.name}")
    expect(page.locator("#job-paused")).to_be_visible()
    web.screenshot("job-paused")
    assert JobDefinition.objects.get(pk=job_a.pk).paused

    lease = {"queues": ["billing"], "max": 10, "workerId": "w-1"}
    headers = {"Authorization": f"Bearer {raw}"}
    answer = httpx.post(f"{asgi_server.url}/api/v1/leases", json=lease, headers=headers)
    assert answer.status_code == 200 and answer.json()["leases"] == []

    page.get_by_role("button", name="Resume").click()
    expect(page.locator(".messages")).to_contain_text(f"Resumed {job_a.name}")
    answer = httpx.post(f"{asgi_server.url}/api/v1/leases", json=lease, headers=headers)
    assert len(answer.json()["leases"]) == 1
    actions = list(
        AuditEvent.objects.filter(target=job_a.name).order_by("pk").values_list("action", flat=True)
    )
    assert actions == ["job.pause", "job.resume"]


def test_editing_a_cron_previews_it_saves_it_and_the_audit_shows_the_diff(web, editor_a, team_a):
    spec = services.DefinitionSpec(
        name="reports.nightly", schedule={"cron": "0 2 * * *", "timeZone": "Europe/Berlin",
        "jitterSeconds": 0, "missedRunPolicy": "run_once", "overlapPolicy": "allow_all"},
        queue="reports", priority=1,
        timeout_seconds=600, retry_max_attempts=3, retry_base_seconds=30, retry_max_seconds=1800,
        concurrency=None, payload={}, paused=False, dry_run=False,
    )  # fmt: skip
    from apps.audit.record import Actor

    services.create_definition(team_a, spec, Actor.cli("test"))
    web.sign_in(editor_a)
    page = web.page
    web.goto("/jobs/reports.nightly/edit")
    first_local = page.locator("#preview tbody tr").first.locator("td").first
    expect(first_local).to_contain_text("T02:00:00")

    page.fill("#id_cron", "17 5 * * *")
    expect(first_local).to_contain_text("T05:17:00")  # the preview followed the typing
    page.fill("#id_cron", "61 5 * * *")
    expect(page.locator("#err-cron")).not_to_be_empty()  # live validation, from schedule.py
    expect(page.locator("#preview")).to_contain_text("Fix the schedule")
    page.fill("#id_cron", "30 2 * * *")
    expect(page.locator("#err-cron")).to_be_empty()
    expect(page.locator("#preview tbody tr")).to_have_count(10)
    web.screenshot("job-edit-preview")
    # The other fields are checked as they are typed too (a payload that is not JSON was said
    # only once saved), and their reasons go once fixed.
    page.fill("#id_payload", '{"format": "csv", oops')
    expect(page.locator("#err-payload")).to_contain_text("Not valid JSON")
    page.fill("#id_queue", "bad queue!")
    expect(page.locator("#err-queue")).not_to_be_empty()
    page.fill("#id_payload", "{}")
    page.fill("#id_queue", "reports")
    expect(page.locator("#err-payload")).to_be_empty()
    expect(page.locator("#err-queue")).to_be_empty()

    page.get_by_role("button", name="Save changes").click()
    expect(page).to_have_url(re.compile(r"/jobs/reports\.nightly$"))
    expect(page.locator(".messages")).to_contain_text("Saved reports.nightly")
    assert JobDefinition.objects.get(name="reports.nightly").schedule["cron"] == "30 2 * * *"

    web.goto("/audit?action=job.update")
    row = page.locator("tr.audit-row").first
    expect(row).to_contain_text("erin-editor")
    expect(row).to_contain_text("dashboard")
    expect(row).to_contain_text("schedule.cron")
    expect(row.locator(".before")).to_contain_text('"0 2 * * *"')
    expect(row.locator(".after")).to_contain_text('"30 2 * * *"')
    # A screen reader reads the change as a table: each field heads its row, under column
    # headers it does not show (the cells had no header at all).
    diff = row.get_by_role("table")
    expect(diff.get_by_role("rowheader", name="schedule.cron")).to_have_count(1)
    expect(diff.get_by_role("columnheader")).to_have_text(["Field", "Before → after"])
    web.screenshot("audit-edit-diff")
    assert web.console_errors == []


def test_a_viewer_sees_the_pages_without_any_action(web, viewer_a, job_a):
    (run,) = failed_runs(job_a)
    web.sign_in(viewer_a)
    page = web.page
    web.goto(f"/runs/{run.run_id}")
    expect(page.locator("#last-error")).to_have_text("boom")
    expect(page.get_by_role("button", name="Requeue")).to_have_count(0)
    web.goto("/dlq")
    expect(page.locator(f"#run-row-{run.pk}")).to_be_visible()
    expect(page.get_by_role("button", name="Requeue selected…")).to_have_count(0)
    web.goto(f"/jobs/{job_a.name}")
    expect(page.get_by_role("button", name="Pause")).to_have_count(0)
    web.screenshot("viewer-job-detail")


def test_a_double_click_on_an_action_sends_it_once(web, operator_a, job_a):
    web.sign_in(operator_a)
    page = web.page
    web.goto(f"/jobs/{job_a.name}")
    page.get_by_role("button", name="Trigger now").dblclick()
    expect(page.locator(".messages")).to_contain_text(f"Triggered {job_a.name}")
    assert Run.objects.filter(definition=job_a, trigger="manual").count() == 1


def test_an_action_refused_by_the_server_says_why(web, operator_a, job_a, job_b):
    # The page is open; another job of the team is deleted elsewhere before its button is
    # clicked (its page as it was).
    other = make_definition(job_a.team, "billing.other", queue="billing")
    web.sign_in(operator_a)
    page = web.page
    web.goto(f"/jobs/{other.name}")
    JobDefinition.objects.filter(pk=other.pk).delete()
    page.get_by_role("button", name="Pause").click()
    expect(page.locator("#messages [role=alert]")).to_contain_text(
        "Not found: There is nothing here"
    )

    # A list filtered to a team the user only views offers no actions; their own team's does.
    Membership.objects.create(user=operator_a, team=job_b.team, role="viewer")
    (mine,) = failed_runs(job_a)
    (theirs,) = failed_runs(job_b)
    web.goto(f"/dlq?team={job_b.team.slug}")
    expect(page.locator(f"#run-row-{theirs.pk}")).to_be_visible()
    expect(page.locator(f"#run-row-{mine.pk}")).to_have_count(0)
    expect(page.get_by_role("button", name=re.compile("Requeue"))).to_have_count(0)
    web.goto(f"/dlq?team={job_a.team.slug}")
    expect(page.get_by_role("button", name="Requeue all matching…")).to_have_count(1)


def test_a_live_update_during_an_action_waits_for_its_answer(web, operator_a, job_a):
    """The Pause form is in the job page's live region. A change that re-renders the region
    arrives while the Pause request is on its way (its answer held back here), and the answer
    is a refusal: the page says why, then shows the region as it is now. Before, the update
    replaced the form and the refusal, sent to the replaced form, was never shown."""
    web.sign_in(operator_a)
    page = web.page
    web.goto(f"/jobs/{job_a.name}")
    web.wait_live()
    held = []

    def hold(route) -> None:
        held.append(route)

    page.route(f"**/jobs/{job_a.name}/pause", hold)
    # Refused when it arrives: the operator is made a viewer meanwhile.
    Membership.objects.filter(user=operator_a, team=job_a.team).update(role="viewer")
    page.get_by_role("button", name="Pause").click()
    while not held:
        page.wait_for_timeout(50)

    (new,) = add_ready_runs(job_a, 1, prefix="meanwhile")  # the page's history changes
    expect(page.locator("body[data-live-held]")).to_be_attached(timeout=10_000)
    expect(page.get_by_role("button", name="Pause")).to_be_attached()  # the form stays

    held[0].continue_()
    expect(page.locator("#messages [role=alert]")).to_contain_text("Not allowed")
    # Then the region as it is now: the new run, and no actions for a viewer.
    new_id = Run.objects.get(pk=new).run_id
    expect(page.locator("#job-history")).to_contain_text(new_id, timeout=10_000)
    expect(page.get_by_role("button", name="Pause")).to_have_count(0)
    expect(page.locator("body[data-live-held]")).to_have_count(0)
    assert not JobDefinition.objects.get(pk=job_a.pk).paused
    web.screenshot("job-refusal-during-live-update")


def _sent_signed_out_then_signed_in(page, button: str, user) -> None:
    """The session ends (every one is deleted), the form is sent, and `user` signs in on the
    page it lands on."""
    from django.contrib.sessions.models import Session

    Session.objects.all().delete()
    page.get_by_role("button", name=button).click()
    expect(page).to_have_url(re.compile(r"/accounts/login/"))
    page.fill("#id_username", user.username)
    page.fill("#id_password", PASSWORD)
    page.click("button[type=submit]")


def test_a_job_form_sent_after_the_session_ended_is_back_with_what_was_typed(web, editor_a, job_a):
    """The session ends while an edit is typed (it expired; another tab signed out): Save lands
    on the sign-in page, and what was typed was lost. Signed in again, the reader is back on
    the form with it; saved, it is the job's; the form opened again later is the job's own."""
    web.sign_in(editor_a)
    page = web.page
    web.goto(f"/jobs/{job_a.name}/edit")
    page.fill("#id_owner", "typed@example.com")
    page.fill("#id_timeout_seconds", "77")
    page.check("#id_dry_run")
    _sent_signed_out_then_signed_in(page, "Save changes", editor_a)

    expect(page).to_have_url(re.compile(rf"/jobs/{re.escape(job_a.name)}/edit$"))
    expect(page.locator(".draft-note")).to_contain_text("What you typed before signing in again")
    expect(page.locator("#id_owner")).to_have_value("typed@example.com")
    expect(page.locator("#id_timeout_seconds")).to_have_value("77")
    expect(page.locator("#id_dry_run")).to_be_checked()
    web.screenshot("job-form-draft-put-back")
    page.get_by_role("button", name="Save changes").click()
    expect(page.locator(".messages")).to_contain_text(f"Saved {job_a.name}")
    job = JobDefinition.objects.get(pk=job_a.pk)
    assert (job.owner, job.timeout_seconds, job.dry_run) == ("typed@example.com", 77, True)

    web.goto(f"/jobs/{job_a.name}/edit")  # nothing is put back once it was saved
    expect(page.locator("#id_timeout_seconds")).to_have_value("77")
    expect(page.locator(".draft-note")).to_have_count(0)

    # Another person signing in on that page gets the form empty, not what was typed there.
    other = make_user("olga-editor", job_a.team, "editor")
    web.goto("/jobs/new")
    page.fill("#id_name", "secret.job")
    page.fill("#id_payload", '{"apiKey": "secret"}')
    _sent_signed_out_then_signed_in(page, "Create job", other)
    expect(page).to_have_url(re.compile(r"/jobs/new$"))
    expect(page.locator("#id_name")).to_have_value("")
    expect(page.locator(".draft-note")).to_have_count(0)
    assert web.console_errors == []


def test_a_form_larger_than_the_server_reads_is_stopped_with_its_input_kept(
    web, editor_a, job_a, asgi_server
):
    """Past the body limit the server answers unread (413), and a plain form's page with it:
    the browser showed the API's JSON and every field typed was lost."""
    web.sign_in(editor_a)
    page = web.page
    web.goto(f"/jobs/{job_a.name}/edit")
    page.fill("#id_owner", "kept@example.com")
    huge = '{"a": "' + "x" * 2_000_000 + '"}'
    page.evaluate("(value) => { document.getElementById('id_payload').value = value; }", huge)
    page.get_by_role("button", name="Save changes").click()
    expect(page.locator("#messages [role=alert]")).to_contain_text("Not sent: the form is")
    assert page.url.endswith(f"/jobs/{job_a.name}/edit")
    expect(page.locator("#id_owner")).to_have_value("kept@example.com")
    assert JobDefinition.objects.get(pk=job_a.pk).owner != "kept@example.com"

    # Without the page's script (or past it), the server's answer is a page, not the API's JSON.
    sent = httpx.post(f"{asgi_server.url}/jobs/new", content=b"x" * 2_000_000)
    assert sent.status_code == 413 and sent.headers["content-type"].startswith("text/html")
    assert "Too large" in sent.text
    api = httpx.post(f"{asgi_server.url}/api/v1/runs", content=b"x" * 2_000_000)
    assert api.status_code == 413 and api.headers["content-type"] == "application/problem+json"


def test_a_confirmation_holds_the_focus_and_escape_closes_it_giving_the_focus_back(
    web, operator_a, job_a
):
    (run,) = failed_runs(job_a, 1)
    web.sign_in(operator_a)
    page = web.page
    web.goto("/dlq")
    page.check(f"#pick-{run.pk}")
    opener = page.get_by_role("button", name="Discard selected…")
    opener.focus()
    page.keyboard.press("Enter")
    dialog = page.get_by_role("dialog")
    expect(dialog).to_contain_text("Discard 1 run?")
    # Tab and Shift+Tab go round the dialog's own controls (they went on into the page).
    expect(dialog.get_by_role("link", name="Cancel")).to_be_focused()
    inside = "document.querySelector('#dialog .modal').contains(document.activeElement)"
    for key in ["Tab"] * 4 + ["Shift+Tab"] * 4:
        page.keyboard.press(key)
        assert page.evaluate(inside), key
    page.keyboard.press("Escape")
    expect(page.get_by_role("dialog")).to_have_count(0)
    expect(opener).to_be_focused()
    # A live update that re-rendered the list (its bar and the button with it) while the
    # dialog was open: the focus went nowhere (seen once under the suite's load).
    opener.focus()
    page.keyboard.press("Enter")
    expect(dialog).to_contain_text("Discard 1 run?")
    opener.evaluate("button => button.replaceWith(button.cloneNode(true))")
    page.keyboard.press("Escape")
    expect(page.get_by_role("dialog")).to_have_count(0)
    expect(opener).to_be_focused()
    assert Run.objects.get(pk=run.pk).state == "dead"


@pytest.mark.parametrize("width", [1280, 375])
def test_a_job_with_a_long_name_leaves_the_other_columns_in_view(web, operator_a, team_a, width):
    """A name of 190 characters without a space pushed every other column of the jobs list out
    of view (and, kept in view on a phone, covered them)."""
    make_definition(team_a, "late.a" + "x" * 190, queue="billing")
    web.sign_in(operator_a)
    page = web.page
    page.set_viewport_size({"width": width, "height": 800})
    web.goto("/jobs")
    header = page.locator("th", has_text="Schedule").first
    cell = page.locator("td", has_text="late.a").first
    expect(header).to_be_visible()
    expect(cell).to_be_visible()
    # Read where each is laid out, waiting for it: bounding_box() gave None when a live update
    # replaced the table between the check above and the read (seen once under the suite).
    box, name = (
        locator.evaluate("e => e.getBoundingClientRect().toJSON()") for locator in (header, cell)
    )
    if width == 1280:
        assert box["x"] + box["width"] <= width, box
    # The name's cell wraps: it no longer spans the screen, whatever the width.
    assert name["width"] < 0.6 * width, name
