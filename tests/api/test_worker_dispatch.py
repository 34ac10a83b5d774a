"""The worker endpoints' fast path answers every call exactly as DRF's dispatch does.

A plain JSON POST takes the fast path (apps/api/fastpath.py); the same call with an Accept
header the fast path does not read goes through DRF. Each case is sent both ways and the two
answers compared: status, body, and the headers a client acts on.
"""

from __future__ import annotations

import re
import time

import pytest
import time_machine
from django.core.cache import cache
from rest_framework.views import APIView

from apps.teams.models import ApiToken
from tests.conftest import add_ready_runs, make_definition

pytestmark = pytest.mark.django_db(transaction=True)

FAST = {"Content-Type": "application/json"}
# Same meaning to DRF's negotiation (JSON is the only renderer), not read by the fast path.
DRF = {"Content-Type": "application/json", "Accept": "application/json;q=0.9"}
LEASE = b'{"queues": ["q"], "workerId": "w"}'
ACTED_ON = ("content-type", "www-authenticate", "retry-after", "allow")


@pytest.fixture
def drf_dispatches(monkeypatch) -> list[str]:
    """The paths DRF's own checks ran for: proof of which way a call went."""
    seen: list[str] = []
    initial = APIView.initial

    def counting(view, request, *args, **kwargs):
        seen.append(request.path)
        return initial(view, request, *args, **kwargs)

    monkeypatch.setattr(APIView, "initial", counting)
    return seen


def both_ways(api, path: str, body: bytes, drf_dispatches: list[str], **headers) -> dict:
    fast = api.http.post(path, content=body, headers={**FAST, **headers})
    assert drf_dispatches == [], "a plain JSON POST went through DRF's dispatch"
    slow = api.http.post(path, content=body, headers={**DRF, **headers})
    assert drf_dispatches == [path], "the other call did not go through DRF's dispatch"
    drf_dispatches.clear()
    assert fast.status_code == slow.status_code, (fast.text, slow.text)
    # A throttled answer says its wait in whole seconds: the two calls may straddle a second's
    # edge (57 and 58 s), so its numbers are left out of the comparison.
    same = _waits_left_out if fast.status_code == 429 else (lambda value: value)
    assert same(fast.json()) == same(slow.json())
    for name in ACTED_ON:
        assert same(fast.headers.get(name)) == same(slow.headers.get(name)), name
    return {"status": fast.status_code, "body": fast.json(), "headers": fast.headers}


def _waits_left_out(value):
    if isinstance(value, dict):
        return {key: _waits_left_out(item) for key, item in value.items()}
    return re.sub(r"\d+", "N", value) if isinstance(value, str) else value


@pytest.mark.parametrize(
    ("authorization", "status"),
    [
        (None, 401),
        ("Bearer not-a-token", 401),
        ("Basic dXNlcjpwYXNz", 401),
        ("Bearer", 401),
    ],
)
def test_authentication_failures(api_a, drf_dispatches, authorization, status):
    del api_a.http.headers["Authorization"]
    headers = {"Authorization": authorization} if authorization else {}
    answer = both_ways(api_a, "/api/v1/leases", LEASE, drf_dispatches, **headers)
    assert answer["status"] == status
    assert answer["headers"]["www-authenticate"] == "Bearer"
    assert answer["headers"]["content-type"] == "application/problem+json"


def test_a_token_without_the_worker_scope_is_403(api_a, team_a, drf_dispatches):
    manage_only = ApiToken.issue(team_a, ["manage"])[1]
    answer = both_ways(
        api_a,
        "/api/v1/results",
        b'{"results": []}',
        drf_dispatches,
        Authorization=f"Bearer {manage_only}",
    )
    assert answer["status"] == 403
    assert "'worker' scope" in answer["body"]["detail"]


@pytest.mark.parametrize(
    ("body", "fields"),
    [
        (b'{"queues": ', set()),
        (b"", {"queues", "workerId"}),
        (b"[1, 2]", {"body"}),
        (b'{"queues": "q", "workerId": "w", "max": 0, "colour": 1}', {"queues", "max", "colour"}),
        (b'{"queues": ["q\\u0000"], "workerId": "w"}', {"queues[0]"}),
        (b'{"queues": ["q"], "workerId": "w", "max": 1e400}', set()),
    ],
)
def test_bad_bodies(api_a, drf_dispatches, body, fields):
    answer = both_ways(api_a, "/api/v1/leases", body, drf_dispatches)
    assert answer["status"] == 400
    assert fields <= set(answer["body"].get("errors", {}))


def test_a_body_over_the_limit_is_413(api_a, drf_dispatches, settings):
    settings.DATA_UPLOAD_MAX_MEMORY_SIZE = 1000
    body = b'{"results": [' + b",".join([b'{"runId": "x", "outcome": "succeeded"}'] * 100) + b"]}"
    answer = both_ways(api_a, "/api/v1/results", body, drf_dispatches)
    assert answer["status"] == 413


