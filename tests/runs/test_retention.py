"""Retention deletes old finished runs in batches, keeps the DLQ, and never blocks claims."""

from __future__ import annotations

import logging
import threading

import pytest
from django.db import connection, connections

from apps.audit.models import AuditEvent
from apps.runs import retention, store
from apps.runs.models import Attempt, Run
from apps.teams.models import Team
from tests.conftest import add_ready_runs, everywhere, make_definition
from tests.runs.test_claim_concurrency import run_in_threads

pytestmark = pytest.mark.django_db(transaction=True)


def age_finished(days: int) -> None:
    with connection.cursor() as cursor:
        cursor.execute(
            "UPDATE runs_run SET finished_at = now() - make_interval(days => %s) WHERE finished_at IS NOT NULL",
            [days],
        )


def finish_all(team, queue: str, *, fail: bool = False) -> None:
    while leases := store.claim(queues=[queue], max_runs=100, worker_id="w", lease_seconds=60):
        if fail:
            store.fail(
                [(lease.id, lease.fencing_token, {"message": "x"}, False) for lease in leases],
                team_ids=[team.pk],
            )
        else:
            store.complete(
                [(lease.id, lease.fencing_token, None) for lease in leases], team_ids=[team.pk]
            )


def test_removes_only_old_finished_runs_in_batches(team_a, settings):
    old = make_definition(team_a, "ret.old", queue="old")
    dlq = make_definition(team_a, "ret.dead", queue="dead", retry_max_attempts=1)
    add_ready_runs(old, 25)
    add_ready_runs(dlq, 5)
    finish_all(team_a, "old")
    finish_all(team_a, "dead", fail=True)
    age_finished(40)
    fresh = make_definition(team_a, "ret.fresh", queue="fresh")
    add_ready_runs(fresh, 5)
    finish_all(team_a, "fresh")
    waiting = make_definition(team_a, "ret.waiting", queue="waiting")
    add_ready_runs(waiting, 3)

    assert retention.delete_one_batch(team_a.pk, 30, 10) == 10  # one small batch at a time
    while retention.delete_one_batch(team_a.pk, 30, 10):
        pass
    remaining = Run.objects.values_list("definition__name", "state")
    assert sorted({name for name, _ in remaining}) == ["ret.dead", "ret.fresh", "ret.waiting"]
    assert Run.objects.filter(state="dead").count() == 5
    assert not Attempt.objects.filter(run__definition=old).exists()


def test_team_retention_overrides_the_default(team_a, team_b):
    team_b.retention_days = 100
    team_b.save()
    for team, name in ((team_a, "a.job"), (team_b, "b.job")):
        add_ready_runs(make_definition(team, name, queue=name), 3)
        finish_all(team, name)
    age_finished(40)
    while retention.handle_one_round(batch=2):
        pass
    assert list(Run.objects.values_list("definition__name", flat=True).distinct()) == ["b.job"]


def test_a_team_retention_of_zero_days_is_zero_not_the_default(team_a):
    """None is the site's default; 0 was read as none and kept the runs 30 days."""
    team_a.retention_days = 0
    team_a.save()
    add_ready_runs(make_definition(team_a, "ret.zero", queue="zero"), 3)
    finish_all(team_a, "zero")
    age_finished(1)
    while retention.handle_one_round(batch=10):
        pass
    assert not Run.objects.exists()


def old_audit_event() -> None:
    AuditEvent.objects.create(
        actor="x", source="system", action="old.event", target_type="t", target="1"
    )
    with connection.cursor() as cursor:
        cursor.execute(
            "UPDATE audit_auditevent SET created_at = now() - interval '400 days'"
            " WHERE action = 'old.event'"
        )


def test_a_team_retention_past_a_hundred_years_keeps_its_runs_and_holds_back_nothing(
    team_a, team_b
):
    """A team's retention_days takes what the column holds (set in the database or a shell):
    2 000 000 000 days ago is no date PostgreSQL has, and every round failed on it ("timestamp
    out of range"), for every team, the audit trail and idle workers. It counts as 100 years,
    the bound of the site's own setting."""
    Team.objects.filter(pk=team_b.pk).update(retention_days=2_000_000_000)
    for team, name in ((team_a, "a.job"), (team_b, "b.job")):
        add_ready_runs(make_definition(team, name, queue=name), 3)
        finish_all(team, name)
    age_finished(40)
    old_audit_event()
    while retention.handle_one_round(batch=2):
        pass
    assert list(Run.objects.values_list("definition__name", flat=True).distinct()) == ["b.job"]
    assert not AuditEvent.objects.filter(action="old.event").exists()


def test_a_team_whose_batch_fails_is_logged_and_holds_back_no_other(team_a, team_b, caplog):
    """An error deleting one team's runs stopped the round: no other team's runs, no audit
    event, idle worker or stranded payload were deleted, round after round."""
    for team, name in ((team_a, "a.job"), (team_b, "b.job")):
        add_ready_runs(make_definition(team, name, queue=name), 3)
        finish_all(team, name)
    age_finished(40)
    old_audit_event()
    everywhere(
        "CREATE FUNCTION refuse_delete() RETURNS trigger LANGUAGE plpgsql"
        " AS $$ BEGIN RAISE EXCEPTION 'refused'; END $$;"
        " CREATE TRIGGER refuse_delete BEFORE DELETE ON runs_run FOR EACH ROW"
        f" WHEN (OLD.team_id = {team_a.pk}) EXECUTE FUNCTION refuse_delete()"
    )
    try:
        with caplog.at_level(logging.ERROR, logger="apps.runs.retention"):
            while retention.handle_one_round(batch=2):
                pass
    finally:
        everywhere("DROP TRIGGER refuse_delete ON runs_run; DROP FUNCTION refuse_delete()")
    assert list(Run.objects.values_list("definition__name", flat=True).distinct()) == ["a.job"]
    assert not AuditEvent.objects.filter(action="old.event").exists()
    assert f"retention of team {team_a.pk} on shards" in caplog.text


