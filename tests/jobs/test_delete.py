"""Deleting a definition deletes its runs and attempts in batches, and is audited."""

from __future__ import annotations

import pytest

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
