"""Named people for the dashboard tests, runs in each state, and for the browser tests a headless
Chromium on the live ASGI server (tests/conftest.py `asgi_server`)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from django.contrib.auth import get_user_model
from django.test import Client

from apps.runs import shards, store
from apps.runs.models import Run
from apps.teams.models import Membership, Team
from tests.conftest import REPO, LiveServer, add_ready_runs, claim, make_definition

# Playwright's sync API runs an event loop in this thread; the ORM calls the tests make between
# browser steps are ordinary blocking calls, which Django would otherwise refuse.
os.environ.setdefault("DJANGO_ALLOW_ASYNC_UNSAFE", "true")

SCREENSHOTS = REPO / "test-artifacts" / "screenshots"
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--no-first-run",
]
PASSWORD = "correct horse battery staple"
XSS = "<script>alert(1)</script>"


# --- people --------------------------------------------------------------------------------


def make_user(username: str, team: Team | None = None, role: str | None = None, **flags):
    user = get_user_model().objects.create_user(username, password=PASSWORD, **flags)
    if team is not None and role is not None:
        Membership.objects.create(user=user, team=team, role=role)
    return user


@pytest.fixture
def admin_a(team_a):
    return make_user("alice-admin", team_a, "admin")


@pytest.fixture
def editor_a(team_a):
    return make_user("erin-editor", team_a, "editor")


@pytest.fixture
def operator_a(team_a):
    return make_user("oscar-operator", team_a, "operator")


@pytest.fixture
def viewer_a(team_a):
    return make_user("vera-viewer", team_a, "viewer")


@pytest.fixture
def operator_b(team_b):
    return make_user("bob-operator-b", team_b, "operator")


def client_for(user) -> Client:
    client = Client()
    client.force_login(user)
    return client


# --- runs ----------------------------------------------------------------------------------


def live_scope(user, client: Client | None = None) -> dict:
    """The scope of a live-update socket opened by `user` (signed in through `client`)."""
    client = client or Client()
    client.force_login(user)
    client.get("/failures")  # sets the CSRF cookie
    return {
        "user": user,
        "session": client.session,
        "cookies": {name: morsel.value for name, morsel in client.cookies.items()},
        "headers": [(b"host", b"testserver")],
    }


def failed_runs(
    definition,
    count: int = 1,
    *,
    retryable: bool = False,
    message: str = "boom",
    prefix: str = "f",
    payload=None,
) -> list[Run]:
    """Insert `count` runs, lease them and fail them: dead (default) or retrying."""
    ids = add_ready_runs(definition, count, prefix=prefix)
    alias = shards.alias_of_shard(definition.shard)  # where its runs are
    if payload is not None:
        with shards.using(alias):
            Run.objects.filter(pk__in=ids).update(payload=payload)
    leases = claim(
        queues=[definition.queue],
        max_runs=count,
        worker_id="worker-1/4242",
        lease_seconds=60,
        team_ids=[definition.team_id],
    )
    assert sorted(lease.id for lease in leases) == sorted(ids)
    store.fail(
        [
            (lease.id, lease.fencing_token, {"message": message, "type": "RuntimeError"}, retryable)
            for lease in leases
        ],
        team_ids=[definition.team_id],
    )
    with shards.using(alias):
        return list(Run.objects.filter(pk__in=ids).order_by("pk"))


@pytest.fixture
def job_a(team_a):
    return make_definition(team_a, "billing.export-invoices", queue="billing", retry_max_attempts=1)


@pytest.fixture
def job_b(team_b):
    return make_definition(team_b, "search.reindex", queue="search", retry_max_attempts=1)


# --- live server and browser ---------------------------------------------------------------


@pytest.fixture(scope="session")
def browser():
    from playwright.sync_api import sync_playwright

    if not Path(CHROMIUM).exists():
        pytest.fail(f"{CHROMIUM} is missing: apt-get install -y chromium (.ci/run does this)")
    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield chromium
        chromium.close()


class BrowserPage:
    """A page of a fresh browser context, with what a test needs to check around it."""

    def __init__(self, context, server: LiveServer) -> None:
        self.context = context
        self.server = server
        self.page = context.new_page()
        self.console_errors: list[str] = []
        # htmx's log of a live-update socket's `error` event ("[object Event]"), kept apart: seen
        # twice in a browser test under the whole suite's load, never alone, and a socket that
        # does not come back is caught where it matters (the live dot, `wait_live`).
        self.socket_errors: list[str] = []
        self.dialogs: list[str] = []

        def on_console(message) -> None:
            if message.type != "error":
                return
            url = (message.location or {}).get("url", "")
            if message.text == "[object Event]" and url.endswith("/htmx.min.js"):
                self.socket_errors.append(f"{self.page.url}: {message.text}")
            else:
                self.console_errors.append(message.text)

        self.page.on("console", on_console)
        self.page.on("pageerror", lambda error: self.console_errors.append(str(error)))

        def on_dialog(dialog) -> None:
            self.dialogs.append(dialog.message)
            dialog.accept()

        self.page.on("dialog", on_dialog)

    def goto(self, path: str):
        return self.page.goto(self.server.url + path)

    def sign_in(self, user) -> None:
        """Sign in through a session made in the database (the sign-in form has its own test)."""
        client = Client()
        client.force_login(user)
        cookie = client.cookies["sessionid"]
        self.context.add_cookies(
            [{"name": "sessionid", "value": cookie.value, "url": self.server.url}]
        )

    def wait_live(self) -> None:
        """Wait until the page's live-update socket is open (a locator: the CSP forbids eval)."""
        self.page.locator("body[data-live='open']").wait_for(state="attached", timeout=10_000)

    def screenshot(self, name: str) -> None:
        SCREENSHOTS.mkdir(parents=True, exist_ok=True)
        self.page.screenshot(path=str(SCREENSHOTS / f"{name}.png"), full_page=True)


@pytest.fixture
def web(browser, asgi_server) -> Iterator[BrowserPage]:
    context = browser.new_context(viewport={"width": 1400, "height": 900})
    context.set_default_timeout(10_000)
    yield BrowserPage(context, asgi_server)
    context.close()
