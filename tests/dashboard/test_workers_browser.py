"""The workers screen in a real headless Chromium: a team's workers with their runs in flight and
the lease about to expire, at a laptop's width and a phone's (390 px), other teams' hidden."""

from __future__ import annotations

import re

import pytest
from django.db import connections
from playwright.sync_api import expect

from apps.runs import shards
from apps.runs.ids import public_run_id
from tests.conftest import add_ready_runs, claim

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]


def test_the_workers_screen_shows_in_flight_runs_and_a_lease_about_to_expire(
    web, operator_a, job_a, job_b
):
    add_ready_runs(job_a, 3)
    claim(queues=["billing"], max_runs=2, worker_id="host-1/4242", team_ids=[job_a.team_id])
    (late,) = claim(queues=["billing"], max_runs=1, worker_id="pod-7", team_ids=[job_a.team_id])
    add_ready_runs(job_b, 1)
    claim(queues=["search"], max_runs=1, worker_id="team-b-worker", team_ids=[job_b.team_id])
    with connections[shards.alias_of_run(late.id)].cursor() as cursor:
        # Two heartbeats missed: 5 s of its 60 s lease left.
        cursor.execute(
            "UPDATE runs_run SET lease_expires_at = now() + interval '5 seconds' WHERE id = %s",
            [late.id],
        )

    web.sign_in(operator_a)
    page = web.page
    page.set_viewport_size({"width": 1366, "height": 900})
    assert web.goto("/workers").status == 200
    expect(page.locator("nav a.active")).to_have_text("Workers")
    busy = page.locator("tr[data-worker='host-1/4242']")
    expect(busy.locator(".in-flight")).to_have_text("2")
    expect(busy).to_contain_text("billing")
    expect(busy.locator(".last-lease time")).to_have_attribute("datetime", re.compile(r"Z$"))
    expect(page.locator("tr[data-worker='pod-7'] .in-flight")).to_have_text("1")
    expect(page.locator("tr.worker-row")).to_have_count(2)  # team B's worker is not shown
    expect(page.locator("#workers")).not_to_contain_text("team-b-worker")
    expiring = page.locator("#expiring tbody tr.expiring-row")
    expect(expiring).to_have_count(1)
    expect(expiring).to_contain_text("pod-7")
    expect(expiring).to_contain_text(job_a.name)
    web.screenshot("workers-1366")

    page.set_viewport_size({"width": 390, "height": 844})
    web.goto("/workers")
    key = page.locator("tr[data-worker='host-1/4242'] th.key")
    expect(key).to_be_in_viewport()
    page.click("button.menu-toggle")  # the sections fold behind "Menu" on a phone
    expect(page.locator("nav a.active")).to_be_in_viewport()
    # The page itself does not scroll sideways: the table does, in its own box.
    assert page.evaluate("document.documentElement.scrollWidth") <= 390
    page.locator("#workers").locator("xpath=..").evaluate("box => box.scrollLeft = 1000")
    expect(key).to_be_in_viewport()  # the worker id stays while the rest scrolls
    web.screenshot("workers-390")

    expiring.get_by_role("link", name=public_run_id(late.id)).click()
    expect(page).to_have_url(re.compile(rf"/runs/{public_run_id(late.id)}$"))
    expect(page.locator("h1").first).to_be_visible()
    assert web.console_errors == []
