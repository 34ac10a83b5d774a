"""Fuzz the REST API with schemathesis, against its own OpenAPI schema, over real HTTP.

The schema is fetched from the live server (`/api/schema/?format=json`), and every operation in it
is called with generated requests, valid and invalid (the schema's examples, then random fuzzing;
`FUZZ_PHASES=examples,coverage,fuzzing` adds schemathesis' systematic boundary cases), carrying a
valid bearer token of a team that has jobs and runs in several states; path parameters are now and
then swapped for that team's real job names and run ids, so requests reach real objects and not
only 404s.

Every answer must:
- never be a 5xx;
- conform to the schema: a documented status code, content type, headers and body;
- when it is a 4xx, be problem details: `application/problem+json` with `type`, `title`,
  `status` (equal to the HTTP status) and `detail`;
- when it is a 4xx, have written no row: the counts of runs, job definitions and audit events
  are the same before and after the call ("bad input never leaves a half-written row").

Bounded: a dozen examples per operation and no shrinking (a failure is reported with its request
as a curl command), so the whole file runs in about a minute. The requests that the fuzzing found
failing are replayed deterministically by `test_requests_found_by_fuzzing`.
"""

from __future__ import annotations

import os

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from tests.fuzz.conftest import FuzzTeam, assert_problem_details, row_counts

pytestmark = pytest.mark.django_db(transaction=True)

# Bounded for CI (6 examples per operation: about 12 s in all). For a deeper search (10+ minutes; the coverage phase
# alone sends a few thousand requests): FUZZ_MAX_EXAMPLES=100 FUZZ_PHASES=examples,coverage,fuzzing
MAX_EXAMPLES = int(os.environ.get("FUZZ_MAX_EXAMPLES", "6"))
PHASES = os.environ.get("FUZZ_PHASES", "examples,fuzzing").split(",")


@pytest.fixture
def api_schema(live_server, fuzz_team):
    answer = httpx.get(f"{live_server.url}/api/schema/", params={"format": "json"}, timeout=30)
    assert answer.status_code == 200, answer.text
    loaded = schemathesis.openapi.from_dict(answer.json())
    loaded.config.update(
        base_url=live_server.url, headers={"Authorization": f"Bearer {fuzz_team.token}"}
    )
    # No shrinking: a failure is reported with the request that caused it (as a curl command),
    # and shrinking one can take minutes of HTTP calls.
    loaded.config.generation.update(max_examples=MAX_EXAMPLES, database="none", no_shrink=True)
    loaded.config.phases.update(phases=PHASES)
    return loaded


schema = schemathesis.pytest.from_fixture("api_schema")


def problem_details(ctx, response, case) -> bool | None:
    """The schemathesis check around assert_problem_details."""
    if not 400 <= response.status_code < 500:
        return None
    content_type = response.headers.get("content-type", [""])
    content_type = content_type[0] if isinstance(content_type, list) else content_type
    assert_problem_details(response.status_code, content_type, response.json())
    return True


CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    problem_details,
]


def bound_the_request(case, fuzz_team: FuzzTeam) -> None:
    """Keep requests short, and point some of them at real objects."""
    # A valid `waitSeconds` long-polls for up to 30 s when nothing is ready: do not wait.
    if isinstance(case.body, dict) and type(case.body.get("waitSeconds")) is int:
        if 0 < case.body["waitSeconds"] <= 30:
            case.body["waitSeconds"] = 0
    for parameter in list(case.path_parameters or {}):
        real = fuzz_team.real_value(parameter)
        if real is not None:
            case.path_parameters[parameter] = real


@settings(
    deadline=None,
    database=None,
    max_examples=MAX_EXAMPLES,
    suppress_health_check=list(HealthCheck),
)
@schema.parametrize()
def test_api_fuzz(case, fuzz_team) -> None:
    fuzz_team.ensure_objects()
    bound_the_request(case, fuzz_team)
    before = row_counts()
    response = case.call(timeout=60)
    after = row_counts()
    case.validate_response(response, checks=CHECKS)
    if 400 <= response.status_code < 500:
        assert after == before, (
            f"{case.method} {case.formatted_path} answered {response.status_code} but wrote "
            f"rows: {before} -> {after}; body {case.body!r}"
        )


