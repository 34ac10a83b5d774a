"""Deleting a definition deletes its runs and attempts in batches, and is audited."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import replace
from datetime import timedelta
from unittest import mock

import pytest
from django.db import OperationalError, connection, connections, transaction

from apps.audit.models import AuditEvent
from apps.audit.record import Actor
from apps.jobs import runlist, services
from apps.jobs.enqueue import Wanted, enqueue_many
from apps.jobs.models import DefinitionGone, JobDefinition, database_of
from apps.runs import retention, shards, store
from apps.runs.models import Attempt, Run
from apps.scheduler.daemon import Scheduler
from tests.conftest import add_ready_runs, db_now, make_definition
from tests.waiting import wait_for

pytestmark = pytest.mark.django_db(transaction=True)


def test_delete_removes_runs_and_attempts_of_that_definition_only(team_a):
    doomed = make_definition(team_a, "old.job", queue="q")
    kept = make_definition(team_a, "kept.job", queue="k")
    add_ready_runs(doomed, 25)
    add_ready_runs(kept, 3)
    store.claim(queues=["q", "k"], max_runs=100, worker_id="w", lease_seconds=60)
    assert retention.delete_runs_of(doomed.pk, batch=10) == 25  # three batches
    add_ready_runs(doomed, 2, prefix="late")
    services.delete_definition(doomed, Actor.cli("test"))
    assert not JobDefinition.objects.filter(name="old.job").exists()
    assert Run.objects.count() == 3 and Attempt.objects.count() == 3
    assert AuditEvent.objects.get(action="job.delete").before["name"] == "old.job"


def _waits_for_held(hold: Callable[[], None], act: Callable[[], None]) -> None:
    """`hold()` in a transaction of its own thread, kept open; then `act()` in another thread,
    which must still be waiting a second later (for what the first holds) and must end once
    the first commits."""
    held, release = threading.Event(), threading.Event()

    def holding() -> None:
        try:
            with transaction.atomic():
                hold()
                held.set()
                release.wait(10)
        finally:
            connection.close()

    def acting() -> None:
        try:
            act()
        finally:
            connection.close()

    first = threading.Thread(target=holding)
    first.start()
    assert held.wait(10)
    second = threading.Thread(target=acting)
    second.start()
    second.join(1.0)
    assert second.is_alive()  # waiting for the first's locks
    release.set()
    first.join(10)
    second.join(10)
    assert not second.is_alive()


def test_runs_inserted_while_the_definition_is_deleted_go_with_it(team_a):
    """Runs have no foreign key in the database: an insert that holds the definition when the
    delete comes is waited for, and its runs deleted with the rest, not left behind."""
    doomed = make_definition(team_a, "old.job", queue="q")
    doomed_id = doomed.pk  # the deleted instance's pk becomes None
    add_ready_runs(doomed, 5)
    _waits_for_held(
        lambda: add_ready_runs(doomed, 3, prefix="racing"),
        lambda: services.delete_definition(doomed, Actor.cli("test")),
    )
    assert not JobDefinition.objects.filter(pk=doomed_id).exists()
    assert not Run.objects.filter(definition_id=doomed_id).exists()


def test_runs_leased_while_they_are_deleted_leave_no_attempt_behind(team_a):
    """Attempts have no foreign key in the database either: a claim that holds runs when the
    definition's runs are deleted is waited for, and the attempts it wrote go with its runs."""
    doomed = make_definition(team_a, "old.job", queue="q")
    add_ready_runs(doomed, 4)
    deleted: list[int] = []
    _waits_for_held(
        lambda: store.claim(queues=["q"], max_runs=2, worker_id="w", lease_seconds=60),
        lambda: deleted.append(retention.delete_runs_of(doomed.pk)),
    )
    assert deleted == [4]
    assert not Run.objects.exists()
    assert not Attempt.objects.exists()


def _named_on(alias: str, prefix: str) -> str:
    return next(f"{prefix}.{n}" for n in range(1000) if database_of(f"{prefix}.{n}") == alias)


