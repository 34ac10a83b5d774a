"""The OpenAPI schema and Swagger UI, over real HTTP: complete, valid, and served without a CDN."""

from __future__ import annotations

import re
from html.parser import HTMLParser
from urllib.parse import urljoin

import httpx
import pytest
import yaml
from django.core.management import call_command
from drf_spectacular.validation import validate_schema

from apps.api import urls as api_urls

pytestmark = pytest.mark.django_db(transaction=True)

HTTP_METHODS = ("get", "post", "put", "patch", "delete")
PROBLEM_JSON = "application/problem+json"


def api_v1_routes() -> dict[str, set[str]]:
    """Every /api/v1 path of apps/api/urls.py in OpenAPI form, with the methods its view serves."""
    routes: dict[str, set[str]] = {}
    for pattern in api_urls.urlpatterns:
        route = str(pattern.pattern)
        if not route.startswith("api/v1/"):
            continue
        view_class = pattern.callback.view_class
        path = "/" + re.sub(r"<(?:\w+:)?(\w+)>", r"{\1}", route)
        routes[path] = {method for method in HTTP_METHODS if hasattr(view_class, method)}
    return routes


@pytest.fixture
def schema(live_server) -> dict:
    answer = httpx.get(f"{live_server.url}/api/schema/", params={"format": "json"}, timeout=30)
    assert answer.status_code == 200, answer.text
    assert "json" in answer.headers["content-type"]
    return answer.json()


def operations(schema: dict):
    for path, item in schema["paths"].items():
        for method, operation in item.items():
            if method in HTTP_METHODS:
                yield path, method, operation


def test_schema_is_served_as_yaml_and_json(live_server):
    answer = httpx.get(f"{live_server.url}/api/schema/", timeout=30)
    assert answer.status_code == 200, answer.text
    assert answer.headers["content-type"].startswith("application/vnd.oai.openapi")
    from_yaml = yaml.safe_load(answer.text)
    assert from_yaml["openapi"].startswith("3.")
    as_json = httpx.get(
        f"{live_server.url}/api/schema/", params={"format": "json"}, timeout=30
    ).json()
    assert as_json == from_yaml


def test_schema_is_valid_openapi(schema):
    assert schema["openapi"].startswith("3.")
    validate_schema(schema)


def test_generation_has_no_errors_or_warnings(tmp_path):
    # `--fail-on-warn` turns any drf-spectacular error or warning into a failed command.
    out = tmp_path / "schema.yaml"
    call_command("spectacular", "--file", str(out), "--validate", "--fail-on-warn")
    assert out.read_text().startswith("openapi: 3.")


def test_every_api_v1_route_is_documented_with_its_methods(schema):
    routes = api_v1_routes()
    assert len(routes) >= 20
    documented = {
        path: {method for method in item if method in HTTP_METHODS}
        for path, item in schema["paths"].items()
        if path.startswith("/api/v1/")
    }
    assert documented == routes


def test_operation_ids_are_unique_and_readable(schema):
    ids = [operation["operationId"] for _, _, operation in operations(schema)]
    assert len(ids) == len(set(ids))
    for operation_id in ids:
        assert re.fullmatch(r"[a-z][A-Za-z]+", operation_id), operation_id
    assert {
        "leaseRuns",
        "heartbeatRun",
        "completeRun",
        "failRun",
        "heartbeatRuns",
        "reportResults",
        "listJobs",
        "createJob",
        "getJob",
        "replaceJob",
        "updateJob",
        "deleteJob",
        "pauseJob",
        "resumeJob",
        "triggerJob",
        "createJobRun",
        "previewJob",
        "previewSchedule",
        "listRuns",
        "getRun",
        "cancelRun",
        "retryRun",
        "listDeadRuns",
        "requeueDeadRuns",
        "discardDeadRuns",
    } <= set(ids)


def test_bearer_security_scheme_guards_every_operation(schema):
    schemes = schema["components"]["securitySchemes"]
    assert schemes["bearerAuth"]["type"] == "http"
    assert schemes["bearerAuth"]["scheme"] == "bearer"
    for path, method, operation in operations(schema):
        assert operation["security"] == [{"bearerAuth": []}], (path, method)


def test_errors_are_problem_details(schema):
    problem = schema["components"]["schemas"]["ProblemDetails"]
    assert set(problem["required"]) == {"type", "title", "status", "detail"}
    errors = problem["properties"]["errors"]
    assert errors["additionalProperties"] == {"type": "array", "items": {"type": "string"}}
    for path, method, operation in operations(schema):
        codes = operation["responses"]
        assert {"401", "403"} <= set(codes), (path, method)
        assert any(code.startswith("2") for code in codes), (path, method)
        for code, response in codes.items():
            if code.startswith(("4", "5")):
                assert list(response["content"]) == [PROBLEM_JSON], (path, method, code)
                reference = response["content"][PROBLEM_JSON]["schema"]["$ref"]
                assert reference.endswith("/ProblemDetails")
        if "requestBody" in operation:
            assert {"400", "413"} <= set(codes), (path, method)
        # A queue exists once named (pausing a new name creates it); jobs and runs must exist.
        if ("{run_id}" in path or "{name}" in path) and not path.startswith("/api/v1/queues/"):
            assert "404" in codes or method == "put", (path, method)


