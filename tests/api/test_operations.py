"""Why-not-running and queues over the API."""

from __future__ import annotations

import pytest

from apps.audit.models import AuditEvent
from apps.jobs.models import Queue
from apps.runs import limits
from tests.conftest import add_ready_runs, make_definition

pytestmark = pytest.mark.django_db(transaction=True)


def test_why_names_the_paused_queue_and_the_silent_workers(api_a, team_a):
    definition = make_definition(team_a, "ops.report", queue="reports")
    add_ready_runs(definition, 1)
    run_id = api_a.get("/api/v1/runs").json()["results"][0]["runId"]
    why = api_a.get(f"/api/v1/runs/{run_id}/why").json()
    assert [r["code"] for r in why["reasons"]] == ["no_worker"]
    assert why["state"] == api_a.get(f"/api/v1/runs/{run_id}").json()["state"] == "ready"
    paused = api_a.post("/api/v1/queues/reports/pause")
    assert paused.status_code == 200 and paused.json()["paused"] is True
    assert api_a.lease(["reports"], 5) == []
    codes = [r["code"] for r in api_a.get(f"/api/v1/runs/{run_id}/why").json()["reasons"]]
    assert codes == ["queue_paused"]  # the lease call above counts as a worker asking
    assert api_a.post("/api/v1/queues/reports/resume").json()["paused"] is False
    assert len(api_a.lease(["reports"], 5)) == 1
    actions = list(
        AuditEvent.objects.filter(target_type="queue")
        .values_list("action", flat=True)
        .order_by("id")
    )
    assert actions == ["queue.pause", "queue.resume"]


def test_queue_list_shows_depth_by_priority(api_a, team_a):
    add_ready_runs(make_definition(team_a, "d.crit", queue="mix", priority="critical"), 3)
    add_ready_runs(make_definition(team_a, "d.bulk", queue="mix", priority="bulk"), 2)
    (queue,) = api_a.get("/api/v1/queues").json()["results"]
    assert queue["name"] == "mix"
    assert queue["depth"] == {"critical": 3, "default": 0, "bulk": 2}
    assert queue["oldestReadyAt"].endswith("Z")


def test_why_job_says_paused(api_a, team_a):
    make_definition(team_a, "ops.paused", queue="q", paused=True)
    reasons = api_a.get("/api/v1/jobs/ops.paused/why").json()["reasons"]
    assert reasons[0]["code"] == "definition_paused"
    # A cron job paused has no next fire time (it was given one it would not fire at).
    assert api_a.put("/api/v1/jobs/ops.cron", {"queue": "q", "schedule": {"cron": "0 2 * * *"}}
                     ).status_code == 201  # fmt: skip
    assert api_a.post("/api/v1/jobs/ops.cron/pause").status_code == 200
    codes = [r["code"] for r in api_a.get("/api/v1/jobs/ops.cron/why").json()["reasons"]]
    assert "definition_paused" in codes and "next_fire" not in codes


def test_other_teams_queue_pause_does_not_touch_ours(api_a, api_b, team_a):
    add_ready_runs(make_definition(team_a, "mine.job", queue="shared-name"), 1)
    api_b.post("/api/v1/queues/shared-name/pause")
    assert len(api_a.lease(["shared-name"], 5)) == 1


def test_a_queue_name_outside_the_queue_rule_is_refused(api_a):
    for name in ("-starts-with-a-dash", "has%20space", "q" * 101):
        answer = api_a.post(f"/api/v1/queues/{name}/pause")
        assert answer.status_code == 400 and list(answer.json()["errors"]) == ["name"], name
    assert api_a.post("/api/v1/queues/-x/resume").json()["errors"]["name"] == [
        limits.QUEUE_NAME_RULE
    ]
    assert not Queue.objects.exists()