@pytest.mark.shards
@pytest.mark.django_db(transaction=True, databases="__all__")
def test_a_job_is_gone_for_everyone_from_the_start_of_its_delete(team_a):
    """The delete's batches wait here on a run another session holds; meanwhile the job is
    already gone: an enqueue answers 404 (before: 201 for a run the delete then removed, so a
    key could be answered 201 twice), a claim leases none of its runs, a change finds no job and
    a create of its name is told it is still being deleted. Nothing of it is left at the end."""
    alias = shards.databases()[-1]  # with shards on servers of their own, not the control's
    doomed_name, kept_name = _named_on(alias, "old"), _named_on(alias, "kept")
    doomed = make_definition(team_a, doomed_name, queue="q")
    doomed_id = doomed.pk
    kept = make_definition(team_a, kept_name, queue="q")
    with shards.using(alias):
        held_run, *_ = add_ready_runs(doomed, 3)
    enqueue_many([team_a.pk], [Wanted(doomed_name, "k-1")], Actor.cli("test"))
    held, release, deleted = threading.Event(), threading.Event(), threading.Event()

    def holding() -> None:
        try:
            with shards.using(alias), transaction.atomic(using=alias):
                Run.objects.select_for_update().get(pk=held_run)
                held.set()
                release.wait(10)
        finally:
            connections.close_all()

    def deleting() -> None:
        try:
            services.delete_definition(doomed, Actor.cli("test"))
            deleted.set()
        finally:
            connections.close_all()

    holder = threading.Thread(target=holding)
    holder.start()
    assert held.wait(10)
    deleter = threading.Thread(target=deleting)
    deleter.start()
    everything = JobDefinition.everything.using(alias)
    try:
        wait_for(lambda: everything.get(pk=doomed_id).deleting, 10, "the mark")
        assert not deleted.is_set()  # at its batches, behind the held run
        answers = enqueue_many(
            [team_a.pk],
            [Wanted(doomed_name, "k-1"), Wanted(doomed_name, "k-2"), Wanted(kept_name, "k-3")],
            Actor.cli("test"),
        ).answers
        assert [answer.status for answer in answers] == [404, 404, 201]
        lanes = store.Lanes([team_a.pk], []) if shards.physical() else None
        with shards.using(alias):
            leases = store.claim(
                queues=["q"], max_runs=10, worker_id="w", lease_seconds=60, lanes=lanes
            )
        assert [lease.job for lease in leases] == [kept_name]
        assert not JobDefinition.objects.named(doomed_name).exists()
        with pytest.raises(DefinitionGone):
            services.set_paused(doomed, True, Actor.cli("test"))
        spec = replace(services.spec_of(kept), name=doomed_name)
        with pytest.raises(services.NameTaken, match="is being deleted"):
            services.create_definition(team_a, spec, Actor.cli("test"))
        # Its runs are still listed until they are gone, by its name too (that list was empty).
        listed = runlist.run_page(
            runlist.RunFilter(team_ids=[team_a.pk], job=doomed_name),
            db_now(),
            before=None,
            limit=50,
        )
        assert len(listed.runs) == 4
    finally:
        release.set()
        holder.join(10)
        deleter.join(10)
    assert deleted.is_set()
    assert not everything.filter(pk=doomed_id).exists()
    assert not Run.objects.using(alias).filter(definition_id=doomed_id).exists()
    assert AuditEvent.objects.filter(action="job.delete").count() == 1
    services.create_definition(team_a, spec, Actor.cli("test"))  # the name is free again


@pytest.mark.shards
@pytest.mark.django_db(transaction=True, databases="__all__")
def test_retention_finishes_a_delete_its_process_left(team_a):
    """A delete whose process stopped after marking the job (its runs half gone) is finished by
    the scheduler's retention round, once it has been left a minute."""
    alias = shards.databases()[-1]
    left = make_definition(team_a, _named_on(alias, "left"), queue="q")
    recent = make_definition(team_a, _named_on(alias, "recent"), queue="q")
    with shards.using(alias):
        add_ready_runs(left, 4)
        add_ready_runs(recent, 2)
    services.begin_delete(left, Actor.cli("test"))
    everything = JobDefinition.everything.using(alias)
    long_ago = db_now() - timedelta(minutes=2)
    everything.filter(pk=left.pk).update(updated_at=long_ago)
    everything.filter(pk=recent.pk).update(deleting=True)  # its process is still at it
    node = Scheduler(node_id="retention-node", lease_seconds=10)
    try:
        node.tick()
    finally:
        node.leave()
    assert not everything.filter(pk=left.pk).exists()
    assert not Run.objects.using(alias).filter(definition_id=left.pk).exists()
    assert everything.filter(pk=recent.pk).exists()
    assert Run.objects.using(alias).filter(definition_id=recent.pk).count() == 2
    events = AuditEvent.objects.filter(action="job.delete")
    assert list(events.values_list("target", "actor")) == [(left.name, "test")]


def test_a_delete_whose_database_fails_after_the_mark_is_done_for_its_caller(team_a, caplog):
    """The job is gone from the mark on: a failure of its batches (the shard's server going
    down) is retention's to finish, not a failed delete for the caller to send again (a 503,
    then 404 on every try)."""
    doomed = make_definition(team_a, "old.job", queue="q")
    add_ready_runs(doomed, 3)
    down = mock.patch.object(
        retention, "delete_runs_of", side_effect=OperationalError("server closed the connection")
    )
    with down:
        services.delete_definition(doomed, Actor.cli("test"))
    assert JobDefinition.everything.get(pk=doomed.pk).deleting
    assert Run.objects.filter(definition_id=doomed.pk).count() == 3  # left to retention
    assert "left to retention" in caplog.text
