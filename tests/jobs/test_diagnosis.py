"""Why is this not running: each hold named with its reason."""

from __future__ import annotations

from datetime import timedelta

import pytest

from apps.jobs.diagnosis import why_definition, why_run
from apps.jobs.models import Queue
from apps.runs import store
from apps.runs.models import Run
from tests.conftest import add_ready_runs, db_now, make_definition

pytestmark = pytest.mark.django_db(transaction=True)


def codes(reasons) -> list[str]:
    return [reason.code for reason in reasons]


def test_paused_definition(team_a):
    definition = make_definition(team_a, "why.paused", queue="w", paused=True)
    add_ready_runs(definition, 1)
    assert "definition_paused" in codes(why_run(Run.objects.get(), db_now()))
    assert "definition_paused" in codes(why_definition(definition, db_now()))


def test_paused_queue(team_a):
    definition = make_definition(team_a, "why.queue", queue="w")
    add_ready_runs(definition, 1)
    Queue.objects.create(team=team_a, name="w", paused=True)
    assert "queue_paused" in codes(why_run(Run.objects.get(), db_now()))


def test_concurrency_limit_names_the_holder(team_a):
    definition = make_definition(team_a, "why.limit", queue="w", concurrency=1)
    add_ready_runs(definition, 2)
    (held,) = store.claim(queues=["w"], max_runs=5, worker_id="w1", lease_seconds=60)
    waiting = Run.objects.exclude(pk=held.id).get()
    (reason,) = [r for r in why_run(waiting, db_now()) if r.code == "concurrency_limit"]
    assert reason.detail["heldBy"] == [Run.objects.get(pk=held.id).run_id]


def test_backoff_until(team_a):
    definition = make_definition(
        team_a, "why.backoff", queue="w", retry_base_seconds=3600, retry_max_seconds=3600
    )
    add_ready_runs(definition, 1)
    (lease,) = store.claim(queues=["w"], max_runs=1, worker_id="w1", lease_seconds=60)
    store.fail([(lease.id, lease.fencing_token, {"message": "x"}, True)], team_ids=[team_a.pk])
    run = Run.objects.get()
    run.available_at = db_now() + timedelta(minutes=30)
    run.save(update_fields=["available_at"])
    reasons = why_run(run, db_now())
    assert codes(reasons)[0] == "backoff" and "until" in reasons[0].message


def test_no_worker_then_a_worker(team_a):
    definition = make_definition(team_a, "why.worker", queue="w")
    add_ready_runs(definition, 1)
    assert "no_worker" in codes(why_run(Run.objects.get(), db_now()))
    store.record_lease_activity(team_a.pk, ["w"], "host/1")
    assert "no_worker" not in codes(why_run(Run.objects.get(), db_now()))
    assert codes(why_run(Run.objects.get(), db_now())) == []


def test_behind_higher_priority(team_a):
    low = make_definition(team_a, "why.low", queue="w", priority="bulk")
    high = make_definition(team_a, "why.high", queue="w", priority="critical")
    add_ready_runs(low, 1)
    add_ready_runs(high, 3)
    store.record_lease_activity(team_a.pk, ["w"], "host/1")
    reasons = why_run(Run.objects.get(definition=low), db_now())
    (reason,) = [r for r in reasons if r.code == "behind_higher_priority"]
    assert reason.detail["count"] == 3
