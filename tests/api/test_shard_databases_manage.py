"""Job management, the DLQ, `why` and /metrics with shards on servers of their own: a job by
name is read and written in its shard's database, lists and counts read every database, and a
database that is down is named rather than failing the others."""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

import pytest
from django.db import connections

from apps.jobs.models import JobDefinition, database_of
from apps.runs import retention, shards
from apps.runs.ids import parse_run_id, public_run_id
from apps.runs.models import Run
from tests.conftest import Layout

pytestmark = [
    pytest.mark.slow,
    pytest.mark.physical,
    pytest.mark.django_db(transaction=True, databases="__all__"),
]


def _name_on(alias: str, prefix: str) -> str:
    return next(
        name for name in (f"{prefix}.{n}" for n in range(1000)) if database_of(name) == alias
    )


@contextmanager
def _refused_at_commit(alias: str, table: str, events: str = "INSERT") -> Iterator[None]:
    """Inside the block, a transaction of database `alias` that wrote `events` ("INSERT",
    "INSERT OR UPDATE") to `table` fails at its commit (a deferred constraint trigger raises
    there)."""
    with connections[alias].cursor() as cursor:
        cursor.execute(
            "CREATE FUNCTION refuse_at_commit() RETURNS trigger LANGUAGE plpgsql"
            " AS $$ BEGIN RAISE EXCEPTION 'refused at commit'; END $$;"
            f" CREATE CONSTRAINT TRIGGER refuse_at_commit AFTER {events} ON {table}"
            " DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION refuse_at_commit()"
        )
    try:
        yield
    finally:
        with connections[alias].cursor() as cursor:
            cursor.execute(
                f"DROP TRIGGER refuse_at_commit ON {table}; DROP FUNCTION refuse_at_commit()"
            )


def _job(api, name: str, **fields) -> dict:
    answer = api.put(f"/api/v1/jobs/{name}", {"queue": "q", **fields})
    assert answer.status_code == 201, answer.text
    return answer.json()


def test_a_job_by_name_lives_and_is_managed_in_its_shard_database(layout: Layout, api_a):
    second = layout.aliases[1]
    name = _name_on(second, "billing")

    created = _job(api_a, name, schedule={"cron": "0 3 * * *", "timeZone": "UTC"})
    assert created["name"] == name
    assert JobDefinition.objects.using(second).filter(name=name).exists()
    assert not JobDefinition.objects.using(shards.CONTROL).filter(name=name).exists()

    assert api_a.get(f"/api/v1/jobs/{name}").json()["queue"] == "q"
    patched = api_a.patch(f"/api/v1/jobs/{name}", {"priority": "critical"})
    assert patched.status_code == 200, patched.text
    assert JobDefinition.objects.using(second).get(name=name).priority_name == "critical"
    assert api_a.post(f"/api/v1/jobs/{name}/pause").json()["paused"] is True
    assert JobDefinition.objects.using(second).get(name=name).paused
    assert api_a.post(f"/api/v1/jobs/{name}/resume").json()["paused"] is False

    triggered = api_a.post(f"/api/v1/jobs/{name}/trigger")
    assert triggered.status_code == 201, triggered.text
    run_id = triggered.json()["runId"]
    assert shards.alias_of_run(parse_run_id(run_id)) == second
    why = api_a.get(f"/api/v1/runs/{run_id}/why")
    assert why.status_code == 200, why.text
    assert api_a.get(f"/api/v1/jobs/{name}/why").status_code == 200

    again = api_a.post("/api/v1/jobs", {"name": name, "queue": "q"})
    assert again.status_code == 409  # the name is taken, on its own database

    assert api_a.delete(f"/api/v1/jobs/{name}").status_code == 204
    assert not JobDefinition.objects.using(second).filter(name=name).exists()
    assert not Run.objects.using(second).filter(pk=parse_run_id(run_id)).exists()


