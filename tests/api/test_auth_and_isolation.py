"""Tokens, scopes and team isolation."""

from __future__ import annotations

import pytest

from apps.jobs.models import JobDefinition
from apps.runs.models import Run
from apps.teams.models import ApiToken
from tests.conftest import Api, add_ready_runs, make_definition

pytestmark = pytest.mark.django_db(transaction=True)


def test_no_token_is_401(live_server, db):
    answer = Api(live_server.url, None).get("/api/v1/jobs")
    assert answer.status_code == 401
    assert answer.json()["status"] == 401


def test_unknown_or_revoked_token_is_401(live_server, team_a, token_a):
    from django.utils import timezone

    assert Api(live_server.url, "jst_nope").get("/api/v1/jobs").status_code == 401
    ApiToken.objects.update(revoked_at=timezone.now())
    assert Api(live_server.url, token_a).get("/api/v1/jobs").status_code == 401


def test_tokens_are_stored_hashed(team_a, token_a):
    stored = ApiToken.objects.get()
    assert token_a not in (stored.token_hash, stored.prefix)
    assert stored.matches(token_a)


def test_worker_token_cannot_manage(live_server, worker_token_a):
    api = Api(live_server.url, worker_token_a)
    answer = api.post("/api/v1/jobs", {"name": "a.b"})
    assert answer.status_code == 403 and "manage" in answer.json()["detail"]
    assert api.get("/api/v1/runs").status_code == 403


def test_manage_only_token_cannot_lease(live_server, team_a):
    raw = ApiToken.issue(team_a, ["manage"])[1]
    answer = Api(live_server.url, raw).post("/api/v1/leases", {"queues": ["q"], "workerId": "w"})
    assert answer.status_code == 403


def test_other_teams_jobs_are_forbidden_and_runs_not_found(api_a, api_b, team_a):
    """A job name is one namespace for every team (PUT and POST say it is taken): another
    team's job is a 403. A run id is not: another team's runs are a 404."""
    definition = make_definition(team_a, "secret.job", queue="q")
    add_ready_runs(definition, 1)
    (lease,) = api_a.lease(["q"], 1)
    run_id = lease["runId"]
    token = {"fencingToken": lease["fencingToken"]}
    assert api_b.get("/api/v1/jobs/secret.job").status_code == 403
    assert api_b.post("/api/v1/jobs/secret.job/pause").status_code == 403
    assert api_b.post("/api/v1/jobs/secret.job/runs", {}).status_code == 403
    assert api_b.get("/api/v1/jobs/nobody.has-this").status_code == 404
    assert api_b.get(f"/api/v1/runs/{run_id}").status_code == 404
    assert api_b.post(f"/api/v1/runs/{run_id}/heartbeat", token).status_code == 404
    assert api_b.post(f"/api/v1/runs/{run_id}/complete", token).status_code == 404
    assert api_b.post(f"/api/v1/runs/{run_id}/fail", token).status_code == 404
    assert api_b.post(f"/api/v1/runs/{run_id}/cancel").status_code == 404
    assert api_b.post("/api/v1/dlq/requeue", {"runIds": [run_id]}).json()["count"] == 0
    assert api_b.lease(["q"], 5) == []
    assert Run.objects.get().state == "leased"
    # Every attempt was recorded, as a denial by team B's token against team A's objects.
    from apps.audit.models import AuditEvent

    denied = AuditEvent.objects.filter(action="access.denied")
    assert denied.count() == 9
    assert set(denied.values_list("team__slug", flat=True)) == {"team-a"}
    assert all(event.actor_token.team.slug == "team-b" for event in denied)
    assert set(denied.values_list("target", flat=True)) == {"secret.job", run_id}
    # Another team cannot take the name either, by any call: each a 403, each recorded.
    taking = [
        api_b.put("/api/v1/jobs/secret.job", {"name": "secret.job", "queue": "q"}),
        api_b.post("/api/v1/jobs", {"name": "secret.job", "queue": "q"}),
        api_b.put("/api/v1/jobs", {"jobs": [{"name": "secret.job", "queue": "q"}],
                                   "dryRun": True}),
    ]  # fmt: skip
    assert [answer.status_code for answer in taking] == [403, 403, 403]
    assert "'secret.job' belongs to another team" in taking[2].json()["detail"]
    assert AuditEvent.objects.filter(action="access.denied").count() == 12
    assert JobDefinition.objects.get(name="secret.job").team == team_a


def test_a_revoked_token_stops_working_within_the_cache_time(
    live_server, team_a, token_a, monkeypatch
):
    import time

    from django.utils import timezone

    from apps.api import auth

    monkeypatch.setattr(auth, "CACHE_SECONDS", 0.5)
    api = Api(live_server.url, token_a)
    assert api.get("/api/v1/jobs").status_code == 200
    ApiToken.objects.update(revoked_at=timezone.now())
    time.sleep(0.6)
    assert api.get("/api/v1/jobs").status_code == 401
