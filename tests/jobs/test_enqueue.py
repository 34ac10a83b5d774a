"""Creating runs in batches: one statement, a status per item, each key created once."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from datetime import timedelta

import pytest
from django.db import connections

from apps.audit.models import AuditEvent
from apps.audit.record import Actor
from apps.jobs.enqueue import Wanted, enqueue_many
from apps.runs import shards
from apps.runs.models import PRIORITIES, Run
from apps.runs.shards import MOVED_GUARD_PREFIX
from apps.scheduler.moves import ADD_GUARD, DROP_GUARD
from tests.conftest import db_now, make_definition, stored, stored_one


@pytest.fixture
def jobs(team_a, team_b):
    return (
        make_definition(team_a, "billing.send-invoice", queue="billing", payload={"kind": "x"}),
        make_definition(team_a, "billing.remind", queue="billing"),
        make_definition(team_b, "other.secret", queue="other"),
    )


@pytest.mark.shards
@pytest.mark.django_db(transaction=True, databases="__all__")
def test_a_mixed_batch_answers_each_item_in_order_and_writes_only_the_good_ones(
    team_a, team_b, jobs
):
    actor = Actor.system()
    enqueue_many([team_a.pk], [Wanted("billing.send-invoice", "order-1", payload={"n": 1})], actor)
    answers = enqueue_many(
        [team_a.pk],
        [
            Wanted("billing.send-invoice", "order-2", delay_seconds=300, payload={"n": 2}),
            Wanted("billing.send-invoice", "order-1", payload={"n": 1}),  # the same again
            Wanted("billing.send-invoice", "order-1", payload={"n": 9}),  # another payload
            Wanted("no.such-job", "x"),
            Wanted("other.secret", "y"),  # another team's
            Wanted("billing.remind", "r-1", priority=PRIORITIES["critical"]),
            Wanted("billing.remind", "r-1"),  # twice in one batch
        ],
        actor,
    ).answers
    assert [a.status for a in answers] == [201, 200, 409, 404, 404, 201, 200]
    assert answers[1].run.pk == answers[2].run.pk
    assert answers[2].fields == ("n",)
    assert answers[5].run.pk == answers[6].run.pk
    assert not stored(Run, team=team_b)
    assert len(stored(Run)) == 3
    delayed = stored_one(Run, idempotency_key="order-2")
    assert delayed.due_at - db_now() > timedelta(seconds=290)
    assert delayed.payload == {"n": 2}
    reminder = stored_one(Run, idempotency_key="r-1")
    assert reminder.priority == PRIORITIES["critical"]
    assert reminder.payload == {}  # the definition's
    # One audit event per job for the new runs, one denial for the other team's job.
    assert AuditEvent.objects.filter(action="run.create").count() == 3
    assert AuditEvent.objects.filter(team=team_b, action="access.denied").count() == 1


def test_a_large_batch_is_one_insert(team_a, jobs, django_assert_max_num_queries):
    items = [Wanted("billing.send-invoice", f"k-{i}", payload={"i": i}) for i in range(500)]
    # definitions with the clock, the insert, its NOTIFY, the audit event (and, inside the
    # test's transaction, a savepoint and its release): not 500.
    with django_assert_max_num_queries(6):
        answers = enqueue_many([team_a.pk], items, Actor.system()).answers
    assert {a.status for a in answers} == {201}
    assert Run.objects.count() == 500
    assert AuditEvent.objects.get(action="run.create").after["count"] == 500


@pytest.mark.django_db(transaction=True)
def test_one_delayed_run_is_three_statements(team_a, jobs, django_assert_num_queries):
    # What a producer's single enqueue costs the database: the definitions (with the clock),
    # then BEGIN, the insert, the audit event, COMMIT. A delayed run wakes nobody (no NOTIFY).
    with django_assert_num_queries(5):
        batch = enqueue_many(
            [team_a.pk], [Wanted("billing.send-invoice", "one", delay_seconds=60)], Actor.system()
        )
        (answer,) = batch.answers
        # What the run's answer reads was loaded with the lookup: no query per run.
        assert (answer.run.definition.name, answer.run.team.slug) == (
            "billing.send-invoice",
            team_a.slug,
        )
    assert answer.status == 201
    assert timedelta(seconds=59) < answer.run.due_at - batch.now <= timedelta(seconds=60)


@pytest.mark.shards
@pytest.mark.django_db(transaction=True, databases="__all__")
def test_concurrent_batches_with_overlapping_keys_create_each_key_once(team_a, jobs):
    keys = [f"shared-{i}" for i in range(200)]
    results: list[list[int]] = []
    errors: list[BaseException] = []
    start = threading.Barrier(20)

    def producer(offset: int) -> None:
        try:
            start.wait()
            # Half the batches name the keys in the opposite order: inserted as given, two such
            # batches would each wait on the other's uncommitted rows.
            mine = keys if offset % 2 else keys[::-1]
            answers = enqueue_many(
                [team_a.pk], [Wanted("billing.send-invoice", key) for key in mine], Actor.system()
            ).answers
            results.append([a.status for a in answers])
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
        finally:
            connections.close_all()

    threads = [threading.Thread(target=producer, args=(i,)) for i in range(20)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    assert len(stored(Run, idempotency_key__in=keys)) == 200
    created = sum(status == 201 for statuses in results for status in statuses)
    assert created == 200
    assert all(set(statuses) <= {200, 201} for statuses in results)


@pytest.mark.django_db(transaction=True)
def test_an_item_whose_job_is_deleted_under_the_insert_is_a_404_not_a_failed_batch(team_a, jobs):
    """The insert takes a key-share lock on the definition (so that its runs' `limited` is exact):
    a job deleted meanwhile leaves the insert nothing to insert for, which the item reports."""
    from tests.conftest import other_session

    doomed = make_definition(team_a, "billing.doomed", queue="billing")
    answers: list = []
    with other_session() as deleter:
        deleter.execute("DELETE FROM jobs_jobdefinition WHERE id = %s", [doomed.pk])
        making = threading.Thread(
            target=lambda: answers.extend(
                enqueue_many(
                    [team_a.pk],
                    [Wanted("billing.doomed", "d-1"), Wanted("billing.remind", "r-9")],
                    Actor.system(),
                ).answers
            )
        )
        making.start()
        making.join(1.0)
        assert making.is_alive()  # waiting for the delete's lock on the definition
        deleter.commit()
    making.join(10)
    connections.close_all()
    assert [answer.status for answer in answers] == [404, 201]


@pytest.fixture
def guarded_shard(team_a, jobs) -> Iterator[int]:
    """A move's guard on the control database for billing.remind's shard (as `moveshard`
    leaves on the database a shard leaves), which this process's map does not know of yet."""
    shard = jobs[1].shard
    assert jobs[0].shard != shard
    name = f"{MOVED_GUARD_PREFIX}{shard}"
    with connections["default"].cursor() as cursor:
        cursor.execute(ADD_GUARD.format(name=name, table="runs_run", shard=shard))
    yield shard
    with connections["default"].cursor() as cursor:
        cursor.execute(DROP_GUARD.format(name=name, table="runs_run"))


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("known", [True, False], ids=["moves-known", "first-move"])
def test_a_moving_shards_guard_in_the_control_database_refuses_its_runs_only(
    team_a, jobs, guarded_shard, monkeypatch, known
):
    """Once a move is known, the insert runs in a savepoint of the audit event's transaction:
    the guarded shard's item is a 503 and the others are created, with their audit event.
    Before any move is known (a map a second late at the very first move), the request is a
    503 whole and nothing is written (the transaction was spoilt: it was a 500)."""
    monkeypatch.setattr(shards, "refresh", lambda force=False: None)
    monkeypatch.setattr(shards, "ever_moved", lambda: known)
    items = [Wanted("billing.send-invoice", "i-1"), Wanted("billing.remind", "r-1")]
    if not known:
        with pytest.raises(shards.Moving, match=f"shard {guarded_shard} is moving"):
            enqueue_many([team_a.pk], items, Actor.system())
        assert not stored(Run)
        return
    answers = enqueue_many([team_a.pk], items, Actor.system()).answers
    assert [answer.status for answer in answers] == [201, 503]
    assert stored_one(Run).idempotency_key == "i-1"
    assert AuditEvent.objects.filter(action="run.create").count() == 1