def test_the_job_list_merges_every_database_and_names_one_that_is_down(layout: Layout, api_a):
    names = sorted(_job(api_a, _name_on(alias, f"list-{i}"))["name"]
                   for i, alias in enumerate(shards.databases()))  # fmt: skip
    assert [job["name"] for job in api_a.get("/api/v1/jobs").json()["results"]] == names

    dead = layout.aliases[-1]
    on_dead = next(name for name in names if database_of(name) == dead)
    with layout.down(len(layout.servers) - 1):
        listed = api_a.get("/api/v1/jobs")
        one = api_a.get(f"/api/v1/jobs/{on_dead}")
        others = [api_a.get(f"/api/v1/jobs/{name}") for name in names if name != on_dead]
    assert listed.status_code == 200
    assert listed.json()["unavailableShards"] == [shards.span(dead)]
    assert [job["name"] for job in listed.json()["results"]] == [n for n in names if n != on_dead]
    assert one.status_code == 503
    assert one.json()["type"].endswith("/shard-unavailable")
    assert f"shards {shards.span(dead)} are unavailable" in one.json()["detail"]
    assert [answer.status_code for answer in others] == [200] * (len(names) - 1)


def test_jobs_as_code_syncs_and_prunes_across_the_databases(layout: Layout, api_a):
    keep, change, drop = (_name_on(alias, f"sync-{i}") for i, alias in
                          enumerate([layout.aliases[0], layout.aliases[1], layout.aliases[0]]))  # fmt: skip
    for name in (change, drop):
        _job(api_a, name)
    body = {
        "jobs": [{"name": keep, "queue": "q"}, {"name": change, "queue": "other"}],
        "prune": True,
    }
    answer = api_a.put("/api/v1/jobs", body)
    assert answer.status_code == 200, answer.text
    assert answer.json()["summary"] == {"create": 1, "update": 1, "delete": 1, "unchanged": 0}
    assert JobDefinition.objects.using(database_of(keep)).filter(name=keep).exists()
    assert JobDefinition.objects.using(layout.aliases[1]).get(name=change).queue == "other"
    assert not JobDefinition.objects.using(layout.aliases[0]).filter(name=drop).exists()

    with layout.down(1):
        refused = api_a.put("/api/v1/jobs", {"jobs": [{"name": keep, "queue": "q"}]})
    assert refused.status_code == 503  # a plan must see every database
    assert refused.json()["type"].endswith("/shard-unavailable")


def test_dlq_requeue_by_filter_takes_every_databases_dead_runs(layout: Layout, api_a, team_a):
    jobs = {alias: layout.job_on(alias, team_a, "dlq") for alias in shards.databases()}
    dead = {alias: [run.pk for run in layout.dead_runs(job, 3, "d")] for alias, job in jobs.items()}
    listed = api_a.get("/api/v1/dlq?limit=100").json()["results"]
    assert len(listed) == 3 * len(jobs)

    with layout.down(1):
        refused = api_a.post("/api/v1/dlq/requeue", {"filter": {"queue": "q"}})
    assert refused.status_code == 503
    for alias, ids in dead.items():  # nothing was requeued anywhere
        assert set(Run.objects.using(alias).filter(pk__in=ids).values_list("state", flat=True)) == {
            "dead"
        }

    requeued = api_a.post("/api/v1/dlq/requeue", {"filter": {"queue": "q"}})
    assert requeued.status_code == 200, requeued.text
    assert requeued.json()["count"] == 3 * len(jobs)
    for alias, ids in dead.items():
        assert set(Run.objects.using(alias).filter(pk__in=ids).values_list("state", flat=True)) == {
            "ready"
        }
    one = dead[layout.aliases[1]][:1]
    with connections[layout.aliases[1]].cursor() as cursor:
        cursor.execute("UPDATE runs_run SET state = 'dead' WHERE id = ANY(%s)", [one])
    by_id = api_a.post("/api/v1/dlq/discard", {"runIds": [public_run_id(pk) for pk in one]})
    assert by_id.json()["count"] == 1
    assert Run.objects.using(layout.aliases[1]).get(pk=one[0]).state == "cancelled"


def _gauge(text: str, name: str, labels: str) -> float:
    match = re.search(rf"^{name}\{{{re.escape(labels)}\}} (\S+)$", text, re.MULTILINE)
    assert match, f"{name}{{{labels}}} not in /metrics"
    return float(match.group(1))


