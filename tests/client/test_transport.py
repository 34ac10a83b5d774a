"""Retries of the SDK's HTTP layer, against a scripted transport (no server, no database)."""

from __future__ import annotations

from collections.abc import Callable

import httpx
import pytest
from cronlease_client import ApiError
from cronlease_client.transport import Transport, backoff_delay


def scripted(*answers: Callable[[httpx.Request], httpx.Response]) -> tuple[Transport, list]:
    """A Transport whose n-th request gets the n-th answer (the last one repeats)."""
    seen: list[httpx.Request] = []

    def handle(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return answers[min(len(seen), len(answers)) - 1](request)

    transport = Transport(
        "http://scheduler.test/",
        "jst_token",
        attempts=4,
        backoff_base=0.001,
        backoff_cap=0.01,
        http_transport=httpx.MockTransport(handle),
    )
    return transport, seen


def status(code: int, **headers: str) -> Callable[[httpx.Request], httpx.Response]:
    problem = {"type": "about:blank", "title": "x", "status": code, "detail": f"answer {code}"}
    return lambda request: httpx.Response(code, json=problem, headers=headers)


def ok(request: httpx.Request) -> httpx.Response:
    return httpx.Response(200, json={"leases": []})


def refuse_connection(request: httpx.Request) -> httpx.Response:
    raise httpx.ConnectError("connection refused", request=request)


def test_server_errors_and_throttling_are_retried_until_an_answer():
    transport, seen = scripted(status(503), status(500), status(429, **{"Retry-After": "0"}), ok)
    assert transport.post("/api/v1/leases", {"queues": ["q"]}) == {"leases": []}
    assert len(seen) == 4
    assert seen[0].headers["Authorization"] == "Bearer jst_token"
    assert seen[0].url == "http://scheduler.test/api/v1/leases"


def test_network_errors_are_retried():
    transport, seen = scripted(refuse_connection, refuse_connection, ok)
    assert transport.post("/api/v1/heartbeats", {"leases": []}) == {"leases": []}
    assert len(seen) == 3


def test_retries_are_bounded():
    transport, seen = scripted(status(502))
    with pytest.raises(ApiError) as caught:
        transport.post("/api/v1/results", {"results": []})
    assert caught.value.status == 502
    assert caught.value.transient
    assert len(seen) == 4


@pytest.mark.parametrize("code", [400, 401, 403, 404, 409])
def test_client_errors_are_not_retried(code):
    transport, seen = scripted(status(code), ok)
    with pytest.raises(ApiError) as caught:
        transport.post("/api/v1/runs/run_1/complete", {"fencingToken": 1})
    assert (caught.value.status, caught.value.detail) == (code, f"answer {code}")
    assert not caught.value.transient
    assert len(seen) == 1


def test_a_cancelled_transport_stops_retrying():
    transport, seen = scripted(refuse_connection)
    transport.cancel.set()
    with pytest.raises(ApiError) as caught:
        transport.post("/api/v1/leases", {})
    assert caught.value.status is None
    assert len(seen) == 1


def test_backoff_grows_and_is_capped():
    assert 0.05 <= backoff_delay(1, base=0.1, cap=5) <= 0.1
    assert 0.2 <= backoff_delay(3, base=0.1, cap=5) <= 0.4
    assert 2.5 <= backoff_delay(50, base=0.1, cap=5) <= 5


@pytest.mark.parametrize("fast", [True, False], ids=["orjson", "stdlib"])
def test_bodies_go_out_as_json_and_answers_come_back_decoded(monkeypatch, fast):
    from cronlease_client import transport as module

    if not fast:
        monkeypatch.setattr(module, "orjson", None)
    else:
        assert module.orjson is not None  # installed with the project
    body = {"results": [{"runId": "run_1", "result": {"n": 2**70, "text": "é"}}]}
    received = []

    def echo(request: httpx.Request) -> httpx.Response:
        received.append(request)
        return httpx.Response(200, content=request.content)

    http, _ = scripted(echo)
    assert http.post("/api/v1/results", body) == body
    assert received[0].headers["content-type"] == "application/json"
    # A body that is not JSON is an error of the answer, not a crash of the worker.
    http, _ = scripted(lambda request: httpx.Response(200, content=b"<html>"))
    with pytest.raises(ApiError, match="not JSON"):
        http.post("/api/v1/results", body)
