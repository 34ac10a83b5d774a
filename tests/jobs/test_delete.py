"""Deleting a definition deletes its runs and attempts in batches, and is audited."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest
from django.db import connection, transaction

from apps.audit.models import AuditEvent
from apps.audit.record import Actor
from apps.jobs import services
from apps.jobs.models import JobDefinition
from apps.runs import retention, store
from apps.runs.models import Attempt, Run
from tests.conftest import add_ready_runs, make_definition

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