def test_metrics_report_each_shard_database(layout: Layout, api_a, team_a):
    for alias in shards.databases():
        definition = layout.job_on(alias, team_a, "metric")
        layout.dead_runs(definition, 2, "m")
        layout.new_runs(definition, 1, "ready")
    text = api_a.get("/metrics").text
    for alias in shards.databases():
        labels = f'shards="{shards.span(alias)}"'
        assert _gauge(text, "scheduler_shard_database_up", labels) == 1
        assert _gauge(text, "scheduler_shard_database_depth", labels) == 1
    assert _gauge(text, "scheduler_dlq_size", f'team="{team_a.slug}"') == 2 * len(
        shards.databases()
    )

    with layout.down(1):
        text = api_a.get("/metrics").text
    down = f'shards="{shards.span(layout.aliases[1])}"'
    assert _gauge(text, "scheduler_shard_database_up", down) == 0
    assert f"scheduler_shard_database_depth{{{down}}}" not in text
    assert _gauge(text, "scheduler_dlq_size", f'team="{team_a.slug}"') == 2 * (
        len(shards.databases()) - 1
    )


def test_retention_deletes_old_finished_runs_on_every_database(layout: Layout, api_a, team_a):
    ids = {}
    for alias in shards.databases():
        ids[alias] = layout.new_runs(layout.job_on(alias, team_a, "old"), 3, "o")
        with connections[alias].cursor() as cursor:
            cursor.execute(
                "UPDATE runs_run SET state = 'succeeded',"
                " finished_at = now() - interval '400 days' WHERE id = ANY(%s)",
                [ids[alias][:2]],
            )
    retention.handle_one_round(batch=100)
    for alias, made in ids.items():
        assert list(Run.objects.using(alias).filter(pk__in=made).values_list("pk", flat=True)) == [
            made[2]
        ]


def test_a_sync_failing_on_one_database_keeps_the_events_of_those_that_committed(
    layout: Layout, team_a
):
    """A sync writes in one transaction per database, committed one after the other (not
    two-phase): when a database fails at its commit after another has committed, the changes
    that committed keep their audit events (kept in their own database's transaction, then
    relayed to the trail), and those that rolled back have none."""
    from apps.api.shapes.jobs import parse_definition
    from apps.audit.models import AuditEvent, PendingEvent
    from apps.audit.record import Actor
    from apps.jobs import sync

    # Databases commit in the reverse of their order: the first shard database of its own
    # commits after the last.
    failing, committing = layout.aliases[0], layout.aliases[-1]
    kept, lost = _name_on(committing, "kept"), _name_on(failing, "lost")
    entries = [{"name": kept, "queue": "q"}, {"name": lost, "queue": "q"}]
    plan = sync.plan_sync(team_a, sync.validate(entries, parse_definition), prune=False)
    with _refused_at_commit(failing, "jobs_jobdefinition"):
        with pytest.raises(sync.PartlyApplied, match="1 of 2 changes were applied") as raised:
            sync.apply_sync(plan, Actor.cli("deploy"))
    assert (raised.value.applied, raised.value.not_applied) == ([kept], [lost])
    assert "refused at commit" in str(raised.value.__cause__.__cause__)
    assert JobDefinition.objects.using(committing).filter(name=kept).exists()
    assert not JobDefinition.objects.using(failing).filter(name=lost).exists()
    created = AuditEvent.objects.filter(action="job.create")
    assert list(created.values_list("target", "actor")) == [(kept, "deploy")]
    assert created.get().relayed_from is not None
    assert not PendingEvent.objects.using(committing).exists()  # relayed, not left


def test_a_sync_whose_first_database_refuses_its_commit_changes_nothing_and_says_so(
    layout: Layout, api_a
):
    """The first database to commit refusing it left every change undone: a 500 said so no
    better than a crash. A 503: nothing was changed, try again."""
    names = [_name_on(alias, "first") for alias in layout.aliases]
    with ExitStack() as refusing:
        for alias in layout.aliases:
            refusing.enter_context(_refused_at_commit(alias, "jobs_jobdefinition"))
        answer = api_a.put("/api/v1/jobs", {"jobs": [{"name": n, "queue": "q"} for n in names]})
    assert answer.status_code == 503, answer.text
    assert answer.headers["Retry-After"] == "1"
    assert answer.json()["detail"].endswith("; nothing was changed; try again.")
    assert "refused this change at its commit" in answer.json()["detail"]
    for alias in layout.aliases:
        assert not JobDefinition.objects.using(alias).filter(name__in=names).exists()


