"""`GET /api/v1/workers` over real HTTP: workers recorded by their lease and heartbeat calls,
their runs in flight counted on every shard database, the team's own only."""

from __future__ import annotations

from datetime import datetime, timedelta

import pytest
from django.db import connections
from django.test.utils import CaptureQueriesContext

from apps.runs import activity, retention, shards, workers
from apps.runs.clock import database_now
from apps.runs.models import Worker
from tests.conftest import Layout, add_ready_runs, claim, make_definition

pytestmark = [pytest.mark.shards, pytest.mark.django_db(transaction=True, databases="__all__")]


def _listed(api, **params) -> dict[str, dict]:
    answer = api.get("/api/v1/workers", params=params)
    assert answer.status_code == 200, answer.text
    return {worker["workerId"]: worker for worker in answer.json()["results"]}


def ago(*, minutes: int) -> datetime:
    return database_now() - timedelta(minutes=minutes)


def test_a_worker_is_listed_with_its_queues_runs_in_flight_and_times(api_a, team_a):
    add_ready_runs(make_definition(team_a, "billing.charge", queue="billing"), 3)
    first, second = api_a.lease(["billing", "reports"], 2, worker="host-1/11", leaseSeconds=60)
    (third,) = api_a.lease(["billing"], 1, worker="host-2/22")
    beat = api_a.post(
        f"/api/v1/runs/{first['runId']}/heartbeat", {"fencingToken": first["fencingToken"]}
    )
    assert beat.status_code == 200, beat.text
    batch = api_a.post(
        "/api/v1/heartbeats",
        {"leases": [{"runId": third["runId"], "fencingToken": third["fencingToken"]}]},
    )
    assert batch.json()["leases"][0]["status"] == 200

    listed = _listed(api_a)
    assert set(listed) == {"host-1/11", "host-2/22"}
    one = listed["host-1/11"]
    assert one["queues"] == ["billing", "reports"]
    assert one["inFlight"] == 2
    assert one["lastLeaseAt"].endswith("Z") and one["lastHeartbeatAt"].endswith("Z")
    assert one["lastHeartbeatAt"] >= one["lastLeaseAt"]
    assert listed["host-2/22"]["inFlight"] == 1
    assert listed["host-2/22"]["lastHeartbeatAt"] is not None

    # Done with its runs: nothing in flight, and its last heartbeat is still known (the row
    # the heartbeat calls wrote, not the finished runs).
    for lease in (first, second):
        done = api_a.post(
            f"/api/v1/runs/{lease['runId']}/complete", {"fencingToken": lease["fencingToken"]}
        )
        assert done.status_code == 200, done.text
    idle = _listed(api_a)["host-1/11"]
    assert idle["inFlight"] == 0
    assert idle["lastHeartbeatAt"] == one["lastHeartbeatAt"]
    assert idle["lastLeaseAt"] is not None


def test_another_teams_workers_are_not_visible(api_a, api_b, team_a, team_b):
    add_ready_runs(make_definition(team_b, "search.reindex", queue="search"), 1)
    assert len(api_b.lease(["search"], 1, worker="b-only")) == 1
    assert api_a.lease(["search"], 1, worker="a-only") == []  # team A has no such runs
    assert set(_listed(api_a)) == {"a-only"}
    assert set(_listed(api_b)) == {"b-only"}
    assert _listed(api_b)["b-only"]["inFlight"] == 1


def test_the_window_hides_idle_workers_but_not_those_holding_runs(api_a, team_a):
    add_ready_runs(make_definition(team_a, "ops.long", queue="ops"), 1)
    assert len(api_a.lease(["ops"], 1, worker="busy")) == 1
    assert api_a.lease(["ops"], 1, worker="idle") == []
    Worker.objects.filter(team=team_a).update(last_lease_at=ago(minutes=20), last_heartbeat_at=None)
    assert set(_listed(api_a)) == {"busy"}  # 15 minutes by default; it holds a run
    assert set(_listed(api_a, minutes="30")) == {"busy", "idle"}


def test_a_bad_window_is_a_400_naming_minutes(api_a):
    for minutes in ("0", "1441", "abc", "1.5", "-5", "\u0663", " 5", "99999"):
        answer = api_a.get("/api/v1/workers", params={"minutes": minutes})
        assert answer.status_code == 400, minutes
        assert answer.headers["content-type"] == "application/problem+json"
        assert answer.json()["errors"] == {"minutes": [workers.MINUTES_RULE]}
    assert api_a.get("/api/v1/workers", params={"minutes": "1440"}).status_code == 200


