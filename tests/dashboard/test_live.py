"""Live updates: the fingerprint notices every kind of change, the socket admits only signed-in
users on live pages, and what it sends is the page's own region, filtered by the user's teams."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from urllib.parse import quote

import pytest
from asgiref.sync import sync_to_async
from asgiref.testing import ApplicationCommunicator
from django.db import connections
from django.test import Client

from apps.audit.models import AuditEvent
from apps.audit.record import Actor
from apps.dashboard import live
from apps.jobs import services
from apps.runs import store
from apps.runs.models import Run
from tests.api.test_throttling import REDIS_URL, in_a_process_with_redis
from tests.conftest import add_ready_runs, flushed_redis
from tests.dashboard.conftest import failed_runs, live_scope

pytestmark = pytest.mark.django_db(transaction=True)


def test_the_fingerprint_changes_on_insert_lease_end_and_audited_change(job_a):
    seen = {live.fingerprint()}

    def changed() -> bool:
        current = live.fingerprint()
        fresh = current not in seen
        seen.add(current)
        return fresh

    (run_pk,) = add_ready_runs(job_a, 1)
    assert changed()  # inserted
    (lease,) = store.claim(queues=["billing"], max_runs=1, worker_id="w", lease_seconds=60)
    assert changed()  # leased
    store.complete([(lease.id, lease.fencing_token, None)], team_ids=[job_a.team_id])
    assert changed()  # lease ended
    assert not changed()  # nothing happened
    services.set_paused(job_a, True, Actor.cli("test"))
    assert changed()  # audited change
    assert Run.objects.get(pk=run_pk).state == "succeeded"


def test_only_live_dashboard_pages_are_accepted():
    assert live.live_path("/failures?team=team-a") == "/failures?team=team-a"
    assert live.live_path("/runs/run_1") == "/runs/run_1"
    for bad in (
        "/audit",
        "/teams/team-a",
        "/api/v1/runs",
        "https://evil.example/failures",
        "",
        "x",
    ):
        assert live.live_path(bad) is None, bad


def test_a_render_stops_when_the_session_ends_not_when_the_socket_does(operator_a, job_a):
    failed_runs(job_a)
    client = Client()
    scope = live_scope(operator_a, client)
    assert live.render(scope, "/failures")
    client.post("/accounts/logout/")  # the session ends; the socket's scope still names the user
    assert live.render(scope, "/failures") is None


def test_a_socket_on_another_teams_page_is_refused_once_and_audited_once(operator_a, job_b):
    from scheduler_site.asgi import application

    (theirs,) = failed_runs(job_b, prefix="b")
    client = Client()
    client.force_login(operator_a)
    cookie = f"sessionid={client.cookies['sessionid'].value}".encode()

    async def scenario() -> dict:
        socket = _socket(application, [(b"cookie", cookie)], f"/runs/{theirs.run_id}")
        await socket.send_input({"type": "websocket.connect"})
        answer = await socket.receive_output(timeout=5)
        await sync_to_async(connections.close_all)()
        return answer

    answer = in_own_thread(scenario)
    assert (answer["type"], answer["code"]) == ("websocket.close", 4400)
    denied = AuditEvent.objects.filter(action="access.denied", target=theirs.run_id)
    assert denied.count() == 1
    # A re-render of such a page (were a socket open on it) records nothing more.
    scope = live_scope(operator_a)
    with pytest.raises(live.PageGone):
        live.render(scope, f"/runs/{theirs.run_id}")
    assert denied.count() == 1


def test_a_render_is_the_users_own_view_of_the_region(operator_a, job_a, job_b):
    (mine,) = failed_runs(job_a, prefix="a")
    (theirs,) = failed_runs(job_b, prefix="b")
    html = live.render(live_scope(operator_a), "/failures")
    assert html.lstrip().startswith('<div id="results">')
    assert mine.run_id in html and theirs.run_id not in html
    assert 'name="csrfmiddlewaretoken"' in html
    # A page further down the list is not live: new rows belong on the first page.
    assert live.render(live_scope(operator_a), f"/failures?cursor={mine.run_id}").strip() == ""


def in_own_thread(scenario):
    """Run a coroutine on a fresh event loop in its own thread: the browser tests' Playwright
    keeps an event loop in this one."""
    outcome: dict = {}

    def target() -> None:
        try:
            outcome["value"] = asyncio.run(scenario())
        except BaseException as exc:  # re-raised in the test's thread
            outcome["error"] = exc

    thread = threading.Thread(target=target)
    thread.start()
    thread.join(60)
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def _socket(
    application, headers: list[tuple[bytes, bytes]], page: str = "/failures"
) -> ApplicationCommunicator:
    # channels.testing needs daphne; the ASGI messages are few enough to write by hand.
    return ApplicationCommunicator(
        application,
        {
            "type": "websocket",
            "path": "/ws/live/",
            "query_string": b"path=" + quote(page, safe="").encode(),
            "headers": [(b"origin", b"http://localhost"), (b"host", b"localhost"), *headers],
            "subprotocols": [],
        },
    )


def test_a_signed_out_socket_is_closed_and_a_signed_in_one_receives_changes(operator_a, job_a):
    from scheduler_site.asgi import application

    client = Client()
    client.force_login(operator_a)
    cookie = f"sessionid={client.cookies['sessionid'].value}".encode()

    async def scenario() -> tuple[dict, dict, dict]:
        anonymous = _socket(application, [])
        await anonymous.send_input({"type": "websocket.connect"})
        refused = await anonymous.receive_output(timeout=5)

        socket = _socket(application, [(b"cookie", cookie)])
        await socket.send_input({"type": "websocket.connect"})
        accepted = await socket.receive_output(timeout=5)
        await asyncio.sleep(0.5)
        (run,) = await sync_to_async(failed_runs)(job_a)
        # The first poll after the socket opens may send the region as it was; then the change.
        for _ in range(3):
            message = await socket.receive_output(timeout=10)
            if f'id="run-row-{run.pk}"' in message.get("text", ""):
                break
        await socket.send_input({"type": "websocket.disconnect", "code": 1000})
        await socket.wait(timeout=5)
        # This loop's thread-sensitive calls shared one thread; close its database connection.
        await sync_to_async(connections.close_all)()
        return refused, accepted, message

    refused, accepted, message = in_own_thread(scenario)
    assert (refused["type"], refused["code"]) == ("websocket.close", 4401)
    assert accepted["type"] == "websocket.accept"
    run = Run.objects.get()
    assert message["type"] == "websocket.send"
    assert f'id="run-row-{run.pk}"' in message["text"] and "dead" in message["text"]


def test_a_live_page_with_a_refused_filter_still_updates(operator_a, job_a):
    # The page warns that it shows the default window; the socket's render has no messages
    # to add the warning to, and answered 500 on every reconnect.
    html = live.render(live_scope(operator_a), "/workers?minutes=0")
    assert html is not None and "<html" not in html


def test_a_request_cannot_ask_for_a_partial_its_page_does_not_have(operator_a, job_a):
    (run,) = failed_runs(job_a)
    client = Client()
    client.force_login(operator_a)
    pages = [
        "/",
        f"/runs/{run.run_id}",
        f"/jobs/{job_a.name}",
        f"/jobs/{job_a.name}/edit",
        "/jobs/new",
        "/teams",
        f"/teams/{job_a.team.slug}",
    ]
    for path in pages:
        for headers in (
            {"HTTP_HX_REQUEST": "true", "HTTP_HX_TARGET": "page"},  # none of these has one
            # The socket's renders are marked on the request object, not by a header.
            {"HTTP_HX_REQUEST": "true", "HTTP_X_DASHBOARD_LIVE": "1"},
        ):
            answer = client.get(path, **headers)
            assert answer.status_code in (200, 403), (path, headers, answer.status_code)
            if answer.status_code == 200:
                assert "<html" in answer.content.decode(), (path, headers)
    for path in ("/audit", "/alerts"):  # pages without live updates
        answer = client.get(path, HTTP_X_DASHBOARD_LIVE="1")
        assert answer.status_code == 200 and "<html" in answer.content.decode(), path
    # A page that names its regions still answers the one asked for, alone.
    region = client.get("/failures", HTTP_HX_REQUEST="true", HTTP_HX_TARGET="results")
    assert region.status_code == 200 and "<html" not in region.content.decode()


LAYERS = "import json; from django.conf import settings; print(json.dumps(settings.CHANNEL_LAYERS))"


@pytest.mark.django_db(transaction=False)
def test_an_idle_socket_waits_on_redis_past_its_blocking_pop():
    """The layer REDIS_URL configures, waiting for a message that does not come: past one
    blocking pop (5 s) it keeps waiting. Under redis-py's default read timeout (5 s) the
    wait raised redis's TimeoutError, and every idle page's socket was closed with it."""
    from channels_redis.core import RedisChannelLayer

    layer_settings = json.loads(in_a_process_with_redis(LAYERS))["default"]
    assert layer_settings["BACKEND"] == "channels_redis.core.RedisChannelLayer"

    async def wait() -> None:
        layer = RedisChannelLayer(**layer_settings["CONFIG"])
        try:
            channel = await layer.new_channel()
            with pytest.raises(TimeoutError):  # asyncio's: nothing came, nothing failed
                await asyncio.wait_for(layer.receive(channel), RedisChannelLayer.brpop_timeout + 2)
        finally:
            await layer.close_pools()

    with flushed_redis(REDIS_URL):
        in_own_thread(wait)


def test_a_region_that_has_not_changed_is_not_sent_again(operator_a, job_a):
    """Every change anywhere re-renders an open page's regions: one that had not changed was
    sent and swapped in again at each, closing a run's unfolded stack trace and moving the
    reader's place (47 identical messages in 30 s on a dead run's page)."""
    from scheduler_site.asgi import application

    (run,) = failed_runs(job_a)
    client = Client()
    client.force_login(operator_a)
    cookie = f"sessionid={client.cookies['sessionid'].value}".encode()
    sent: list[str] = []

    async def scenario() -> bool:
        socket = _socket(application, [(b"cookie", cookie)])
        await socket.send_input({"type": "websocket.connect"})
        assert (await socket.receive_output(timeout=5))["type"] == "websocket.accept"
        # Changes the failures list does not show: ready runs of the job.
        for round_ in range(3):
            await sync_to_async(add_ready_runs)(job_a, 1, prefix=f"quiet{round_}-")
            await asyncio.sleep(1.5)
        while not await socket.receive_nothing(timeout=1):
            sent.append((await socket.receive_output(timeout=1)).get("text", ""))
        await socket.send_input({"type": "websocket.disconnect", "code": 1000})
        await socket.wait(timeout=5)
        await sync_to_async(connections.close_all)()
        return True

    assert in_own_thread(scenario)
    # The first render after the socket opened may be sent (the page may be older); no other.
    assert len(sent) <= 1, len(sent)


def test_a_page_that_held_its_updates_is_sent_its_regions_again(operator_a, job_a):
    """A page holds the updates that arrive while an action is on its way (dashboard.js), then
    asks for its regions again: they are sent even though they were sent before, at most once
    a second; anything else the page sends is ignored."""
    from scheduler_site.asgi import application

    (run,) = failed_runs(job_a)
    client = Client()
    client.force_login(operator_a)
    cookie = f"sessionid={client.cookies['sessionid'].value}".encode()
    row = f'id="run-row-{run.pk}"'

    async def scenario() -> tuple[bool, list[tuple[str, float]]]:
        socket = _socket(application, [(b"cookie", cookie)])
        await socket.send_input({"type": "websocket.connect"})
        assert (await socket.receive_output(timeout=5))["type"] == "websocket.accept"
        while not await socket.receive_nothing(timeout=2.5):  # the first render may come
            await socket.receive_output(timeout=1)
        await socket.send_input({"type": "websocket.receive", "text": "hello"})
        ignored = await socket.receive_nothing(timeout=1.5)
        answers = []
        for _ in range(2):
            await socket.send_input({"type": "websocket.receive", "text": '{"again":true}'})
            answers.append(((await socket.receive_output(timeout=5)).get("text", ""),
                            time.monotonic()))  # fmt: skip
        await socket.send_input({"type": "websocket.disconnect", "code": 1000})
        await socket.wait(timeout=5)
        await sync_to_async(connections.close_all)()
        return ignored, answers

    ignored, answers = in_own_thread(scenario)
    assert ignored
    assert all(row in text for text, _ in answers), answers
    # The second ask came as soon as the first answer did: its render waited for the second
    # to end (a second less the first render's time).
    assert answers[1][1] - answers[0][1] >= 0.5, answers


def test_a_socket_whose_run_is_deleted_says_so_not_signed_out(operator_a, job_a):
    """The run a page shows is deleted (retention) while it is open: the socket closes with the
    code the page shows as "updates stopped", not the signed-out one it used (4401)."""
    from scheduler_site.asgi import application

    (run,) = failed_runs(job_a)
    client = Client()
    client.force_login(operator_a)
    cookie = f"sessionid={client.cookies['sessionid'].value}".encode()

    async def scenario() -> dict:
        socket = _socket(application, [(b"cookie", cookie)], f"/runs/{run.run_id}")
        await socket.send_input({"type": "websocket.connect"})
        assert (await socket.receive_output(timeout=5))["type"] == "websocket.accept"
        await sync_to_async(Run.objects.filter(pk=run.pk).delete)()
        while (answer := await socket.receive_output(timeout=10))["type"] == "websocket.send":
            pass
        await sync_to_async(connections.close_all)()
        return answer

    answer = in_own_thread(scenario)
    assert (answer["type"], answer["code"]) == ("websocket.close", 4404)


def test_asking_again_while_a_render_is_due_has_that_render_sent():
    """The page asks for its regions again while a render is already due (a change came within
    the page's gap between renders): that render was compared with what was last sent, which
    the page had held back, and not sent when equal."""
    from apps.dashboard.consumers import AGAIN, LiveConsumer

    async def scenario() -> str:
        consumer = LiveConsumer()
        consumer.last_sent = "the regions the page held back"
        consumer.pending = asyncio.get_running_loop().create_future()  # a render is due
        await consumer.receive(text_data=AGAIN)
        consumer.pending.cancel()
        return consumer.last_sent

    assert in_own_thread(scenario) == ""
