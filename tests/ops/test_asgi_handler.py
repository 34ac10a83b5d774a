"""The web process's ASGI handler: one thread hop per request, on threads kept between requests."""

from __future__ import annotations

import asyncio
import os
import threading

import httpx
import pytest
from django.core import signals
from django.db import connections

POOL_BEFORE = os.environ.get("SCHEDULER_DB_POOL")

from scheduler_site.asgi import RequestThreads, SyncChainASGIHandler, application  # noqa: E402


def test_importing_the_application_here_does_not_turn_the_pool_on_for_child_processes():
    # Settings were loaded before the import: setting SCHEDULER_DB_POOL now would only reach the
    # processes this one starts (a scheduler daemon in another test took it and failed).
    assert os.environ.get("SCHEDULER_DB_POOL") == POOL_BEFORE


@pytest.fixture
def seen_threads():
    """The thread each request_started and request_finished signal ran on, in order."""
    seen: list[tuple[str, int]] = []

    def started(**kwargs):
        seen.append(("started", threading.get_ident()))

    def finished(**kwargs):
        seen.append(("finished", threading.get_ident()))

    signals.request_started.connect(started)
    signals.request_finished.connect(finished)
    yield seen
    signals.request_started.disconnect(started)
    signals.request_finished.disconnect(finished)


def get(paths: list[str]) -> list[httpx.Response]:
    """GET the paths at once through the ASGI application, on an event loop of a new thread (the
    browser tests' Playwright keeps a loop running in this one)."""

    async def run() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=application)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as client:
            return list(await asyncio.gather(*(client.get(path) for path in paths)))

    answers: list[httpx.Response] = []
    runner = threading.Thread(target=lambda: answers.extend(asyncio.run(run())))
    runner.start()
    runner.join(30)
    assert len(answers) == len(paths)
    return answers


def test_a_request_runs_its_signals_on_one_thread_and_the_thread_serves_the_next(seen_threads):
    for _ in range(3):
        (answer,) = get(["/healthz"])
        assert answer.status_code == 200
        assert answer.json() == {"status": "ok"}
    assert [kind for kind, _ in seen_threads] == ["started", "finished"] * 3
    threads = {ident for _, ident in seen_threads}
    # Started and finished (closing the response hands the connection back) on the same
    # thread, a request thread; and the same thread for the next request.
    assert len(threads) == 1
    assert threading.get_ident() not in threads


def test_overlapping_requests_get_threads_of_their_own():
    before = len(SyncChainASGIHandler.threads._idle)
    answers = get(["/healthz"] * 6)
    assert [answer.status_code for answer in answers] == [200] * 6
    # Every executor was taken back, and no more were made than were in flight at once.
    idle = SyncChainASGIHandler.threads._idle
    assert 1 <= len(idle) <= max(before, 6)
    assert len({id(executor) for executor in idle}) == len(idle)


def test_a_page_that_is_not_found_still_answers(seen_threads):
    (answer,) = get(["/api/v1/no-such-thing"])
    assert answer.status_code in (401, 404)
    assert answer.headers["content-type"].startswith("application/problem+json")
    assert [kind for kind, _ in seen_threads] == ["started", "finished"]


# --- request bodies, over real HTTP ----------------------------------------------------------


def chunked(data: bytes, size: int = 7):
    """A body sent in chunks, with no Content-Length (Transfer-Encoding: chunked)."""
    for start in range(0, len(data), size):
        yield data[start : start + size]


@pytest.mark.django_db(transaction=True)
def test_a_chunked_body_is_read_like_any_other(asgi_server):
    from apps.runs.models import Run
    from apps.teams.models import ApiToken, Team
    from tests.conftest import make_definition

    team = Team.objects.create(slug="chunks", name="Chunks")
    token = ApiToken.issue(team, ["manage"])[1]
    make_definition(team, "chunk.job", queue="chunks")
    headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
    body = b'{"idempotencyKey": "order-991", "payload": {"v": 2}}'
    url = f"{asgi_server.url}/api/v1/jobs/chunk.job/runs"
    first = httpx.post(url, content=chunked(body), headers=headers)
    again = httpx.post(url, content=chunked(body), headers=headers)
    assert first.request.headers.get("transfer-encoding") == "chunked"
    assert "content-length" not in first.request.headers
    assert (first.status_code, again.status_code) == (201, 200), first.text
    assert first.json()["idempotencyKey"] == "order-991"
    assert first.json()["payload"] == {"v": 2}
    assert Run.objects.count() == 1