def test_a_sync_failing_on_one_database_answers_what_it_made_and_is_finished_when_sent_again(
    layout: Layout, api_a, live_server, token_a
):
    """A sync whose second database fails at its commit after the first committed answered a
    503 over changes made: a client reading it as "nothing changed" was wrong. It answers 207
    naming what was made and what was not; the same body sent again makes the rest. The client
    library retries it as a 503, then raises SyncIncomplete with the answer."""
    from cronlease_client import Client, SyncIncomplete

    failing, committing = layout.aliases[0], layout.aliases[-1]
    kept, lost = _name_on(committing, "kept"), _name_on(failing, "lost")
    body = {"jobs": [{"name": kept, "queue": "q"}, {"name": lost, "queue": "q"}]}
    with _refused_at_commit(failing, "jobs_jobdefinition"):
        # The client library first: its second try, the first having made `kept`, is left
        # with `lost` alone (one try would answer both).
        with Client(live_server.url, token_a, retries=1, backoff_base=0.01) as client:
            with pytest.raises(SyncIncomplete) as raised:
                client.apply_jobs(body["jobs"])
        assert [(c.name, c.applied) for c in raised.value.result.changes] == [(lost, False)]
        JobDefinition.objects.using(committing).filter(name=kept).delete()
        answer = api_a.put("/api/v1/jobs", body)
        assert answer.status_code == 207, answer.text
        assert answer.headers["Retry-After"] == "1"
        made = answer.json()
        assert (made["applied"], made["complete"]) == (True, False)
        assert {c["name"]: c["applied"] for c in made["changes"]} == {kept: True, lost: False}
        assert lost in made["detail"] and "Send the same body again" in made["detail"]
    assert JobDefinition.objects.using(committing).filter(name=kept).exists()
    assert not JobDefinition.objects.using(failing).filter(name=lost).exists()

    again = api_a.put("/api/v1/jobs", body)
    assert again.status_code == 200, again.text
    assert again.json()["complete"] is True
    assert [(c["name"], c["applied"]) for c in again.json()["changes"]] == [(lost, True)]
    assert JobDefinition.objects.using(failing).filter(name=lost).exists()


def test_a_dlq_action_on_runs_of_two_databases_one_down_answers_what_it_changed(
    layout: Layout, api_a, team_a, live_server, token_a
):
    """Runs are changed one database after the other: when a later one fails at its commit
    (or goes down after the runs were read), the earlier ones' changes stand, and the answer
    said 5xx over them. It answers 207 with the runs changed and the shards whose runs were
    not; the same call again changes those. A database down before anything changed is a 503."""
    from cronlease_client import Client, Unavailable

    one = layout.dead_runs(layout.job_on(layout.aliases[0], team_a, "one"), 1, "o")[0]
    two = layout.dead_runs(layout.job_on(layout.aliases[1], team_a, "two"), 1, "t")[0]
    first, later = sorted([one, two], key=lambda run: run.pk)  # the order they are changed in
    down = layout.aliases.index(shards.alias_of_run(later.pk))
    body = {"runIds": [one.run_id, two.run_id]}
    span = shards.span(layout.aliases[down])
    with _refused_at_commit(layout.aliases[down], "audit_pendingevent"):
        with Client(live_server.url, token_a, retries=0) as client:
            result = client.requeue(body["runIds"])
    with layout.down(down), Client(live_server.url, token_a, retries=0) as client:
        with pytest.raises(Unavailable):  # nothing changed
            client.requeue(body["runIds"])
    assert (result.count, result.run_ids, result.unavailable_shards) == (
        1, (first.run_id,), (span,)
    )  # fmt: skip
    assert Run.objects.using(shards.alias_of_run(first.pk)).get(pk=first.pk).state == "ready"
    assert Run.objects.using(layout.aliases[down]).get(pk=later.pk).state == "dead"

    again = api_a.post("/api/v1/dlq/requeue", body)
    assert again.status_code == 200 and again.json()["runIds"] == [later.run_id], again.text
    # The 207 as it is on the wire.
    more = layout.dead_runs(layout.job_on(layout.aliases[0], team_a, "three"), 1, "p")[0]
    other = layout.dead_runs(layout.job_on(layout.aliases[1], team_a, "four"), 1, "q")[0]
    first, later = sorted([more, other], key=lambda run: run.pk)
    down = layout.aliases.index(shards.alias_of_run(later.pk))
    with _refused_at_commit(layout.aliases[down], "audit_pendingevent"):
        answer = api_a.post("/api/v1/dlq/discard", {"runIds": [more.run_id, other.run_id]})
    assert answer.status_code == 207, answer.text
    assert answer.headers["Retry-After"] == "1"
    assert answer.json() == {
        "count": 1,
        "runIds": [first.run_id],
        "unavailableShards": [shards.span(layout.aliases[down])],
    }