def test_throttled_calls_are_429_with_retry_after(api_a, drf_dispatches, settings):
    cache.clear()
    settings.SCHEDULER_API_RATES = {"worker": "2/min", "manage": "20/s"}
    assert api_a.http.post("/api/v1/leases", content=LEASE, headers=FAST).status_code == 200
    assert api_a.http.post("/api/v1/leases", content=LEASE, headers=DRF).status_code == 200
    drf_dispatches.clear()
    answer = both_ways(api_a, "/api/v1/leases", LEASE, drf_dispatches)
    assert answer["status"] == 429
    assert int(answer["headers"]["retry-after"]) > 0
    cache.clear()


def test_single_calls_on_unknown_and_stale_runs(api_a, team_a, drf_dispatches):
    definition = make_definition(team_a, "parity.job", queue="q")
    add_ready_runs(definition, 1)
    (lease,) = api_a.lease(["q"], max_runs=1)
    stale = f'{{"fencingToken": {lease["fencingToken"] + 1}}}'.encode()
    for path, status in [
        ("/api/v1/runs/run_nope/complete", 404),
        ("/api/v1/runs/run_nope/heartbeat", 404),
        (f"/api/v1/runs/{lease['runId']}/complete", 409),
        (f"/api/v1/runs/{lease['runId']}/fail", 409),
    ]:
        assert both_ways(api_a, path, stale, drf_dispatches)["status"] == status, path


def test_answers_agree_on_success(api_a, team_a, drf_dispatches):
    definition = make_definition(team_a, "parity.ok", queue="q")
    add_ready_runs(definition, 4)
    fast = api_a.http.post(
        "/api/v1/leases", content=b'{"queues": ["q"], "workerId": "w", "max": 2}', headers=FAST
    )
    slow = api_a.http.post(
        "/api/v1/leases", content=b'{"queues": ["q"], "workerId": "w", "max": 2}', headers=DRF
    )
    assert drf_dispatches == ["/api/v1/leases"]
    assert fast.status_code == slow.status_code == 200
    assert fast.headers["allow"] == slow.headers["allow"] == "POST, OPTIONS"
    assert fast.headers["content-type"] == slow.headers["content-type"] == "application/json"
    one, other = fast.json()["leases"], slow.json()["leases"]
    assert len(one) == len(other) == 2
    assert [sorted(lease) for lease in one] == [sorted(lease) for lease in other]
    assert {lease["runId"] for lease in one}.isdisjoint(lease["runId"] for lease in other)


def test_other_methods_and_types_are_left_to_drf(api_a, drf_dispatches):
    assert api_a.http.get("/api/v1/leases").status_code == 405
    assert (
        api_a.http.post(
            "/api/v1/leases", content=LEASE, headers={"Content-Type": "text/plain"}
        ).status_code
        == 415
    )
    assert (
        api_a.http.post(
            "/api/v1/leases", content=LEASE, headers={**FAST, "Accept": "text/html"}
        ).status_code
        == 406
    )
    assert drf_dispatches == ["/api/v1/leases"] * 3


# --- the bulk enqueue takes the same fast path --------------------------------------------


def test_enqueue_answers_agree_both_ways(api_a, team_a, drf_dispatches):
    make_definition(team_a, "parity.enqueue", queue="q")
    body = (
        b'{"runs": [{"job": "parity.enqueue", "idempotencyKey": "k-1", "delaySeconds": 60},'
        b' {"job": "no.such-job"}, {"job": "parity.enqueue", "delaySeconds": -1}]}'
    )
    # The first call creates k-1; then both ways answer it as the run that key names.
    assert api_a.http.post("/api/v1/runs", content=body, headers=FAST).status_code == 200
    drf_dispatches.clear()
    answer = both_ways(api_a, "/api/v1/runs", body, drf_dispatches)
    assert [item["status"] for item in answer["body"]["runs"]] == [200, 404, 400]
    assert answer["headers"]["allow"] == "GET, POST, HEAD, OPTIONS"


def test_enqueue_refusals_agree_both_ways(api_a, team_a, drf_dispatches, settings):
    make_definition(team_a, "parity.enqueue", queue="q")
    worker_only = ApiToken.issue(team_a, ["worker"])[1]
    one = b'{"runs": [{"job": "parity.enqueue", "delaySeconds": 60}]}'
    scope = both_ways(
        api_a, "/api/v1/runs", one, drf_dispatches, Authorization=f"Bearer {worker_only}"
    )
    assert scope["status"] == 403
    assert both_ways(api_a, "/api/v1/runs", b'{"runs": "no"}', drf_dispatches)["status"] == 400
    cache.clear()
    settings.SCHEDULER_API_RATES = {**settings.SCHEDULER_API_RATES, "enqueue": "1/min"}
    # The budget is a window of each clock minute: mid-minute, held still, all calls share one.
    with time_machine.travel(time.time() // 60 * 60 + 90, tick=False):
        assert api_a.http.post("/api/v1/runs", content=one, headers=FAST).status_code == 200
        drf_dispatches.clear()
        throttled = both_ways(api_a, "/api/v1/runs", one, drf_dispatches)
    assert throttled["status"] == 429
    assert int(throttled["headers"]["retry-after"]) > 0
    cache.clear()
