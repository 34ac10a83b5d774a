"""Deep and wide JSON in every body field and every query parameter of the API.

For each operation of the OpenAPI schema, a valid body is taken from BODIES and each of its
positions in turn (the body itself, every field, every item, every nested field) is replaced by
a value nested past the depth limit, one nested past what the encoder can write, a wide object
and a wide list. Every query parameter gets deep brackets and a long string. Every answer must be
below 500, a 4xx must be problem details, and a 4xx must have written no row.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.fuzz.conftest import FuzzTeam

pytestmark = pytest.mark.django_db(transaction=True)


def nested(depth: int) -> Any:
    value: Any = "leaf"
    for index in range(depth):
        value = {"k": value} if index % 2 else [value]
    return value


HOSTILE = {
    "past the limit": nested(65),
    "past the encoder": nested(300),
    "wide object": {f"k{n}": n for n in range(5000)},
    "wide list": list(range(20000)),
}
QUERY_VALUES = {"deep brackets": "[" * 3000 + "]" * 3000, "long": "a" * 6000}

RESULT = {"runId": "{run}", "fencingToken": 1, "outcome": "succeeded", "result": {"ok": 1}}
FAILED = {
    "runId": "{run}",
    "fencingToken": 1,
    "outcome": "failed",
    "error": {"message": "m", "type": "t"},
}
DEFINITION = {
    "name": "fuzz.deep",
    "schedule": {"cron": "0 2 * * *", "timeZone": "UTC", "jitterSeconds": 0},
    "queue": "fuzz",
    "retry": {"maxAttempts": 2, "baseSeconds": 1, "maxSeconds": 2},
    "payload": {"a": [1, {"b": 2}]},
}
# A valid body per operation that takes one; "{run}" and "{job}" are filled in per call.
BODIES: dict[str, Any] = {
    "discardDeadRuns": {"filter": {"job": "{job}", "queue": "fuzz"}},
    "requeueDeadRuns": {"runIds": ["{run}"]},
    "heartbeatRuns": {"leases": [{"runId": "{run}", "fencingToken": 1}]},
    "createJob": DEFINITION,
    "syncJobs": {"jobs": [DEFINITION], "prune": False, "dryRun": True},
    "replaceJob": {k: v for k, v in DEFINITION.items() if k != "name"},
    "updateJob": {"payload": {"a": 1}, "retry": {"maxAttempts": 2}},
    "backfillJob": {"from": "2026-01-01T00:00:00Z", "to": "2026-01-02T00:00:00Z", "dryRun": True},
    "createJobRun": {"idempotencyKey": "deep", "delaySeconds": 5, "payload": {"a": {"b": [1]}}},
    "triggerJob": {"payload": {"a": {"b": [1]}}},
    "enqueueRuns": {
        "runs": [{"job": "{job}", "idempotencyKey": "deep-bulk", "payload": {"a": [1]}}]
    },
    "leaseRuns": {"queues": ["fuzz"], "jobs": ["{job}"], "max": 1, "workerId": "w"},
    "previewSchedule": {"schedule": DEFINITION["schedule"], "count": 2},
    "reportResults": {"results": [RESULT, FAILED]},
    "completeRun": {"fencingToken": 1, "result": {"rows": [1, 2]}},
    "failRun": {"fencingToken": 1, "error": {"message": "m", "type": "t"}, "retryable": True},
    "heartbeatRun": {"fencingToken": 1},
    "putQueue": {"rateLimit": {"count": 5, "periodSeconds": 60}, "paused": False},
    "createChannel": {
        "name": "deep",
        "kind": "email",
        "target": "oncall@example.com",
        "events": ["run.dead"],
        "jobs": ["{job}"],
        "queues": ["fuzz"],
    },
    "updateChannel": {"events": ["run.dead", "job.recovered"], "jobs": ["{job}"]},
}


def positions(value: Any, path: tuple = ()) -> Iterator[tuple]:
    """Every place in `value` a hostile value could go: the value itself and everything in it."""
    yield path
    if isinstance(value, dict):
        for key, child in value.items():
            yield from positions(child, (*path, key))
    elif isinstance(value, list):
        for index, child in enumerate(value):
            yield from positions(child, (*path, index))


def replaced(value: Any, path: tuple, new: Any) -> Any:
    if not path:
        return new
    head, *rest = path
    if isinstance(value, dict):
        return {**value, head: replaced(value[head], tuple(rest), new)}
    copy = list(value)
    copy[head] = replaced(copy[head], tuple(rest), new)
    return copy


def filled(value: Any, names: dict[str, str]) -> Any:
    if isinstance(value, str):
        return value.format(**names) if "{" in value and len(value) < 20 else value
    if isinstance(value, dict):
        return {key: filled(child, names) for key, child in value.items()}
    if isinstance(value, list):
        return [filled(child, names) for child in value]
    return value


def operations(base_url: str) -> list[tuple[str, str, dict]]:
    schema = httpx.get(f"{base_url}/api/schema/", params={"format": "json"}, timeout=30).json()
    return [
        (method.upper(), path, operation)
        for path, methods in schema["paths"].items()
        for method, operation in methods.items()
    ]


def lists_render(fuzz: FuzzTeam) -> str | None:
    """Whatever was accepted renders back in every list."""
    for listing in ("/api/v1/runs", "/api/v1/dlq", "/api/v1/jobs", "/api/v1/queues"):
        shown = fuzz.http.get(listing)
        if shown.status_code != 200:
            return f"{listing} answered {shown.status_code}"
    return None


def test_every_body_field_survives_deep_and_wide_json(fuzz_team, live_server) -> None:
    failures = []
    for method, path, operation in operations(live_server.url):
        if method not in ("POST", "PUT", "PATCH"):
            continue
        op_id = operation["operationId"]
        if "requestBody" in operation:
            assert op_id in BODIES, f"{op_id} takes a body: add a valid one to BODIES"
        base = BODIES.get(op_id, {})
        for where in positions(base):
            # Width is refused by the parser whatever the position (tried on the whole body);
            # depth is checked wherever it lands, with the one deep value below the body (the
            # test took 40 s with every value everywhere).
            hostile = HOSTILE if not where else {"past the limit": HOSTILE["past the limit"]}
            for label, value in hostile.items():
                names = {"run": fuzz_team.run_ids[0], "job": "fuzz.adhoc"}
                url = path.replace("{name}", "fuzz.adhoc").replace("{run_id}", names["run"])
                body = replaced(filled(base, names), where, value)
                failure = fuzz_team.refused_cleanly(method, url, body=body)
                if failure:
                    failures.append(
                        f"{op_id} {'.'.join(map(str, where)) or 'body'} ({label}): {failure}"
                    )
        broken = lists_render(fuzz_team)
        if broken:
            failures.append(f"after {op_id}: {broken}")
    assert not failures, "\n".join(failures)


def test_every_query_parameter_survives_deep_and_long_values(fuzz_team, live_server) -> None:
    failures = []
    for method, path, operation in operations(live_server.url):
        queries = [p["name"] for p in operation.get("parameters", []) if p["in"] == "query"]
        url = path.replace("{name}", "fuzz.adhoc").replace("{run_id}", fuzz_team.run_ids[0])
        for name in queries:
            for label, value in QUERY_VALUES.items():
                failure = fuzz_team.refused_cleanly(method, url, query={name: value})
                if failure:
                    failures.append(f"{operation['operationId']} ?{name} ({label}): {failure}")
    assert not failures, "\n".join(failures)
