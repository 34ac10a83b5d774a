"""What the fuzz tests share: a team with jobs and runs in several states, and the checks."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
from django.core.cache import cache
from django.db import connection

from apps.jobs.models import JobDefinition
from apps.runs.ids import public_run_id
from apps.runs.models import Run
from apps.teams.models import ApiToken, Team

PROBLEM_JSON = "application/problem+json"
COUNTED_TABLES = ("runs_run", "jobs_jobdefinition", "audit_auditevent")

JOBS = {
    "fuzz.nightly": {
        "schedule": {"cron": "30 2 * * *", "timeZone": "Europe/Berlin", "jitterSeconds": 0},
        "queue": "fuzz",
        "priority": "critical",
        "retry": {"maxAttempts": 1, "baseSeconds": 0, "maxSeconds": 0},
        "concurrency": 1,
        "payload": {"format": "csv"},
    },
    "fuzz.adhoc": {"schedule": {}, "queue": "fuzz-other", "payload": {"n": 1}},
}


def row_counts() -> dict[str, int]:
    with connection.cursor() as cursor:
        counts = {}
        for table in COUNTED_TABLES:
            cursor.execute(f"SELECT count(*) FROM {table}")
            counts[table] = cursor.fetchone()[0]
        return counts


@dataclass
class FuzzTeam:
    """A team with jobs and runs in several states, rebuilt whenever a request removed them."""

    base_url: str
    token: str
    team: Team
    http: httpx.Client = field(init=False)
    run_ids: list[str] = field(default_factory=list)
    tick: itertools.count = field(default_factory=itertools.count)

    def __post_init__(self) -> None:
        self.http = httpx.Client(
            base_url=self.base_url, headers={"Authorization": f"Bearer {self.token}"}, timeout=30
        )

    def call(self, method: str, path: str, body=None) -> dict:
        answer = self.http.request(method, path, json=body)
        assert answer.status_code < 300, (method, path, answer.status_code, answer.text)
        return answer.json() if answer.content else {}

    def ensure_objects(self) -> None:
        """(Re)create the jobs and runs that requests deleted (read from the database: cheap)."""
        names = set(
            JobDefinition.objects.filter(team=self.team, name__in=JOBS).values_list(
                "name", flat=True
            )
        )
        for name in JOBS.keys() - names:
            self.call("PUT", f"/api/v1/jobs/{name}", JOBS[name])
        if Run.objects.filter(team=self.team).count() < 3:
            self.make_runs()
        pks = Run.objects.filter(team=self.team).order_by("-pk").values_list("pk", flat=True)
        self.run_ids = [public_run_id(pk) for pk in pks[:50]]

    def make_runs(self) -> None:
        """Runs of each kind: ready, leased, dead (the DLQ), succeeded and a delayed one."""
        for name in ("fuzz.nightly", "fuzz.adhoc"):
            self.call("POST", f"/api/v1/jobs/{name}/resume")
        for queue in ("fuzz", "fuzz-other"):
            self.call("POST", f"/api/v1/queues/{queue}/resume")
        key = next(self.tick)
        for suffix in ("dead", "done", "leased", "ready"):
            self.call(
                "POST", "/api/v1/jobs/fuzz.nightly/runs", {"idempotencyKey": f"{suffix}-{key}"}
            )
            self.call(
                "POST",
                "/api/v1/jobs/fuzz.adhoc/runs",
                {"idempotencyKey": f"{suffix}-{key}", "payload": {"kind": suffix}},
            )
        self.call(
            "POST",
            "/api/v1/jobs/fuzz.adhoc/runs",
            {"idempotencyKey": f"later-{key}", "delaySeconds": 3600},
        )
        leases = self.call(
            "POST",
            "/api/v1/leases",
            {"queues": ["fuzz", "fuzz-other"], "max": 4, "workerId": "fuzz-worker"},
        )["leases"]
        for lease, outcome in zip(leases, ("dead", "done", "dead", "leased"), strict=False):
            run = f"/api/v1/runs/{lease['runId']}"
            token = lease["fencingToken"]
            if outcome == "dead":
                self.call(
                    "POST",
                    f"{run}/fail",
                    {"fencingToken": token, "error": {"message": "x"}, "retryable": False},
                )
            elif outcome == "done":
                self.call("POST", f"{run}/complete", {"fencingToken": token, "result": {"ok": 1}})

    def refused_cleanly(
        self, method: str, path: str, *, query: Any = None, body: Any = None
    ) -> str | None:
        """Send the request; None if it was answered below 500 and, when refused, with problem
        details and no row written; else what went wrong."""
        self.ensure_objects()
        before = row_counts()
        answer = self.http.request(method, path, params=query, json=body)
        after = row_counts()
        try:
            assert answer.status_code < 500, f"answered {answer.status_code}: {answer.text[:300]}"
            if answer.status_code >= 400:
                assert_problem_details(
                    answer.status_code, answer.headers.get("content-type", ""), answer.json()
                )
                assert after == before, f"a {answer.status_code} wrote rows: {before} -> {after}"
        except AssertionError as exc:
            return str(exc)
        return None

    def real_value(self, parameter: str) -> str | None:
        """Every third request for a path parameter gets a real object of the team."""
        if next(self.tick) % 3:
            return None
        if parameter == "run_id" and self.run_ids:
            return self.run_ids[next(self.tick) % len(self.run_ids)]
        if parameter == "name":
            names = [*JOBS, "fuzz", "fuzz-other"]  # job names, and queue names for /queues/
            return names[next(self.tick) % len(names)]
        return None


@pytest.fixture
def fuzz_team(live_server, settings, ready_listener) -> FuzzTeam:
    # Throttling is tested on its own (tests/api/test_throttling.py); here it would only turn
    # most generated requests into 429s.
    settings.SCHEDULER_API_RATES = {"worker": "", "manage": ""}
    cache.clear()
    team = Team.objects.create(slug="fuzz", name="Fuzz")
    token = ApiToken.issue(team, ["worker", "manage"])[1]
    fuzz = FuzzTeam(base_url=live_server.url, token=token, team=team)
    fuzz.ensure_objects()
    yield fuzz
    fuzz.http.close()


def assert_problem_details(status: int, content_type: str, body: object) -> None:
    """A 4xx is problem details: application/problem+json with type, title, status, detail."""
    assert content_type.split(";")[0].strip() == PROBLEM_JSON, (
        f"{status} answered as {content_type!r}, not {PROBLEM_JSON}"
    )
    assert isinstance(body, dict), f"problem details must be an object, got {body!r}"
    missing = {"type", "title", "status", "detail"} - set(body)
    assert not missing, f"problem details without {sorted(missing)}: {body}"
    assert body["status"] == status, body
    for key in ("type", "title", "detail"):
        assert isinstance(body[key], str) and body[key], body