def test_lease_and_heartbeat_calls_write_at_most_once_per_interval(team_a):
    """A worker's row is written by its first lease call of an interval and the team's first
    heartbeat; the calls after them in the interval send no statement at all."""
    add_ready_runs(make_definition(team_a, "beats.one", queue="q"), 1)
    (lease,) = claim(queues=["q"], max_runs=1, worker_id="quiet/1", team_ids=[team_a.pk])
    assert Worker.objects.get(team=team_a).worker_id == "quiet/1"
    with CaptureQueriesContext(connections[shards.CONTROL]) as captured:
        for _ in range(5):
            activity.note_lease_activity(team_a.pk, ["q"], "quiet/1")
            activity.note_heartbeats(team_a.pk, [lease.id])
    written = [q["sql"] for q in captured.captured_queries if "runs_worker" in q["sql"]]
    assert len(written) == 1 and written[0].lstrip().startswith("UPDATE runs_worker")
    assert Worker.objects.get(team=team_a).last_heartbeat_at is not None


def test_a_worker_asking_other_queues_within_the_interval_is_listed_with_them(api_a, team_a):
    """Its row was written by the first lease call of the interval only: it was listed with the
    queues it had asked first, not its latest request's."""
    api_a.lease(["first"], 1, worker="host-a/1")
    api_a.lease(["second"], 1, worker="host-a/1")
    (listed,) = api_a.get("/api/v1/workers").json()["results"]
    assert (listed["workerId"], listed["queues"]) == ("host-a/1", ["second"])


def test_idle_workers_are_forgotten_after_a_day(team_a):
    activity.note_lease_activity(team_a.pk, ["q"], "old-process/1")
    activity.note_lease_activity(team_a.pk, ["q"], "new-process/2")
    Worker.objects.filter(worker_id="old-process/1").update(
        last_lease_at=ago(minutes=workers.FORGET_AFTER_MINUTES + 1)
    )
    retention.handle_one_round()
    assert list(Worker.objects.values_list("worker_id", flat=True)) == ["new-process/2"]


@pytest.mark.physical
def test_a_shard_database_down_is_named_and_the_rest_counted(layout: Layout, api_a, team_a):
    for alias in layout.aliases:
        layout.new_runs(layout.job_on(alias, team_a, f"spread-{alias}"), 1, "s")
    assert len(api_a.lease(["q"], 10, worker="spread")) == len(layout.aliases)
    dead = layout.aliases[-1]
    with layout.down(len(layout.servers) - 1):
        answer = api_a.get("/api/v1/workers")
    assert answer.status_code == 200, answer.text
    assert answer.json()["unavailableShards"] == [shards.span(dead)]
    (worker,) = answer.json()["results"]
    assert worker["workerId"] == "spread" and worker["inFlight"] == len(layout.aliases) - 1


def test_a_workers_times_come_from_its_newest_lease_where_its_row_has_none(api_a, team_a):
    add_ready_runs(make_definition(team_a, "billing.charge", queue="billing"), 3)
    older, _ = api_a.lease(["billing"], 2, worker="host-1/11")
    (newest,) = api_a.lease(["billing"], 1, worker="host-1/11")
    beat = api_a.post(
        f"/api/v1/runs/{newest['runId']}/heartbeat", {"fencingToken": newest["fencingToken"]}
    )
    assert beat.status_code == 200, beat.text
    # The row the calls wrote says nothing: what is listed is read from the runs in flight.
    Worker.objects.filter(team=team_a).update(last_lease_at=ago(minutes=3), last_heartbeat_at=None)

    (seen,) = workers.seen([team_a.pk], minutes=10).workers
    assert seen.in_flight == 3
    with connections["default"].cursor() as cursor:
        cursor.execute(
            "SELECT a.leased_at, a.last_heartbeat_at FROM runs_attempt a"
            " WHERE a.fencing_token = %s",
            [newest["fencingToken"]],
        )
        leased_at, beaten_at = cursor.fetchone()
    assert beaten_at is not None
    assert (seen.last_lease_at, seen.last_heartbeat_at) == (leased_at, beaten_at)
    assert older["fencingToken"] < newest["fencingToken"]


def test_a_worker_token_lists_its_teams_workers_and_a_token_with_neither_scope_may_not(
    live_server, ready_listener, team_a, worker_token_a, api_a
):
    """The fleet reads the list with the token it works with, as the protocol's other calls."""
    from apps.teams.models import ApiToken
    from tests.conftest import Api

    add_ready_runs(make_definition(team_a, "billing.charge", queue="billing"), 1)
    worker = Api(live_server.url, worker_token_a)
    assert worker.lease(["billing"], 1, worker="host-1/11")
    assert set(_listed(worker)) == {"host-1/11"}
    assert set(_listed(worker)) == set(_listed(api_a))

    neither = Api(live_server.url, ApiToken.issue(team_a, [])[1])
    refused = neither.get("/api/v1/workers")
    assert refused.status_code == 403
    assert "'manage' or 'worker' scope" in refused.json()["detail"]