# Requests that the fuzzing above answered with a 500 before their fixes. A random search meets
# each of them only now and then, so they are replayed on every run. (method, path, query, body)
N = "\u0000"
FOUND_BY_FUZZING = [
    # Well-formed but impossible times (parse_datetime raises ValueError on 12:99).
    ("GET", "/api/v1/jobs/fuzz.nightly/preview", {"from": "2024-01-01T12:99:00Z"}, None),
    ("POST", "/api/v1/preview", None, {"schedule": {}, "from": "2024-01-01T12:99:00Z"}),
    ("GET", "/api/v1/runs", {"since": "2024-01-01T12:99:00Z"}, None),
    ("POST", "/api/v1/dlq/requeue", None, {"filter": {"since": "2024-01-01T12:99:00Z"}}),
    ("POST", "/api/v1/dlq/discard", None, {"filter": {"since": "2024-01-01T12:99:00Z"}}),
    (
        "POST",
        "/api/v1/jobs/fuzz.nightly/backfill",
        None,
        {"from": "2024-01-01T00:00:00Z", "to": "2024-01-01T12:99:00Z"},
    ),
    # UTC offsets Python accepts and PostgreSQL does not (beyond ±15:59).
    ("GET", "/api/v1/dlq", {"since": "2024-01-01T00:00:00-20:00"}, None),
    ("POST", "/api/v1/dlq/discard", None, {"filter": {"since": "0321-12-11T09:12:00-21:35"}}),
    # The ends of datetime's range.
    ("GET", "/api/v1/jobs/fuzz.nightly/preview", {"from": "9999-12-31T23:59:59Z"}, None),
    ("GET", "/api/v1/jobs/fuzz.nightly/preview", {"from": "0001-01-01T00:00:00+14:00"}, None),
    (
        "POST",
        "/api/v1/preview",
        None,
        {"schedule": {"delaySeconds": 12}, "from": "9999-12-31T23:59:59Z"},
    ),
    ("PUT", "/api/v1/jobs/fuzz.late", None, {"schedule": {"runAt": "9999-12-31T23:59:59-05:00"}}),
    (
        "POST",
        "/api/v1/jobs/fuzz.nightly/backfill",
        None,
        {"from": "0001-01-01T00:00:00+05:00", "to": "2024-01-01T00:00:00Z"},
    ),
    # NUL characters, which PostgreSQL's text and jsonb cannot hold.
    ("POST", "/api/v1/leases", None, {"queues": ["fuzz" + N], "workerId": "w"}),
    ("POST", "/api/v1/leases", None, {"queues": ["fuzz"], "workerId": "w" + N}),
    ("POST", "/api/v1/leases", None, {"queues": ["fuzz"], "workerId": "w", "jobs": [N]}),
    ("POST", "/api/v1/jobs/fuzz.adhoc/runs", None, {"payload": {"a": N}}),
    ("PATCH", "/api/v1/jobs/fuzz.adhoc", None, {"payload": {"a": N}}),
    ("POST", "/api/v1/jobs", None, {"name": "fuzz.nul", "payload": [N]}),
    (
        "POST",
        "/api/v1/results",
        None,
        {"results": [{"runId": "run_1", "fencingToken": 1, "outcome": "succeeded", "result": N}]},
    ),
    ("GET", "/api/v1/runs", {"job": "a" + N}, None),
    ("GET", "/api/v1/dlq", {"queue": "a" + N}, None),
    ("POST", "/api/v1/dlq/requeue", None, {"filter": {"job": N}}),
    ("GET", "/api/v1/jobs/a%00", None, None),
    ("POST", "/api/v1/jobs/a%00/trigger", None, None),
    # Integers past PostgreSQL's bigint.
    ("POST", "/api/v1/runs/run_1/complete", None, {"fencingToken": 2**63}),
    ("POST", "/api/v1/runs/run_1/heartbeat", None, {"fencingToken": 2**64}),
    ("POST", "/api/v1/heartbeats", None, {"leases": [{"runId": "run_1", "fencingToken": 2**70}]}),
]


def test_requests_found_by_fuzzing(fuzz_team) -> None:
    """Replay each request (one test, so the live server and the team are set up once)."""
    failures = []
    for method, path, query, body in FOUND_BY_FUZZING:
        failure = fuzz_team.refused_cleanly(method, path, query=query, body=body)
        if failure:
            failures.append(f"{method} {path} query={query!r} body={body!r}: {failure}")
    assert not failures, "\n".join(failures)
