"""Every page at a phone's width (390 px): nothing wider than the screen but the tables' own
scrolling boxes, and the sections behind a "Menu" button."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from playwright.sync_api import expect

from apps.runs.ids import public_run_id
from apps.runs.models import Run
from tests.conftest import add_ready_runs, claim, make_definition
from tests.dashboard.conftest import BrowserPage, failed_runs

pytestmark = pytest.mark.django_db(transaction=True)

PHONE = {"width": 390, "height": 844}


@contextmanager
def on_a_phone(browser, asgi_server, user) -> Iterator[BrowserPage]:
    """`user` signed in, in a browser the width of a phone."""
    context = browser.new_context(viewport=PHONE)
    context.set_default_timeout(10_000)
    try:
        web = BrowserPage(context, asgi_server)
        web.sign_in(user)
        yield web
    finally:
        context.close()


def wider_than_a_phone(web: BrowserPage, path: str | None = None) -> int | None:
    """The page's width (of `path` once opened, else of the page as it is) when wider than the
    phone's screen, else None."""
    if path is not None:
        assert web.goto(path).status == 200, path
    width = web.page.evaluate("document.documentElement.scrollWidth")
    return width if width > PHONE["width"] else None


def test_every_page_fits_a_phone_and_the_sections_fold_behind_a_menu(
    browser, asgi_server, admin_a, job_a
):
    failed_runs(job_a, 2, message="connection reset by peer " * 8)
    add_ready_runs(job_a, 3, prefix="ready")
    run = Run.objects.filter(state="dead").first()
    with on_a_phone(browser, asgi_server, admin_a) as web:
        page = web.page
        paths = [
            "/",
            "/failures",
            "/runs",
            f"/runs/{run.run_id}",
            "/dlq",
            "/jobs",
            f"/jobs/{job_a.name}",
            "/jobs/new",
            f"/jobs/{job_a.name}/edit",
            "/alerts",
            "/queues",
            "/workers",
            "/audit",
            "/teams",
            "/teams/team-a",
        ]
        too_wide = {}
        for path in paths:
            too_wide[path] = wider_than_a_phone(web, path)
            expect(page.locator("h1").first).to_be_visible()
        # The job form's fire-time preview is a table of its own: once a cron fills it, it
        # scrolls inside its box (it once widened the form's column to 605 px).
        web.goto("/jobs/new")
        page.fill("#id_cron", "30 2 * * *")
        expect(page.locator("#preview tbody tr")).to_have_count(10)
        too_wide["/jobs/new with its preview"] = wider_than_a_phone(web)
        assert {path: width for path, width in too_wide.items() if width} == {}

        sections = page.locator("nav#sections")
        expect(sections).to_be_hidden()
        page.click("button.menu-toggle")
        expect(sections.get_by_role("link", name="Failures")).to_be_visible()
        sections.get_by_role("link", name="Queues").click()
        expect(page).to_have_url(asgi_server.url + "/queues")
        assert web.console_errors == []


def test_the_longest_names_wrap_at_a_phones_width(browser, asgi_server, admin_a, team_a):
    # Names at their limits (job 200, owner 200, worker id 200 characters), as a real job's
    # 46-character name already widened its page to 564 px.
    job = make_definition(team_a, "analytics." + "x" * 190, queue="q" * 100, owner="o" * 200)
    add_ready_runs(job, 1, prefix="long")
    (lease,) = claim(queues=[job.queue], max_runs=1, worker_id="w" * 200)
    with on_a_phone(browser, asgi_server, admin_a) as web:
        page = web.page
        too_wide = {}
        for path in (
            f"/jobs/{job.name}",
            f"/jobs/{job.name}/edit",
            f"/jobs/{job.name}/backfill",
            f"/jobs/{job.name}/delete",
            f"/runs/{public_run_id(lease.id)}",
            "/workers",
            "/queues",
        ):
            too_wide[path] = wider_than_a_phone(web, path)
        # A form error that repeats an unbroken value the user typed.
        web.goto("/jobs/new")
        page.fill("#id_cron", "0 2 * * *")
        page.fill("#id_time_zone", "Nowhere/" + "z" * 60)
        expect(page.locator(".field-error").filter(has_text="z" * 20).first).to_be_visible()
        too_wide["/jobs/new with a long time zone"] = wider_than_a_phone(web)
        assert {path: width for path, width in too_wide.items() if width} == {}


def test_the_audit_trail_and_the_jobs_list_fit_a_phone_with_their_key_column_readable(
    browser, asgi_server, admin_a, team_a, job_a
):
    """The audit trail's change tables (a hidden header each, placed outside the scrolling
    panel) widened the page to 614 px; the first column of the jobs list and the trail was
    squeezed to 58 px, a job's name broken over seven lines."""
    from apps.audit.models import AuditEvent

    fields = {f"field_{n}": "value " * 6 for n in range(8)}
    AuditEvent.objects.create(
        team=team_a, actor="t", source="cli", action="job.create", target_type="job",
        target=job_a.name, after=fields,
    )  # fmt: skip
    AuditEvent.objects.create(
        team=team_a, actor="t", source="cli", action="job.update", target_type="job",
        target=job_a.name, before={"cron": "0 2 * * *", "payload": '{"a": 1}' * 6},
        after={"cron": "0 3 * * *", "payload": '{"b": 2}' * 6},
    )  # fmt: skip
    make_definition(team_a, "billing.export-invoices-weekly", queue="billing")
    with on_a_phone(browser, asgi_server, admin_a) as web:
        too_wide = {path: wider_than_a_phone(web, path) for path in ("/audit", "/jobs")}
        assert {path: width for path, width in too_wide.items() if width} == {}
        for path in ("/audit", "/jobs"):
            web.goto(path)
            first = web.page.locator("#results table tbody tr td").first
            assert first.evaluate("e => e.getBoundingClientRect().width") >= 120, path