def test_a_queue_rate_limit_is_set_used_explained_and_lifted_over_the_api(api_a, api_b, team_a):
    """PUT /api/v1/queues/{name}: the limit holds for the queue's jobs together, the queue list
    and why show its use, /metrics its window; null lifts it; each change audited once."""
    first = make_definition(team_a, "rq.one", queue="rq")
    second = make_definition(team_a, "rq.two", queue="rq")
    add_ready_runs(first, 3)
    add_ready_runs(second, 3, prefix="t")
    answer = api_a.put("/api/v1/queues/rq", {"rateLimit": {"count": 4, "periodSeconds": 60}})
    assert answer.status_code == 200, answer.text
    assert answer.json()["rateLimit"] == {"count": 4, "periodSeconds": 60}
    assert (answer.json()["rateUsed"], answer.json()["paused"]) == (0, False)
    assert len(api_a.lease(["rq"], 10)) == 4
    assert api_a.lease(["rq"], 10) == []

    (queue,) = [q for q in api_a.get("/api/v1/queues").json()["results"] if q["name"] == "rq"]
    assert (queue["rateUsed"], queue["rateLimit"]["count"]) == (4, 4)
    reasons = api_a.get("/api/v1/jobs/rq.one/why").json()["reasons"]
    (rate,) = [r for r in reasons if r["code"] == "rate_limit"]
    assert rate["detail"]["queue"] == "rq" and 0 < rate["detail"]["nextSlotInSeconds"] <= 60
    assert "Rate limit of the queue rq: 4/60 s" in rate["message"]
    metrics = api_a.get("/metrics").text
    assert f'scheduler_queue_rate_limit_used{{queue="rq",team="{team_a.slug}"}} 4.0' in metrics
    assert f'scheduler_queue_rate_limit{{queue="rq",team="{team_a.slug}"}} 4.0' in metrics

    # Another team's queue of the same name is its own.
    assert api_b.get("/api/v1/queues").json()["results"] == []
    lifted = api_a.put("/api/v1/queues/rq", {"rateLimit": None})
    assert (lifted.json()["rateLimit"], lifted.json()["rateUsed"]) == (None, None)
    assert len(api_a.lease(["rq"], 10)) == 2
    events = AuditEvent.objects.filter(target_type="queue", target="rq").order_by("id")
    assert [(e.action, e.after["rateLimit"]) for e in events] == [
        ("queue.update", {"count": 4, "periodSeconds": 60}),
        ("queue.update", None),
    ]


@pytest.mark.parametrize(
    "body, field",
    [
        ({"rateLimit": {"count": 0, "periodSeconds": 60}}, "rateLimit.count"),
        ({"rateLimit": {"count": 5}}, "rateLimit.periodSeconds"),
        ({"rateLimit": {"count": 5, "periodSeconds": 60, "burst": 2}}, "rateLimit.burst"),
        ({"paused": "yes"}, "paused"),
        ({"rateLimit": "100/min"}, "rateLimit"),
    ],
)
def test_bad_queue_settings_are_refused_and_change_nothing(api_a, team_a, body, field):
    answer = api_a.put("/api/v1/queues/rq", body)
    assert answer.status_code == 400, answer.text
    assert answer.headers["content-type"].startswith("application/problem+json")
    assert field in answer.json()["errors"]
    assert not Queue.objects.filter(name="rq").exists()
    assert not AuditEvent.objects.filter(target_type="queue").exists()


def test_a_capped_dlq_action_whose_runs_another_took_takes_the_next_ones(
    api_a, team_a, monkeypatch
):
    """A requeue and a discard of everything at once chose the same lowest runs: the one that
    came second changed none of them and answered `count: 0` over thousands still dead. It
    takes the next runs that match, up to the cap."""
    from apps.api import views_manage
    from apps.runs.models import Run
    from tests.conftest import sent_behind_a_change

    monkeypatch.setattr(views_manage, "DLQ_ACTION_MAX", 4)
    definition = make_definition(team_a, "jobs.dead", queue="q")
    ids = add_ready_runs(definition, 10)
    Run.objects.filter(pk__in=ids).update(state="dead", attempt=1)
    # Another session discards the first four (the lowest, which this call chooses too) and
    # commits once the call waits on them.
    answer = sent_behind_a_change(
        ids[3],
        "UPDATE runs_run SET state = 'cancelled' WHERE state = 'dead' AND id <= %s",
        lambda: api_a.post("/api/v1/dlq/requeue", {"filter": {"all": True}}),
    )
    assert answer.status_code == 200, answer.text
    assert answer.json()["count"] == 4
    states = dict(Run.objects.filter(pk__in=ids).values_list("pk", "state"))
    assert [states[pk] for pk in ids] == ["cancelled"] * 4 + ["ready"] * 4 + ["dead"] * 2
