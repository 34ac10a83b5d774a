"""The worker's HTTP layer (retries, its kept connection, JSON both ways), against a scripted
HTTP server on a real socket (no database)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest
from cronlease_client import ApiError
from cronlease_client import transport as transport_module
from cronlease_client.transport import Transport, backoff_delay, batch_items, lease_answer

from tests.client.scripted import HANG_UP, Request, Response, ScriptedServer, json_response
from tests.waiting import wait_for

Script = Callable[[Request], Response]


@pytest.fixture
def scripted(serve) -> Callable[..., tuple[Transport, list[Request]]]:
    """A Transport whose n-th request gets the n-th answer (the last one repeats)."""

    def make(*answers: Script, prefix: str = "") -> tuple[Transport, list[Request]]:
        count = [0]

        def handle(request: Request) -> Response:
            count[0] += 1
            return answers[min(count[0], len(answers)) - 1](request)

        server = serve(handle)
        transport = Transport(
            server.url + prefix + "/", "jst_token", attempts=4, backoff_base=0.001, backoff_cap=0.01
        )
        return transport, server.seen

    return make


def status(code: int, **headers: str) -> Script:
    problem = {"type": "about:blank", "title": "x", "status": code, "detail": f"answer {code}"}
    return lambda request: json_response(code, problem, **headers)


def ok(request: Request) -> Response:
    return json_response(200, {"leases": []})


def hang_up(request: Request) -> Response:
    return HANG_UP


def test_server_errors_and_throttling_are_retried_until_an_answer(scripted):
    transport, seen = scripted(status(503), status(500), status(429, **{"Retry-After": "0"}), ok)
    assert transport.post("/api/v1/leases", {"queues": ["q"]}) == {"leases": []}
    assert len(seen) == 4
    assert seen[0].headers["authorization"] == "Bearer jst_token"
    assert (seen[0].method, seen[0].path) == ("POST", "/api/v1/leases")
    assert seen[0].headers["user-agent"].startswith("cronlease-client/")


def test_network_errors_are_retried(scripted):
    transport, seen = scripted(hang_up, hang_up, ok)
    assert transport.post("/api/v1/heartbeats", {"leases": []}) == {"leases": []}
    assert len(seen) == 3
    # Each failure closed the connection: every attempt went out on a new one.
    assert [request.connection for request in seen] == [0, 1, 2]


def test_a_connection_that_could_not_be_made_is_a_network_error():
    transport = Transport("http://127.0.0.1:9/", "jst_token", attempts=2, backoff_base=0.001)
    with pytest.raises(ApiError) as caught:
        transport.post("/api/v1/leases", {})
    assert caught.value.status is None
    assert caught.value.transient


def test_retries_are_bounded(scripted):
    transport, seen = scripted(status(502))
    with pytest.raises(ApiError) as caught:
        transport.post("/api/v1/results", {"results": []})
    assert caught.value.status == 502
    assert caught.value.transient
    assert len(seen) == 4


@pytest.mark.parametrize("code", [400, 401, 403, 404, 409])
def test_client_errors_are_not_retried(scripted, code):
    transport, seen = scripted(status(code), ok)
    with pytest.raises(ApiError) as caught:
        transport.post("/api/v1/runs/run_1/complete", {"fencingToken": 1})
    assert (caught.value.status, caught.value.detail) == (code, f"answer {code}")
    assert not caught.value.transient
    assert len(seen) == 1


def test_an_error_answer_that_is_not_json_keeps_its_text(scripted):
    transport, _ = scripted(lambda request: Response(404, b"no such page"))
    with pytest.raises(ApiError) as caught:
        transport.post("/api/v1/leases", {})
    assert (caught.value.status, caught.value.detail) == (404, "no such page")


def test_a_cancelled_transport_stops_retrying(scripted):
    transport, seen = scripted(hang_up)
    transport.cancel.set()
    with pytest.raises(ApiError) as caught:
        transport.post("/api/v1/leases", {})
    assert caught.value.status is None
    assert len(seen) == 1


def test_requests_share_one_kept_connection(scripted):
    transport, seen = scripted(ok)
    for _ in range(3):
        transport.post("/api/v1/leases", {})
    transport.get("/api/v1/runs", {"state": ["ready", "leased"], "limit": 2})
    assert {request.connection for request in seen} == {0}
    assert seen[-1].path == "/api/v1/runs?state=ready&state=leased&limit=2"
    assert "content-type" not in seen[-1].headers


@pytest.mark.parametrize("said", [True, False], ids=["Connection: close", "closed silently"])
def test_a_connection_the_server_closed_is_replaced_without_a_retry(scripted, said):
    def close(request: Request) -> Response:
        if said:
            return json_response(200, {"leases": []}, Connection="close")
        return Response(200, b'{"leases": []}', close_after=True)

    transport, seen = scripted(close)
    transport.attempts = 1  # no retry to fall back on: the closed connection must not be used
    for _ in range(3):
        assert transport.post("/api/v1/leases", {}) == {"leases": []}
        if not said:
            time.sleep(0.05)  # the server's close reaches this side before the next request
    assert [request.connection for request in seen] == [0, 1, 2]


def test_a_base_url_with_a_path_prefixes_every_request(scripted):
    transport, seen = scripted(ok, prefix="/scheduler")
    transport.post("/api/v1/leases", {})
    assert seen[0].path == "/scheduler/api/v1/leases"


def test_only_http_and_https_urls_are_taken():
    with pytest.raises(ValueError, match="http"):
        Transport("ftp://scheduler.test", "jst_token")


def test_backoff_grows_and_is_capped():
    assert 0.05 <= backoff_delay(1, base=0.1, cap=5) <= 0.1
    assert 0.2 <= backoff_delay(3, base=0.1, cap=5) <= 0.4
    assert 2.5 <= backoff_delay(50, base=0.1, cap=5) <= 5


@pytest.mark.parametrize("fast", [True, False], ids=["orjson", "stdlib"])
def test_bodies_go_out_as_json_and_answers_come_back_decoded(scripted, monkeypatch, fast):
    from cronlease_client import transport as module

    if not fast:
        monkeypatch.setattr(module, "orjson", None)
    else:
        assert module.orjson is not None  # installed with the project
    body = {"results": [{"runId": "run_1", "result": {"n": 2**70, "text": "é"}}]}

    http, seen = scripted(lambda request: Response(200, request.content))
    assert http.post("/api/v1/results", body) == body
    assert seen[0].headers["content-type"] == "application/json"
    # A body that is not JSON is an error of the answer, not a crash of the worker.
    http, _ = scripted(lambda request: Response(200, b"<html>"))
    with pytest.raises(ApiError, match="not JSON") as caught:
        http.post("/api/v1/results", body)
    assert caught.value.transient


def answer(status: int, content: bytes) -> Script:
    return lambda request: Response(status, content, {"Content-Type": "text/html"})


@pytest.mark.parametrize(
    "garbled",
    [b"<html><body>Bad gateway</body></html>", b'{"results": [{"runId": "run_1", "sta', b"null"],
    ids=["html", "truncated", "null"],
)
def test_a_success_answer_that_is_not_json_is_retried_as_a_server_error(scripted, garbled):
    good = {"results": [{"runId": "run_1", "status": 200, "state": "succeeded"}]}
    transport, seen = scripted(answer(200, garbled), lambda request: json_response(200, good))
    items = transport.post("/api/v1/results", {"results": []}, parse=batch_items("results"))
    assert items == good["results"]
    assert len(seen) == 2


@pytest.mark.parametrize(
    "wrong",
    [
        {"leases": "nope"},
        {"leases": [{"bogus": 1}]},
        {"leases": [{"runId": "run_1", "job": "a.b", "attempt": "1"}]},
        {"leases": [], "results": [None]},
        {},
        [],
    ],
)
def test_a_lease_answer_of_the_wrong_shape_is_retried_then_raised_as_transient(scripted, wrong):
    transport, seen = scripted(lambda request: json_response(200, wrong))
    with pytest.raises(ApiError, match="not of its shape") as caught:
        transport.post("/api/v1/leases", {}, parse=lease_answer)
    assert caught.value.status == 200
    assert caught.value.transient
    assert len(seen) == 4


def test_interrupt_cuts_off_a_server_that_ignores_the_hangup_and_refuses_the_next(
    serve, monkeypatch
):
    """The stop hangs up (the scheduler then closes at once); a server that neither answers nor
    closes is cut off after HANGUP_SECONDS, and no request is sent after the stop."""
    monkeypatch.setattr(transport_module, "HANGUP_SECONDS", 0.3)
    released = threading.Event()

    def long_poll(request: Request) -> Response:
        released.wait(30)
        return json_response(200, {"leases": []})

    server = serve(long_poll)
    transport = Transport(server.url, "jst_token", attempts=5, backoff_base=0.001)
    failed: list[ApiError] = []

    def lease() -> None:
        try:
            transport.post("/api/v1/leases", {}, timeout=30)
        except ApiError as exc:
            failed.append(exc)

    waiting = threading.Thread(target=lease)
    waiting.start()
    try:
        wait_for(lambda: server.seen, what="the long poll to reach the server")
        started = time.monotonic()
        transport.interrupt()
        waiting.join(5)
        assert not waiting.is_alive()
        assert 0.3 <= time.monotonic() - started < 2
        assert [exc.status for exc in failed] == [None]  # a network error, not retried
        with pytest.raises(ApiError):
            transport.post("/api/v1/leases", {})
        assert len(server.seen) == 1
    finally:
        released.set()
        waiting.join(5)


LEASES = {"leases": [{"runId": "run_1", "fencingToken": 7}]}


def interrupted_between_headers_and_body(
    transport: Transport, server: ScriptedServer, then: Callable[[], Any] = lambda: None
) -> tuple[list[Any], list[ApiError]]:
    """POST a lease request, interrupt the transport once the server has sent the answer's
    headers, then call `then`; the answers and errors the request ended with."""
    answers: list[Any] = []
    failed: list[ApiError] = []

    def lease() -> None:
        try:
            answers.append(transport.post("/api/v1/leases", {"max": 1}, timeout=10))
        except ApiError as exc:
            failed.append(exc)

    waiting = threading.Thread(target=lease)
    waiting.start()
    assert server.headers_sent.wait(5)
    transport.interrupt()
    then()
    waiting.join(5)
    assert not waiting.is_alive()
    return answers, failed


def test_an_answer_whose_body_is_on_its_way_when_interrupted_is_read_whole(serve):
    """The stop lands between an answer's headers and its body: the body is still read (the
    leases in it are then given back by the worker), not cut off and lost."""
    server = serve(lambda request: replace(json_response(200, LEASES), body_after_hangup=True))
    transport = Transport(server.url, "jst_token", attempts=5, backoff_base=0.001)
    assert interrupted_between_headers_and_body(transport, server) == ([LEASES], [])
    assert server.before_hangup == [b""]  # the server saw the hang-up before sending the body


def test_over_tls_too_an_answer_on_its_way_when_interrupted_is_read_whole(serve, tls):
    """The hang-up shuts the TCP socket's sending half beneath TLS: the TLS socket's own
    shutdown dropped its TLS state, and a body in two reads was cut off at the second."""
    release = threading.Event()
    server = serve(lambda request: replace(json_response(200, LEASES), hold_body=release), tls)
    assert server.url.startswith("https://")
    transport = Transport(server.url, "jst_token", attempts=5, backoff_base=0.001)
    assert interrupted_between_headers_and_body(transport, server, release.set) == ([LEASES], [])