def test_a_run_discarded_from_the_dlq_is_kept_for_the_retention_after_its_discard(team_a):
    """Counted from its death, a run that sat in the DLQ longer than the retention was deleted
    by the next round, seconds after its discard ("its history stays readable")."""
    from apps.audit.record import Actor
    from apps.runs import filters, transitions

    dlq = make_definition(team_a, "ret.discarded", queue="discarded", retry_max_attempts=1)
    add_ready_runs(dlq, 4)
    finish_all(team_a, "discarded", fail=True)
    age_finished(40)
    one, by_filter, *_ = Run.objects.filter(definition=dlq).order_by("pk")
    assert transitions.discard([one], Actor.cli()) == [one]
    Run.objects.filter(pk=by_filter.pk).update(queue="elsewhere")
    flt = filters.parse_bulk_filter({"queue": "elsewhere"})
    assert transitions.act_on_matching("discard", [team_a], ["dead"], flt, Actor.cli()) == 1
    while retention.handle_one_round(batch=10):
        pass
    states = dict(Run.objects.filter(definition=dlq).values_list("pk", "state"))
    assert states.pop(one.pk) == states.pop(by_filter.pk) == "cancelled"
    assert list(states.values()) == ["dead", "dead"]


def test_old_audit_events_go(team_a, settings):
    settings.SCHEDULER_AUDIT_RETENTION_DAYS = 365
    AuditEvent.objects.create(actor="x", source="system", action="a", target_type="t", target="1")
    AuditEvent.objects.create(actor="x", source="system", action="b", target_type="t", target="2")
    with connection.cursor() as cursor:
        cursor.execute(
            "UPDATE audit_auditevent SET created_at = now() - interval '400 days' WHERE action = 'a'"
        )
    retention.handle_one_round()
    assert list(AuditEvent.objects.values_list("action", flat=True)) == ["b"]


def test_workers_keep_claiming_while_retention_runs(team_a):
    old = make_definition(team_a, "ret.bulk", queue="old")
    add_ready_runs(old, 2000)
    finish_all(team_a, "old")
    age_finished(40)
    live = make_definition(team_a, "ret.live", queue="live")
    ids = add_ready_runs(live, 600)
    stop = threading.Event()

    def retain() -> int:
        deleted = 0
        while batch := retention.delete_one_batch(team_a.pk, 30, 50):
            deleted += batch
        stop.set()
        return deleted

    def claim(index: int) -> list[int]:
        taken = []
        while batch := store.claim(
            queues=["live"], max_runs=10, worker_id=f"w{index}", lease_seconds=60
        ):
            store.complete(
                [(lease.id, lease.fencing_token, None) for lease in batch], team_ids=[team_a.pk]
            )
            taken += [lease.id for lease in batch]
        return taken

    results = run_in_threads(4, lambda i: retain() if i == 0 else claim(i))
    assert results[0] == 2000
    claimed = [run_id for taken in results[1:] for run_id in taken]
    assert sorted(claimed) == sorted(ids)
    assert Run.objects.filter(definition=live, state="succeeded").count() == 600


def test_a_blob_a_new_run_is_about_to_use_is_not_deleted_as_unreferenced(team_a, payload_folder):
    """A run asked for with the payload of runs just deleted finds the blob stored and skips
    writing it; the deletion of unreferenced blobs, looking before the run commits, took it
    away, and the run (answered 201) could never be leased: its payload was gone."""
    from apps.audit.record import Actor
    from apps.jobs.enqueue import Wanted, enqueue_many
    from apps.runs import payloads
    from tests.conftest import other_session
    from tests.waiting import wait_for

    definition = make_definition(team_a, "big.job", queue="big")
    payload = {"rows": ["x" * 100 for _ in range(100)]}  # 10 KB: kept in storage
    _, key = payloads.place(payload)  # as runs deleted since had stored it
    assert (payload_folder / key).exists()
    answers: dict[str, object] = {}

    def enqueue() -> None:
        try:
            batch = enqueue_many([team_a.pk], [Wanted("big.job", payload=payload)], Actor.cli())
            answers["enqueue"] = batch.answers[0].status
        finally:
            connections.close_all()

    def delete() -> None:
        try:
            answers["deleted"] = payloads.delete_unreferenced([key])
        finally:
            connections.close_all()

    # The definition's row, as an edit holds it (pg_stat_activity is read from a session of its
    # own: inside a transaction it is a snapshot).
    with other_session() as held, other_session(autocommit=True) as watching:
        held.execute("SELECT 1 FROM jobs_jobdefinition WHERE id = %s FOR UPDATE", [definition.pk])
        inserting = threading.Thread(target=enqueue)
        inserting.start()
        # The insert waits for the definition (FOR KEY SHARE), its blob found stored.
        wait_for(
            lambda: watching.execute(
                "SELECT 1 FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
                " AND datname = current_database() AND query LIKE '%INSERT INTO runs_run %'"
            ).fetchone(),
            what="the insert to wait",
        )
        deleting = threading.Thread(target=delete)
        deleting.start()
        deleting.join(1.0)
        held.commit()
    inserting.join(10)
    deleting.join(10)
    assert answers == {"enqueue": 201, "deleted": 0}
    assert (payload_folder / key).exists()
    (run,) = Run.objects.filter(definition=definition)
    assert run.payload_key == key and payloads.load(None, key) == payload