def test_kept_audit_events_a_request_could_not_relay_are_relayed_once_by_retention(
    layout: Layout, api_a
):
    """A request whose relay failed (the trail refused it at its commit) leaves its
    events kept in the shard database: the scheduler's retention round relays them, and a relay
    repeated after a failure at its last step adds each to the trail once."""
    from apps.audit import record
    from apps.audit.models import AuditEvent, PendingEvent

    name = _name_on(layout.aliases[1], "relay")
    with _refused_at_commit(shards.CONTROL, "audit_auditevent"):
        _job(api_a, name)
    kept = PendingEvent.objects.using(layout.aliases[1])
    assert list(kept.values_list("action", "target")) == [("job.create", name)]
    assert not AuditEvent.objects.filter(action="job.create").exists()

    # A relay whose trail committed, its delete of the kept events not.
    (pending,) = kept.all()
    with connections[layout.aliases[1]].cursor() as cursor:
        cursor.execute(record.TAKE_PENDING, {"batch": 10})
        rows = cursor.fetchall()
    record.copy_to_trail(rows)
    assert AuditEvent.objects.filter(action="job.create").count() == 1

    retention.handle_one_round()
    (event,) = AuditEvent.objects.filter(action="job.create")
    assert (event.target, event.relayed_from, event.team_id) == (name, pending.id, pending.team_id)
    assert event.created_at == pending.created_at
    assert not kept.all().exists()


def test_a_blob_let_go_while_another_database_is_down_is_deleted_once_it_is_back(
    layout: Layout, api_a, payload_folder
):
    """Whether another database's rows still refer to the blob cannot be told while it is
    down: nothing is deleted then, and the blob was left for good (its last referring row was
    gone, and only the deletion of one tried again). It is kept as stranded for retention."""
    from apps.runs.models import PayloadBlob

    name = _name_on(layout.aliases[1], "big")
    big = {"rows": ["u" * 100 for _ in range(100)]}
    _job(api_a, name, payload=big)
    (key,) = JobDefinition.objects.using(layout.aliases[1]).values_list("payload_key", flat=True)
    with layout.down(0):
        assert api_a.delete(f"/api/v1/jobs/{name}").status_code == 204
        retention.handle_one_round()  # still down: kept
    assert (payload_folder / key).exists()
    assert PayloadBlob.objects.get(key=key).stranded_at is not None
    retention.handle_one_round()
    assert not (payload_folder / key).exists()
    assert not PayloadBlob.objects.filter(key=key).exists()