def test_the_contract_codes_are_declared(schema):
    paths = schema["paths"]
    assert "409" in paths["/api/v1/runs/{run_id}/heartbeat"]["post"]["responses"]
    assert "409" in paths["/api/v1/runs/{run_id}/complete"]["post"]["responses"]
    assert "409" in paths["/api/v1/runs/{run_id}/cancel"]["post"]["responses"]
    assert {"200", "201"} <= set(paths["/api/v1/jobs/{name}"]["put"]["responses"])
    assert {"200", "201"} <= set(paths["/api/v1/jobs/{name}/runs"]["post"]["responses"])
    assert "204" in paths["/api/v1/jobs/{name}"]["delete"]["responses"]
    assert "201" in paths["/api/v1/jobs"]["post"]["responses"]
    # The same idempotency key with another payload.
    assert "409" in paths["/api/v1/jobs/{name}/runs"]["post"]["responses"]
    outcomes = schema["components"]["schemas"]["AttemptOutcomeEnum"]["enum"]
    assert "cancelled" in outcomes  # the run cancelled while the attempt held it


def test_refusals_any_call_may_meet_are_declared(schema):
    """406, 400 (a query parameter the call does not take) and 413 (a body past the limit)
    everywhere, with the headers of 401 and 429; 400 and 415 where a call takes no body and
    gets one all the same."""
    for path, method, operation in operations(schema):
        answers = operation["responses"]
        assert {"400", "406", "413"} <= set(answers), (path, method)
        assert "WWW-Authenticate" in answers["401"]["headers"], (path, method)
        assert "Retry-After" in answers["429"]["headers"], (path, method)
        if "412" in answers:
            assert "ETag" in answers["412"]["headers"], (path, method)
    for path, method in [
        ("/api/v1/runs/{run_id}/cancel", "post"),
        ("/api/v1/runs/{run_id}/retry", "post"),
        ("/api/v1/jobs/{name}/pause", "post"),
        ("/api/v1/jobs/{name}/resume", "post"),
        ("/api/v1/jobs/{name}", "delete"),
    ]:
        assert {"400", "415"} <= set(schema["paths"][path][method]["responses"]), (path, method)
    assert "415" not in schema["paths"]["/api/v1/jobs/{name}"]["get"]["responses"]


def test_parameters_are_typed(schema):
    paths = schema["paths"]
    preview = {p["name"]: p for p in paths["/api/v1/jobs/{name}/preview"]["get"]["parameters"]}
    assert preview["count"]["schema"] == {
        "type": "integer",
        "minimum": 1,
        "maximum": 1000,
        "default": 10,
    }
    assert preview["from"]["schema"] == {"type": "string", "format": "date-time"}
    assert preview["name"]["in"] == "path" and preview["name"]["required"] is True
    runs = {p["name"]: p for p in paths["/api/v1/runs"]["get"]["parameters"]}
    assert set(runs["state"]["schema"]["enum"]) >= {"ready", "leased", "dead", "retrying"}
    assert runs["limit"]["schema"]["maximum"] == 500
    assert runs["since"]["schema"]["format"] == "date-time"


def test_request_bodies_are_strict_and_bounded(schema):
    components = schema["components"]["schemas"]
    body = schema["paths"]["/api/v1/leases"]["post"]["requestBody"]
    assert body["required"] is True
    claim_ref = body["content"]["application/json"]["schema"]["$ref"]
    claim = components[claim_ref.rsplit("/", 1)[1]]
    assert claim["additionalProperties"] is False
    assert set(claim["required"]) == {"queues", "workerId"}
    assert claim["properties"]["max"]["minimum"] == 1
    assert claim["properties"]["max"]["maximum"] >= 1
    assert claim["properties"]["waitSeconds"]["maximum"] >= 0
    definition = components["DefinitionRequest"]
    assert definition["required"] == ["name"]
    assert definition["properties"]["priority"]["allOf"][0]["$ref"].endswith("/PriorityEnum")
    assert components["PriorityEnum"]["enum"] == ["critical", "default", "bulk"]
    schedule = components["Schedule"]
    # Cron, one-off, delayed, none (named in their descriptions: the 3.0 conversion drops titles).
    assert [option.get("required") for option in schedule["oneOf"]] == [
        ["cron"],
        ["runAt"],
        ["delaySeconds"],
        None,
    ]
    assert all(option["additionalProperties"] is False for option in schedule["oneOf"])
    run = components["Run"]
    assert {
        "runId",
        "job",
        "queue",
        "priority",
        "state",
        "attempt",
        "maxAttempts",
        "dueAt",
        "availableAt",
        "idempotencyKey",
        "fencingToken",
        "leaseExpiresAt",
        "workerId",
        "trigger",
        "dryRun",
        "payload",
        "lastError",
        "createdAt",
        "startedAt",
        "finishedAt",
    } <= set(run["required"])
    page = components["RunPage"]
    assert set(page["required"]) == {"results", "next"}


class _Assets(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.urls: list[str] = []

    def handle_starttag(self, tag, attrs):
        for name, value in attrs:
            if name in ("src", "href") and value:
                self.urls.append(value)


def test_swagger_ui_is_served_from_static_files(live_server):
    answer = httpx.get(f"{live_server.url}/api/docs/", timeout=30)
    assert answer.status_code == 200, answer.text
    assert answer.headers["content-type"].startswith("text/html")
    page = answer.text
    assert "swagger-ui" in page
    for cdn in ("cdn.jsdelivr.net", "unpkg.com", "cdnjs", "googleapis"):
        assert cdn not in page
    parser = _Assets()
    parser.feed(page)
    assets = [url for url in parser.urls if "drf_spectacular_sidecar" in url]
    assert any(url.endswith("swagger-ui-bundle.js") for url in assets), parser.urls
    assert any(url.endswith("swagger-ui.css") for url in assets), parser.urls
    for url in parser.urls:
        assert not url.startswith(("http://", "https://", "//")), url
    for url in assets:
        asset = httpx.get(urljoin(f"{live_server.url}/api/docs/", url), timeout=30)
        assert asset.status_code == 200, url
