"""A request that writes to several shard databases commits them one after the other (not
two-phase). When one fails at its commit, whatever the error (a deferred constraint trigger
that raises there stands in for it), what the others committed stands and is answered as such:
never a 5xx over a commit, never a lease that is not answered, nothing left half-open."""

from __future__ import annotations

import pytest
from django.db import connections

from apps.runs import shards
from apps.runs.models import Run
from tests.api.test_shard_databases_manage import _refused_at_commit
from tests.conftest import Layout

pytestmark = [
    pytest.mark.slow,
    pytest.mark.physical,
    pytest.mark.django_db(transaction=True, databases="__all__"),
]


def _jobs_everywhere(layout: Layout, team, prefix: str) -> dict[str, object]:
    return {alias: layout.job_on(alias, team, f"{prefix}{n}") for n, alias in
            enumerate(shards.databases())}  # fmt: skip


def test_a_claim_whose_database_fails_at_its_commit_answers_the_others_and_leaves_none_open(
    layout: Layout, api_a, team_a
):
    """The claim's database that raised at its commit (not a lost connection) ended the request
    in a 500 after the others had committed: their leases were never answered, and the web
    process kept a transaction open on the databases after it, answering 500 for them until it
    was restarted."""
    jobs = _jobs_everywhere(layout, team_a, "claim")
    for job in jobs.values():
        layout.new_runs(job, 2, "c")
    failing = layout.aliases[0]
    with _refused_at_commit(failing, "runs_attempt"):
        answer = api_a.post("/api/v1/leases", {"queues": ["q"], "max": 100, "workerId": "w"})
    assert answer.status_code == 200, answer.text
    leased = {lease["runId"] for lease in answer.json()["leases"]}
    for alias in shards.databases():
        rows = Run.objects.using(alias).filter(state="leased")
        assert {run.run_id for run in rows} <= leased  # every run leased is answered
        assert rows.count() == (0 if alias == failing else 2), alias
    # Every database answers afterwards.
    for alias, job in jobs.items():
        assert api_a.get(f"/api/v1/jobs/{job.name}").status_code == 200, alias


def test_results_and_heartbeats_of_a_database_failing_at_its_commit_answer_503_alone(
    layout: Layout, api_a, team_a
):
    jobs = _jobs_everywhere(layout, team_a, "done")
    for job in jobs.values():
        layout.new_runs(job, 1, "d")
    leases = api_a.lease(["q"], 100)
    assert len(leases) == len(jobs)
    failing = layout.aliases[0]
    on_failing = {r.run_id for r in Run.objects.using(failing).filter(state="leased")}
    beats = [{"runId": lease["runId"], "fencingToken": lease["fencingToken"]} for lease in leases]
    results = [{**beat, "outcome": "succeeded"} for beat in beats]
    with _refused_at_commit(failing, "runs_run", "UPDATE"):
        beat = api_a.post("/api/v1/heartbeats", {"leases": beats})
        done = api_a.post("/api/v1/results", {"results": results})
    for answer in (beat, done):
        assert answer.status_code == 200, answer.text
        key = "leases" if answer is beat else "results"
        statuses = {item["runId"]: item["status"] for item in answer.json()[key]}
        assert {run for run, status in statuses.items() if status == 503} == on_failing
    for alias in shards.databases():
        states = set(Run.objects.using(alias).values_list("state", flat=True))
        assert states == ({"leased"} if alias == failing else {"succeeded"}), alias


@pytest.mark.parametrize("where", ["control", "shard"])
def test_a_bulk_enqueue_whose_database_fails_at_its_commit_answers_the_others_created(
    layout: Layout, api_a, team_a, where
):
    """The control database's transaction commits last (it holds the batch's payload holds):
    when it failed, the runs other databases had committed were answered 503 with the rest, and
    a retry without keys made them twice. A shard database that raised at its commit gave a
    500 likewise."""
    jobs = _jobs_everywhere(layout, team_a, "enq")
    failing = shards.CONTROL if where == "control" else layout.aliases[-1]
    items = [{"job": job.name, "idempotencyKey": f"{alias}-{n}"}
             for alias, job in jobs.items() for n in range(2)]  # fmt: skip
    with _refused_at_commit(failing, "runs_run"):
        answer = api_a.post("/api/v1/runs", {"runs": items})
    assert answer.status_code == 200, answer.text
    for item, run in zip(items, answer.json()["runs"], strict=True):
        alias = item["idempotencyKey"].rsplit("-", 1)[0]
        made = Run.objects.using(alias).filter(idempotency_key=item["idempotencyKey"]).exists()
        assert run["status"] == (503 if alias == failing else 201), (item, run)
        assert made == (alias != failing), item


def test_a_dlq_action_whose_control_database_fails_changes_nothing_elsewhere(
    layout: Layout, api_a, team_a
):
    """The control database's runs were changed in a transaction committed after the others':
    its failure answered 503 over runs changed on every other database. It commits first now:
    its failure changes nothing, and says so."""
    dead = [
        run
        for alias in shards.databases()
        for run in layout.dead_runs(layout.job_on(alias, team_a, f"dlq{alias}"), 1, "x")
    ]
    with _refused_at_commit(shards.CONTROL, "runs_run", "UPDATE"):
        answer = api_a.post("/api/v1/dlq/requeue", {"runIds": [run.run_id for run in dead]})
    assert answer.status_code in (500, 503), answer.text
    for run in dead:
        alias = shards.alias_of_run(run.pk)
        assert Run.objects.using(alias).get(pk=run.pk).state == "dead", alias
    assert not connections[shards.CONTROL].in_atomic_block
