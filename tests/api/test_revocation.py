"""A revoked token, or a deleted team's, stops at once on the process that made the change.

Tokens are cached per process for `CACHE_SECONDS`; these tests call the live server (a thread of
this process), so the revocation or deletion happens on the process that answers the next call.
"""

from __future__ import annotations

import pytest

from apps.audit.record import Actor
from apps.teams import services
from apps.teams.models import ApiToken
from tests.conftest import Api, add_ready_runs, make_definition
from tests.dashboard.conftest import client_for, make_user

pytestmark = pytest.mark.django_db(transaction=True)

LEASE = {"queues": ["q"], "max": 1, "workerId": "w"}


def assert_unauthenticated(answer) -> None:
    assert answer.status_code == 401, answer.text
    assert answer.headers["Content-Type"] == "application/problem+json"
    body = answer.json()
    assert body["status"] == 401 and body["detail"]


def test_a_token_revoked_in_the_dashboard_is_refused_on_the_very_next_call(
    live_server, team_a, token_a, ready_listener
):
    api = Api(live_server.url, token_a)
    assert api.post("/api/v1/leases", LEASE).status_code == 200  # both paths now cached
    assert api.get("/api/v1/jobs").status_code == 200
    token = ApiToken.objects.get(team=team_a)
    admin = client_for(make_user("alice-admin", team_a, "admin"))
    assert admin.post(f"/teams/team-a/tokens/{token.pk}/revoke").status_code == 302
    assert_unauthenticated(api.post("/api/v1/leases", LEASE))
    assert_unauthenticated(api.get("/api/v1/jobs"))


def test_a_token_revoked_through_the_service_leaves_other_cached_tokens_cached(
    live_server, team_a, token_a, worker_token_a, ready_listener
):
    revoked, kept = Api(live_server.url, token_a), Api(live_server.url, worker_token_a)
    assert revoked.post("/api/v1/leases", LEASE).status_code == 200
    assert kept.post("/api/v1/leases", LEASE).status_code == 200
    from apps.api import auth

    cached_before = set(auth._cache)
    token = ApiToken.objects.get(team=team_a, scopes=["manage", "worker"])
    assert services.revoke_token(token, Actor.system())
    assert set(auth._cache) == cached_before - {token.token_hash}
    assert_unauthenticated(revoked.post("/api/v1/leases", LEASE))
    assert kept.post("/api/v1/leases", LEASE).status_code == 200


def test_a_deleted_teams_token_is_401_on_the_worker_path(live_server, team_a, token_a):
    definition = make_definition(team_a, "gone.job", queue="q")
    add_ready_runs(definition, 2)
    api = Api(live_server.url, token_a)
    (lease,) = api.lease(["q"], 1)
    team_a.delete()
    assert_unauthenticated(api.post("/api/v1/leases", LEASE))
    assert_unauthenticated(
        api.post(f"/api/v1/runs/{lease['runId']}/complete", {"fencingToken": lease["fencingToken"]})
    )


def test_a_deleted_teams_token_is_401_on_the_management_path(live_server, team_a, token_a):
    api = Api(live_server.url, token_a)
    assert api.get("/api/v1/jobs").status_code == 200
    team_a.delete()
    assert_unauthenticated(api.get("/api/v1/jobs"))
    assert_unauthenticated(api.post("/api/v1/jobs", {"name": "late.job", "schedule": {}}))


@pytest.mark.parametrize("carrying_results", [False, True])
def test_a_long_poll_waiting_when_its_token_is_revoked_leases_nothing(
    live_server, team_a, token_a, ready_listener, carrying_results
):
    """The poll waited on with the token it began with: a run enqueued after the revocation
    was leased to it, a worker whose every next call was refused (the run then sat leased
    until its lease expired). Results it carried stand, and are answered."""
    import threading
    import time

    from apps.runs.ids import public_run_id
    from apps.runs.models import Run
    from tests.conftest import claim

    definition = make_definition(team_a, "poll.revoked", queue="q")
    api = Api(live_server.url, token_a)
    body = {**LEASE, "waitSeconds": 10}
    if carrying_results:
        add_ready_runs(definition, 1, prefix="done")
        (held,) = claim(queues=["q"], max_runs=1, worker_id="w", team_ids=[team_a.pk])
        body["results"] = [{"runId": public_run_id(held.id), "fencingToken": held.fencing_token,
                            "outcome": "succeeded"}]  # fmt: skip
    answers = []
    poll = threading.Thread(target=lambda: answers.append(api.post("/api/v1/leases", body)))
    poll.start()
    time.sleep(1)  # waiting now (the results, if any, applied)
    token = ApiToken.objects.get(team=team_a)
    assert services.revoke_token(token, Actor.system())
    (pk,) = add_ready_runs(definition, 1, prefix="after")
    poll.join(15)
    (answer,) = answers
    if carrying_results:
        assert answer.status_code == 200, answer.text
        assert answer.json()["leases"] == []
        assert [item["status"] for item in answer.json()["results"]] == [200]
    else:
        assert_unauthenticated(answer)
        assert "revoked while this request waited" in answer.json()["detail"]
    assert Run.objects.get(pk=pk).state == "scheduled"  # stored so; claimable, not leased
