"""The team page's notification channels in a real headless Chromium, at a laptop's width and
a phone's (390 px): a channel created, its secret shown once, a test message delivered to a
local HTTP receiver and logged; a bad form answered beside its fields."""

from __future__ import annotations

import re

import pytest
from playwright.sync_api import expect

from apps.notify.models import Channel

# The receiver and the notification settings of tests/notify (the browser and the server are
# this directory's session fixtures: one Playwright per session).
from tests.notify.conftest import notify_settings, readme_verifier, receiver  # noqa: F401

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]


def no_sideways_scroll(page, width: int) -> None:
    assert page.evaluate("document.documentElement.scrollWidth") <= width


def test_a_channel_is_created_in_the_dashboard_and_a_test_message_delivered(
    web,
    admin_a,
    receiver,  # noqa: F811 (tests/notify's fixture, imported above)
):
    web.sign_in(admin_a)
    page = web.page
    page.set_viewport_size({"width": 1366, "height": 900})
    assert web.goto("/teams/team-a").status == 200
    section = page.locator("#channels")
    expect(section.get_by_role("heading", name="Notification channels")).to_be_visible()
    expect(section.locator("#channel-list")).to_contain_text("No channels")
    page.fill("#id_name", "pager")
    page.select_option("#id_kind", "webhook")
    page.fill("#id_target", receiver.url)
    page.check("#id_events input[value='job.recovered']")
    page.get_by_role("button", name="Add channel").click()

    expect(page.locator("#messages")).to_contain_text("Created the channel pager.")
    secret = page.locator("#new-channel-secret code").inner_text().strip()
    assert secret.startswith("whsec_")
    row = page.locator("tr.channel-row[data-channel='pager']")
    expect(row).to_contain_text("run.dead, job.recovered")
    web.screenshot("channels-1366")
    row.get_by_role("button", name="Send test").click()

    channel = Channel.objects.get()
    expect(page).to_have_url(re.compile(rf"/teams/team-a/channels/{channel.pk}$"))
    expect(page.locator("#messages")).to_contain_text("Test message delivered to pager (200).")
    logged = page.locator("#delivery-log tr.delivery-row")
    expect(logged).to_have_count(1)
    expect(logged.first).to_have_attribute("data-state", "sent")
    (request,) = receiver.requests
    assert readme_verifier()(secret, request.body, request.headers["X-Cronlease-Signature"])
    web.goto("/teams/team-a")
    expect(page.locator("#new-channel-secret")).to_have_count(0)  # shown once

    page.set_viewport_size({"width": 390, "height": 844})
    web.goto(f"/teams/team-a/channels/{channel.pk}")
    expect(logged.first).to_be_visible()
    no_sideways_scroll(page, 390)
    web.screenshot("channel-log-390")
    web.goto("/teams/team-a")
    no_sideways_scroll(page, 390)
    page.fill("#id_name", "pager")
    page.fill("#id_target", "not a url")
    page.get_by_role("button", name="Add channel").click()
    expect(page.locator("#err-target")).to_have_text("A URL has no spaces or control characters.")
    expect(page.locator("#err-name")).to_have_text("The team has a channel of this name.")
    expect(page.locator("#err-target")).to_be_in_viewport()
    no_sideways_scroll(page, 390)
    web.screenshot("channels-390")
    assert Channel.objects.count() == 1
    assert web.console_errors == []
