"""Triage in a real headless Chromium, on a laptop (1366 px) and a phone (390 px): 5 000 dead
runs requeued by filter after their count, failures grouped by error and acted on per group,
a stack trace folded on a run's page, and the run-id search box.

Screenshots go to test-artifacts/screenshots/ (`triage-…-1366.png`, `…-390.png`).
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest
from playwright.sync_api import expect

from apps.audit.models import AuditEvent
from apps.runs import fingerprints, store
from apps.runs.models import Run
from tests.conftest import add_ready_runs, make_definition
from tests.dashboard.conftest import SCREENSHOTS, BrowserPage
from tests.triage_runs import insert_failed, person

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]


@pytest.fixture
def operator(team_a):
    return person("oscar-operator", team_a, "operator")


WIDTHS = {1366: 768, 390: 844}


@pytest.fixture(params=sorted(WIDTHS, reverse=True), ids=lambda width: f"{width}px")
def screen(request, browser, asgi_server) -> Iterator[tuple[BrowserPage, int]]:
    width = request.param
    context = browser.new_context(viewport={"width": width, "height": WIDTHS[width]})
    context.set_default_timeout(10_000)
    yield BrowserPage(context, asgi_server), width
    context.close()


def dialog_shot(web: BrowserPage, name: str) -> None:
    """A screenshot of what the screen shows (the dialog over a long list), not the whole page."""
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    web.page.screenshot(path=str(SCREENSHOTS / f"{name}.png"))


def fits(web: BrowserPage, width: int) -> None:
    """The page scrolls down only: wide tables scroll inside their own frame."""
    assert web.page.evaluate("document.documentElement.scrollWidth") <= width


def test_5000_dead_runs_are_requeued_by_filter_after_their_count(screen, operator, job_a):
    web, width = screen
    insert_failed(job_a, 5000)
    other = make_definition(job_a.team, "billing.refund", queue="billing")
    insert_failed(other, 3)
    web.sign_in(operator)
    page = web.page
    web.goto(f"/dlq?job={job_a.name}")
    fits(web, width)
    page.get_by_role("button", name="Requeue all matching…").click()

    dialog = page.get_by_role("dialog")
    expect(dialog).to_contain_text("Requeue 5000 runs?")
    # The keyboard is in the dialog, on its safe choice: Enter does not act.
    expect(dialog.get_by_role("link", name="Cancel")).to_be_focused()
    expect(dialog.locator("#confirm-filter")).to_contain_text(job_a.name)
    dialog_shot(web, f"triage-requeue-by-filter-confirm-{width}")
    assert Run.objects.filter(state="dead").count() == 5003  # nothing before the confirmation

    dialog.get_by_role("button", name="Requeue 5000 runs").click()
    expect(page.locator(".messages")).to_contain_text(
        f"Requeued 5000 runs matching job {job_a.name}."
    )
    # Back on the list as it was filtered, now empty (the live updates kept its filter).
    expect(page).to_have_url(re.compile(rf"/dlq\?job={re.escape(job_a.name)}$"))
    expect(page.locator("td.empty")).to_be_visible()
    web.screenshot(f"triage-requeue-by-filter-done-{width}")
    assert Run.objects.filter(definition=job_a, state="ready").count() == 5000
    assert Run.objects.filter(definition=other, state="dead").count() == 3
    (event,) = AuditEvent.objects.filter(action="dlq.requeue")
    # The filter as chosen, and the moment of the count it acted up to.
    assert event.after["count"] == 5000 and event.before["filter"]["job"] == job_a.name
    assert set(event.before["filter"]) == {"job", "failedBy"}


def _failed_with_stack(job) -> int:
    """A run failed through the fail statement with a 40-frame stack; the newest of its group."""
    add_ready_runs(job, 1, prefix="with-stack")
    (lease,) = store.claim(queues=[job.queue], max_runs=1, worker_id="w/1", lease_seconds=60)
    frames = "".join(
        f'  File "billing/export.py", line {n}, in step_{n}\n    step()\n' for n in range(40)
    )
    error = {
        "type": "KeyError",
        "message": "no invoice for 'customer 42'",
        "stack": f"Traceback (most recent call last):\n{frames}KeyError: 'customer 42'",
    }
    store.fail([(lease.id, lease.fencing_token, error, True)], team_ids=[job.team_id])
    return lease.id


def test_grouped_failures_lead_to_a_folded_stack_and_are_retried_per_group(screen, operator, job_a):
    web, width = screen
    refund = make_definition(job_a.team, "billing.refund", queue="billing")
    keyed = insert_failed(job_a, 30, message="no invoice for 'customer %s'")
    insert_failed(refund, 10, message="no invoice for 'customer %s'", prefix="refund-")
    insert_failed(job_a, 6, state="retrying", error_type="TimeoutError", message="after %s s")
    sample = Run.objects.get(pk=_failed_with_stack(job_a))
    web.sign_in(operator)
    page = web.page
    web.goto("/failures")
    page.locator("#show-groups").click()
    expect(page).to_have_url(re.compile(r"/failures\?view=groups$"))
    expect(page.locator("#groups tr.group-row")).to_have_count(2)
    group = page.locator(f"#group-{fingerprints.to_hex(keyed)}")
    expect(group).to_contain_text("KeyError: no invoice for '<str>'")
    expect(group.locator("a.group-runs")).to_have_text("41")
    expect(group.locator(".group-jobs")).to_contain_text("billing.export-invoices, billing.refund")
    expect(group.locator(".sample")).to_contain_text(sample.run_id)
    expect(page.locator("#groups-summary")).to_contain_text("47 runs in 2 error groups")
    fits(web, width)
    web.screenshot(f"triage-grouped-failures-{width}")

    # The header's search box goes straight to a run; its stack trace is folded until opened.
    page.locator("#find-run").fill(sample.run_id.lower())
    page.locator("#find-run").press("Enter")
    expect(page).to_have_url(re.compile(rf"/runs/{sample.run_id}$"))
    folded = page.locator("#last-error-stack")
    expect(folded.locator("summary")).to_be_visible()
    expect(folded.locator("pre")).to_be_hidden()
    fits(web, width)
    web.screenshot(f"triage-stack-folded-{width}")
    folded.locator("summary").click()
    expect(folded.locator("pre")).to_be_visible()
    expect(folded.locator("pre")).to_contain_text("in step_39")
    expect(folded.locator("pre")).to_contain_text("KeyError: 'customer 42'")
    expect(page.locator("#timeline .attempt-stack summary")).to_have_text(
        "Stack trace of attempt 1"
    )
    fits(web, width)
    web.screenshot(f"triage-stack-open-{width}")

    web.goto("/failures?view=groups")
    group = page.locator(f"#group-{fingerprints.to_hex(keyed)}")
    group.get_by_role("button", name="Retry 41…").click()
    dialog = page.get_by_role("dialog")
    expect(dialog).to_contain_text("Retry 41 runs?")
    dialog.get_by_role("button", name="Retry 41 runs").click()
    # The group by its error, not by its key.
    expect(page.locator(".messages")).to_contain_text("Retried 41 runs matching error group ")
    expect(page.locator(".messages")).not_to_contain_text(fingerprints.to_hex(keyed))
    expect(page.locator("#groups tr.group-row")).to_have_count(1)  # the timeouts are left
    assert Run.objects.filter(error_fingerprint=keyed, state="ready").count() == 41
    assert AuditEvent.objects.filter(action="run.retry").count() == 1
    assert web.console_errors == []
