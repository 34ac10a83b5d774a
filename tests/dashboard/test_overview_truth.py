"""The overview and the job pages tell the truth: every tile equals the list it links to, the
rate tile agrees with its chart, a job's next fire is the run already created for it, the form's
preview can start on a chosen day, and times show the reader's zone with ages that keep counting."""

from __future__ import annotations

import re
from datetime import timedelta

import pytest
from playwright.sync_api import expect

from apps.runs import counters
from apps.runs.models import MinuteCounts, Run
from apps.runs.store import NewRun, insert_runs
from tests.conftest import add_ready_runs, db_now, make_definition
from tests.dashboard.conftest import BrowserPage, client_for, failed_runs

pytestmark = pytest.mark.django_db


def _value(body: str, element_id: str) -> str:
    found = re.search(rf'id="{element_id}">([^<]*)<', body)
    assert found, element_id
    return found.group(1).strip()


def _rows(body: str) -> int:
    return len(re.findall(r'<tr id="run-row-', body))


def test_each_count_tile_equals_the_list_it_links_to(viewer_a, team_a):
    job = make_definition(team_a, "ops.flaky", queue="ops", retry_max_attempts=3)
    retrying = failed_runs(job, 3, retryable=True, prefix="r")
    failed_runs(job, 2, prefix="d")
    add_ready_runs(job, 4, prefix="w")
    # One of them due again: a ready run, still among the failures, and the split says so.
    Run.objects.filter(pk=retrying[0].pk).update(available_at=db_now() - timedelta(seconds=1))
    client = client_for(viewer_a)
    body = client.get("/").content.decode()
    assert _value(body, "failing") == "5"
    assert _value(body, "count-retrying") == "2" and _value(body, "count-ready") == "5"
    split = _value(body, "failing-split")
    assert split.startswith("3 to retry") and split.endswith("· 2 dead"), split
    links = dict(
        re.findall(
            r'<a class="tile[^"]*" href="([^"]+)">\s*<div class="label">.*?'
            r'<div class="value" id="([^"]+)">',
            body,
            re.S,
        )
    )
    for href, element_id in links.items():
        listed = client.get(href.replace("&amp;", "&")).content.decode()
        assert _rows(listed) == int(_value(body, element_id)), (href, element_id)
    assert {"failing", "dlq-size", "count-ready", "count-retrying", "count-dead"} <= set(
        links.values()
    )


def test_the_rate_tile_agrees_with_the_last_minutes_of_its_chart(viewer_a, team_a):
    """Seven attempts a minute for the last ten minutes: 7.0, not an hour's average of 1."""
    now = db_now().replace(second=0, microsecond=0)
    MinuteCounts.objects.bulk_create(
        MinuteCounts(
            minute=now - timedelta(minutes=back),
            team=team_a,
            queue="ops",
            priority=1,
            slot=0,
            started=7,
            succeeded=6,
            failed=1,
            latency=[0] * (len(counters.LATENCY_BOUNDS) + 1),
        )
        for back in range(1, 11)
    )
    body = client_for(viewer_a).get("/").content.decode()
    assert _value(body, "per-minute") == "7.0"


def test_a_jobs_next_fire_is_the_run_already_created_for_it(viewer_a, team_a):
    job = make_definition(
        team_a, "ops.hourly", queue="ops", schedule={"cron": "0 * * * *", "timeZone": "UTC"}
    )
    due = db_now().replace(minute=0, second=0, microsecond=0) + timedelta(hours=1)
    (pk,) = insert_runs([NewRun(job.pk, "cron", due, due, f"ops.hourly@{due.isoformat()}")])
    job.next_due_at = due + timedelta(hours=1)  # the scheduler has moved past it
    job.save(update_fields=["next_due_at"])
    body = client_for(viewer_a).get(f"/jobs/{job.name}").content.decode()
    shown = body[body.index('id="job-next-fire"') :].split("</dd>")[0]
    assert Run.objects.get(pk=pk).run_id in shown
    assert due.strftime("%Y-%m-%dT%H:%M:%SZ") in shown


def test_the_forms_preview_starts_on_a_chosen_day_to_show_a_dst_change(editor_a):
    client = client_for(editor_a)
    query = {"kind": "cron", "cron": "30 2 * * *", "time_zone": "Europe/Berlin"}
    body = client.get("/jobs/-/preview", {**query, "preview_from": "2031-03-29"}).content.decode()
    # 02:30 does not exist in Berlin on 30 March 2031: the first time shown is the 29th's, then
    # the 30th's, moved to 03:00 (the next valid time) and marked.
    assert body.index("2031-03-29") < body.index("2031-03-30")
    assert "2031-03-30T03:00:00+02:00" in body and "02:30 does not exist on this day" in body
    refused = client.get("/jobs/-/preview", {**query, "preview_from": "29.03.2031"})
    assert (
        'id="err-preview_from" hx-swap-oob="true">A day as YYYY-MM-DD.' in refused.content.decode()
    )
    # The schedule is fine: the panel says which field to fix.
    assert "Fix the day to preview from." in refused.content.decode()
    assert "Fix the schedule" not in refused.content.decode()


@pytest.mark.django_db(transaction=True)
def test_times_show_the_readers_zone_and_their_ages_keep_counting(
    browser, asgi_server, viewer_a, job_a
):
    context = browser.new_context(
        viewport={"width": 390, "height": 844}, timezone_id="Asia/Kolkata"
    )
    context.set_default_timeout(10_000)
    try:
        web = BrowserPage(context, asgi_server)
        web.page.clock.install()
        web.sign_in(viewer_a)
        web.goto("/")
        stamp = web.page.locator("#overview-updated time")
        expect(stamp).to_have_text(re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d (GMT\+5:30|IST)$"))
        assert stamp.get_attribute("title").endswith("Z")
        age = web.page.locator("#overview-updated .age")
        web.page.clock.fast_forward(125_000)
        expect(age).to_have_text("2 min ago")
        assert web.console_errors == []
    finally:
        context.close()