def test_a_cancel_whose_control_database_fails_at_commit_keeps_its_event(
    layout: Layout, api_a, team_a
):
    """A run's change commits in its shard database; its event was written in the control
    database's transaction, committed after: that commit failing left the run cancelled and no
    event of it. The event is kept with the run's change, and relayed once the trail takes it."""
    from apps.audit.models import AuditEvent

    job = layout.job_on(layout.aliases[1], team_a, "cancel")
    (run_pk,) = layout.new_runs(job, 1, "c")
    with _refused_at_commit(shards.CONTROL, "audit_auditevent"):
        answer = api_a.post(f"/api/v1/runs/{public_run_id(run_pk)}/cancel")
    assert answer.status_code == 200, answer.text
    assert Run.objects.using(layout.aliases[1]).get(pk=run_pk).state == "cancelled"
    assert not AuditEvent.objects.filter(action="run.cancel").exists()  # not relayed yet
    retention.handle_one_round()
    (event,) = AuditEvent.objects.filter(action="run.cancel")
    assert event.target == public_run_id(run_pk)


def test_a_producers_runs_keep_their_event_when_the_trail_fails_at_its_commit(
    layout: Layout, api_a, team_a
):
    """A producer's runs commit in their shard database; their `run.create` event was written
    in the control database's transaction, committed after: that commit failing answered 500
    for runs that were made, and lost their event (a retry with the key answered 200). The
    event is kept with the runs, and relayed once the trail takes it."""
    from apps.audit.models import AuditEvent

    job = layout.job_on(layout.aliases[1], team_a, "produced")
    items = [{"job": job.name, "idempotencyKey": f"order-{n}"} for n in range(3)]
    with _refused_at_commit(shards.CONTROL, "audit_auditevent"):
        answer = api_a.post("/api/v1/runs", {"runs": items})
    assert answer.status_code == 200, answer.text
    assert [item["status"] for item in answer.json()["runs"]] == [201, 201, 201]
    made = Run.objects.using(layout.aliases[1]).filter(definition_id=job.pk)
    assert made.count() == 3
    assert not AuditEvent.objects.filter(action="run.create").exists()  # not relayed yet
    retention.handle_one_round()
    (event,) = AuditEvent.objects.filter(action="run.create")
    assert (event.target, event.after["count"]) == ("3 runs", 3)
    assert sorted(event.after["runIds"]) == sorted(run.run_id for run in made)
    again = api_a.post("/api/v1/runs", {"runs": items})
    assert [item["status"] for item in again.json()["runs"]] == [200, 200, 200]
    assert AuditEvent.objects.filter(action="run.create").count() == 1


def test_a_bulk_action_by_filter_keeps_its_events_with_the_runs_of_each_database(
    layout: Layout, team_a
):
    """The dashboard's action on every run matching a filter changed each database's runs and
    wrote one event per team last, in the control database: that commit failing failed the
    action after the runs were requeued, and lost its event. Each database's runs keep an
    event of their own (its count, its shards)."""
    from apps.audit.models import AuditEvent
    from apps.audit.record import Actor
    from apps.runs import filters, transitions

    def requeue(flt: dict) -> int:
        return transitions.act_on_matching(
            "requeue", [team_a], ["dead"], filters.parse_bulk_filter(flt), Actor.cli("oncall")
        )

    job = layout.job_on(layout.aliases[1], team_a, "bulk")
    dead = [run.pk for run in layout.dead_runs(job, 3, "d")]
    with _refused_at_commit(shards.CONTROL, "audit_auditevent"):
        assert requeue({"job": job.name}) == 3
    states = (
        Run.objects.using(layout.aliases[1]).filter(pk__in=dead).values_list("state", flat=True)
    )
    assert set(states) == {"ready"}
    assert not AuditEvent.objects.filter(action="dlq.requeue").exists()  # not relayed yet
    retention.handle_one_round()
    (event,) = AuditEvent.objects.filter(action="dlq.requeue")
    assert event.after == {"state": "ready", "count": 3, "shards": shards.span(layout.aliases[1])}
    assert event.before["filter"] == {"job": job.name}

    # Across databases: one event each, their counts adding up to the action's.
    for alias in shards.databases():
        layout.dead_runs(layout.job_on(alias, team_a, "every"), 2, "e")
    assert requeue({"queue": "q"}) == 2 * len(shards.databases())
    events = AuditEvent.objects.filter(action="dlq.requeue").exclude(pk=event.pk)
    assert sorted(e.after["shards"] for e in events) == sorted(map(shards.span, shards.databases()))
    assert sum(e.after["count"] for e in events) == 2 * len(shards.databases())