@pytest.mark.django_db(transaction=True)
def test_a_body_without_a_content_type_is_415_saying_so(asgi_server):
    """Under uvicorn such a body has no type at all (Django's test server says text/plain)."""
    from apps.teams.models import ApiToken, Team

    token = ApiToken.issue(Team.objects.create(slug="bare", name="Bare"), ["manage"])[1]
    answer = httpx.post(
        f"{asgi_server.url}/api/v1/runs",
        content=b'{"runs": []}',
        headers={"Authorization": f"Bearer {token}"},
    )
    assert answer.status_code == 415, answer.text
    assert "The body has no Content-Type" in answer.json()["detail"]


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("path", ["jobs/a%2Fb", "queues/a%2fb/pause", "runs/run_1%2F2"])
def test_a_name_with_an_encoded_slash_is_bad_input_not_a_missing_resource(asgi_server, path):
    """The server decodes %2F before routing: the name became two segments and a 404, where
    every other bad name is a 400."""
    from apps.teams.models import ApiToken, Team

    token = ApiToken.issue(Team.objects.create(slug="slash", name="Slash"), ["manage"])[1]
    headers = {"Authorization": f"Bearer {token}"}
    answer = httpx.get(f"{asgi_server.url}/api/v1/{path}", headers=headers)
    assert answer.status_code == 400, answer.text
    assert answer.headers["Content-Type"] == "application/problem+json"
    assert "encoded slash" in answer.json()["errors"]["path"][0]
    # A path that names nothing is still a 404.
    assert httpx.get(f"{asgi_server.url}/api/v1/jobs/a/b", headers=headers).status_code == 404


@pytest.mark.django_db(transaction=True)
def test_a_body_over_the_limit_is_refused_before_it_is_stored(asgi_server, settings):
    from apps.runs.models import Run

    limit = settings.DATA_UPLOAD_MAX_MEMORY_SIZE
    big = b'{"runs": [{"job": "a.job", "payload": "' + b"x" * limit + b'"}]}'
    url = f"{asgi_server.url}/api/v1/runs"
    headers = {"Authorization": "Bearer nobody", "Content-Type": "application/json"}
    for content in (big, chunked(big, 65536)):
        answer = httpx.post(url, content=content, headers=headers, timeout=30)
        assert answer.status_code == 413, answer.text
        assert answer.headers["content-type"].startswith("application/problem+json")
        assert answer.json()["type"].endswith("/payload-too-large")
    assert not Run.objects.exists()
    # Under the limit, the same request is read and answered (here: the token is unknown).
    assert httpx.post(url, content=b'{"runs": []}', headers=headers).status_code == 401


# --- a worker that hangs up after its claim committed ----------------------------------------


@pytest.mark.django_db(transaction=True)
def test_runs_leased_to_a_worker_that_hung_up_before_its_answer_went_out_are_given_back(
    monkeypatch,
):
    import json
    import time

    from apps.runs import leasing
    from apps.runs.models import Run
    from apps.teams.models import ApiToken, Team
    from tests.conftest import add_ready_runs, make_definition

    team = Team.objects.create(slug="hangup", name="Hangup")
    token = ApiToken.issue(team, ["worker"])[1]
    pks = add_ready_runs(make_definition(team, "hang.job", queue="hang"), 2)
    committed = threading.Event()
    finish = leasing._finish

    def finish_then_dawdle(held, error):
        lost = finish(held, error)
        if error is None:
            committed.set()
            time.sleep(0.5)  # the worker hangs up meanwhile, before the answer is sent
        return lost

    monkeypatch.setattr(leasing, "_finish", finish_then_dawdle)
    body = json.dumps({"queues": ["hang"], "max": 2, "workerId": "w-gone"}).encode()
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/api/v1/leases",
        "raw_path": b"/api/v1/leases",
        "query_string": b"",
        "root_path": "",
        "headers": [
            (b"host", b"127.0.0.1"),
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"authorization", f"Bearer {token}".encode()),
        ],
        "client": ("127.0.0.1", 40000),
        "server": ("127.0.0.1", 80),
    }
    sent: list[dict] = []

    async def call() -> None:
        messages = [{"type": "http.request", "body": body, "more_body": False}]

        async def receive() -> dict:
            if messages:
                return messages.pop()
            await asyncio.get_running_loop().run_in_executor(None, committed.wait, 10)
            return {"type": "http.disconnect"}

        async def send(message: dict) -> None:
            sent.append(message)

        await application(scope, receive, send)

    # Threads of this test's own: the database connections they open are closed with them, not
    # left to the next test's requests, which may not touch the database.
    threads = RequestThreads()
    monkeypatch.setattr(SyncChainASGIHandler, "threads", threads)
    runner = threading.Thread(target=lambda: asyncio.run(call()))
    runner.start()
    runner.join(30)
    for executor in threads._idle:
        executor.submit(connections.close_all).result()
        executor.shutdown()
    assert committed.is_set() and not runner.is_alive()
    assert sent == []  # nothing was answered: the worker had gone
    runs = list(Run.objects.filter(pk__in=pks))
    # Failed as retryable under their fencing tokens, each its first attempt: not left leased
    # to a worker that never heard of them until their lease ran out.
    assert {(run.state, run.attempt) for run in runs} == {("retrying", 1)}
    assert {run.last_error["type"] for run in runs} == {"WorkerGone"}
