"""A request that writes to several shard databases commits them one after the other (not
two-phase). When one fails at its commit, whatever the error (a deferred constraint trigger
that raises there stands in for it), what the others committed stands and is answered as such:
never a 5xx over a commit, never a lease that is not answered, nothing left half-open."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

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
        # Said as what happened: the database answered, and refused (not "cannot be reached").
        details = {item.get("detail") for item in answer.json()[key] if item["status"] == 503}
        assert details == {
            f"the database of shards {shards.span(failing)} refused the change at its commit"
            " (RaiseException); nothing of it was written"
        }
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
    assert answer.status_code == 503, answer.text  # a 500 before, though nothing had changed
    assert answer.headers["Retry-After"] == "1"
    assert answer.json()["detail"] == (
        "The database refused this change at its commit (RaiseException, SQLSTATE P0001);"
        " nothing was changed; try again."
    )
    for run in dead:
        alias = shards.alias_of_run(run.pk)
        assert Run.objects.using(alias).get(pk=run.pk).state == "dead", alias
    assert not connections[shards.CONTROL].in_atomic_block


@pytest.mark.parametrize("path", ["/api/v1/leases", "/api/v1/results"])
def test_results_naming_another_teams_run_are_answered_when_the_trail_fails(
    layout: Layout, api_a, api_b, team_a, team_b, path
):
    """A result naming another team's run is audited as a denial in the control database,
    after the items' own changes committed: a trail refusing it turned the answer into a 500
    over a result that had been recorded."""
    mine = layout.job_on(layout.aliases[0], team_a, "own")
    theirs = layout.job_on(layout.aliases[1], team_b, "their")
    layout.new_runs(mine, 1, "m")
    layout.new_runs(theirs, 1, "t")
    (own,) = api_a.lease(["q"], 1)
    (other,) = api_b.lease(["q"], 1)
    results = [
        {"runId": lease["runId"], "fencingToken": lease["fencingToken"], "outcome": "succeeded"}
        for lease in (own, other)
    ]
    body = {"results": results}
    if path.endswith("leases"):
        body |= {"queues": ["q"], "max": 1, "workerId": "w"}
    with _refused_at_commit(shards.CONTROL, "audit_auditevent"):
        answer = api_a.post(path, body)
    assert answer.status_code == 200, answer.text
    statuses = [item["status"] for item in answer.json()["results"]]
    assert statuses == [200, 404]
    assert Run.objects.using(layout.aliases[0]).get(state="succeeded").run_id == own["runId"]
    assert Run.objects.using(layout.aliases[1]).get().state == "leased"


@contextmanager
def _connection_lost_on_insert(alias: str, table: str) -> Iterator[None]:
    """Inside the block, the session that inserts into `table` of database `alias` loses its
    connection there (its backend is terminated by its own trigger)."""
    with connections[alias].cursor() as cursor:
        cursor.execute(
            "CREATE FUNCTION lose_connection() RETURNS trigger LANGUAGE plpgsql AS $$"
            " BEGIN PERFORM pg_terminate_backend(pg_backend_pid()); RETURN NEW; END $$;"
            f" CREATE TRIGGER lose_connection AFTER INSERT ON {table}"
            " FOR EACH ROW EXECUTE FUNCTION lose_connection()"
        )
    try:
        yield
    finally:
        with connections[alias].cursor() as cursor:
            cursor.execute(
                f"DROP TRIGGER lose_connection ON {table}; DROP FUNCTION lose_connection()"
            )


@pytest.mark.parametrize("action", ["cancel", "retry"])
def test_a_run_changed_whose_event_the_trail_lost_is_answered_as_changed(
    layout: Layout, api_a, team_a, action
):
    """The change of one run commits in its shard database, its event is then copied to the
    trail: a connection lost there was left to the answer, which read the clock on it and said
    503 over a run that had changed (the event is relayed later all the same)."""
    from apps.audit.models import PendingEvent

    job = layout.job_on(layout.aliases[0], team_a, "one")
    if action == "cancel":
        (pk,) = layout.new_runs(job, 1, "c")
    else:
        pk = layout.dead_runs(job, 1, "r")[0].pk
        Run.objects.using(layout.aliases[0]).filter(pk=pk).update(state="retrying")
    run = Run.objects.using(layout.aliases[0]).get(pk=pk)
    with _connection_lost_on_insert(shards.CONTROL, "audit_auditevent"):
        answer = api_a.post(f"/api/v1/runs/{run.run_id}/{action}", {})
    assert answer.status_code == 200, answer.text
    state = Run.objects.using(layout.aliases[0]).get(pk=pk).state
    assert answer.json()["state"] == state == ("cancelled" if action == "cancel" else "ready")
    assert PendingEvent.objects.using(layout.aliases[0]).count() == 1  # kept for the relay


def test_a_scheduler_tick_goes_on_past_a_database_that_fails_at_its_commit(layout, team_a):
    """A shard database raising at its commit (not a lost connection) failed every tick at its
    reap, before any cron time of the other databases was materialised, and before retention
    and the audit relay ran."""
    from apps.scheduler.daemon import Scheduler
    from tests.conftest import db_now

    victim = min(layout.aliases, key=lambda alias: shards.shards_on(alias)[0])
    jobs = {alias: layout.job_on(alias, team_a, f"tick{n}")
            for n, alias in enumerate(shards.databases())}  # fmt: skip
    scheduler = Scheduler(node_id="test-node")
    scheduler.tick()  # takes every shard; nothing is due yet
    layout.due_every_minute(jobs.values())
    expired = layout.leased_runs(jobs[victim], 1)
    Run.objects.using(victim).filter(pk=expired[0].pk).update(lease_expires_at=db_now())
    with _refused_at_commit(victim, "runs_run", "INSERT OR UPDATE"):
        scheduler.tick()
    for alias, job in jobs.items():
        made = Run.objects.using(alias).filter(definition_id=job.pk, trigger="cron").exists()
        assert made == (alias != victim), alias
    scheduler.tick()  # back: its shards catch up
    assert Run.objects.using(victim).filter(definition_id=jobs[victim].pk, trigger="cron").exists()
    assert Run.objects.using(victim).get(pk=expired[0].pk).state != "leased"
