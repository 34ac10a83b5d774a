"""Failures by group: the fail and reap statements store each error's fingerprint, failure time
and stack; an action on everything a filter selects is one statement per shard database,
audited once per team with the filter."""

from __future__ import annotations

from contextlib import ExitStack

import pytest
from django.db import connections
from django.test.utils import CaptureQueriesContext

from apps.audit.models import AuditEvent
from apps.audit.record import Actor
from apps.runs import filters, fingerprints, shards, store, transitions
from apps.runs.filters import BulkFilter
from apps.runs.models import Attempt, Run
from tests.conftest import add_ready_runs, expire_lease, make_definition, stored
from tests.triage_runs import insert_failed

pytestmark = pytest.mark.django_db

OPERATOR = Actor(label="oscar", source="dashboard")


def _lease_all(definition, count: int):
    add_ready_runs(definition, count)
    leases = store.claim(
        queues=[definition.queue], max_runs=count, worker_id="w/1", lease_seconds=60
    )
    assert len(leases) == count
    return leases


def test_a_failure_stores_its_group_its_time_and_the_attempts_stack(team_a):
    job = make_definition(team_a, "etl.load", queue="etl", retry_max_attempts=3)
    first, second, third = _lease_all(job, 3)
    stack = "Traceback (most recent call last):\n  File \"etl.py\", line 7\nKeyError: 'user 1'"
    store.fail(
        [
            (first.id, first.fencing_token, {"type": "KeyError", "message": "'user 1'"}, True),
            (
                second.id,
                second.fencing_token,
                {"type": "KeyError", "message": "'user 2'", "stack": stack},
                False,
            ),
            (third.id, third.fencing_token, {"type": "ValueError", "message": "'user 3'"}, True),
        ],
        team_ids=[team_a.pk],
    )
    runs = {run.pk: run for run in Run.objects.all()}
    assert runs[first.id].error_fingerprint == runs[second.id].error_fingerprint
    assert runs[first.id].error_fingerprint == fingerprints.of("KeyError", "'anyone'")
    assert runs[third.id].error_fingerprint != runs[first.id].error_fingerprint
    assert all(run.failed_at is not None for run in runs.values())
    assert runs[second.id].last_error["stack"] == stack
    attempts = {a.run_id: a for a in Attempt.objects.all()}
    assert attempts[second.id].error_stack == stack
    assert attempts[first.id].error_stack == ""


def test_a_reaped_lease_is_grouped_by_its_reason_not_its_worker(team_a):
    job = make_definition(team_a, "etl.slow", queue="slow", retry_max_attempts=3)
    (lease,) = _lease_all(job, 1)
    expire_lease(lease.id)
    store.reap()
    run = Run.objects.get(pk=lease.id)
    assert run.state == "retrying"
    assert run.last_error["type"] == "lease_expired"
    assert run.error_fingerprint == fingerprints.of_error(run.last_error)
    assert run.error_fingerprint == fingerprints.of("lease_expired", "lease of worker x expired")


@pytest.mark.shards
@pytest.mark.django_db(databases="__all__")
def test_requeue_by_filter_is_one_statement_per_database_and_one_audit_event(team_a, team_b):
    job = make_definition(team_a, "billing.charge", queue="billing", retry_max_attempts=2)
    other_job = make_definition(team_a, "billing.refund", queue="billing")
    theirs = make_definition(team_b, "search.reindex", queue="billing")
    insert_failed(job, 300)
    insert_failed(job, 40, state="retrying", prefix="retrying-")
    insert_failed(other_job, 20)
    insert_failed(theirs, 10)
    flt = BulkFilter(job="billing.charge")

    assert filters.count([team_a.pk], ["dead"], flt) == 300
    with ExitStack() as stack:
        captured = [
            stack.enter_context(CaptureQueriesContext(connections[alias]))
            for alias in shards.databases()
        ]
        changed = transitions.act_on_matching("requeue", [team_a], ["dead"], flt, OPERATOR)
    assert changed == 300
    for queries in captured:  # every database: one UPDATE, whichever holds the job
        assert len([q for q in queries.captured_queries if "UPDATE runs_run" in q["sql"]]) == 1

    mine = stored(Run, definition_id=job.pk)
    assert {(run.state, run.max_attempts, run.finished_at) for run in mine} == {
        ("ready", 4, None),  # 300 with a fresh budget: attempt 2 + the definition's 2
        ("retrying", 2, None),  # the 40 retrying ones, untouched
    }
    assert len([run for run in mine if run.state == "ready"]) == 300
    assert {run.state for run in stored(Run, definition_id__in=[other_job.pk, theirs.pk])} == {
        "dead"
    }
    (event,) = AuditEvent.objects.filter(action="dlq.requeue")
    assert event.team_id == team_a.pk
    assert event.target_type == "filter"
    assert event.target == "job=billing.charge"
    assert event.before == {"filter": {"job": "billing.charge"}, "states": ["dead"]}
    # With shards on servers of their own, an event per database that had runs changed, naming
    # its shards: the job's runs are in one.
    where = {"shards": shards.span(shards.alias_of_shard(job.shard))} if shards.physical() else {}
    assert event.after == {"state": "ready", "count": 300, **where}


def test_a_group_and_the_other_filters_select_in_sql_what_the_list_shows(team_a):
    job = make_definition(team_a, "billing.charge", queue="billing")
    keyed = insert_failed(job, 30, message="'user %s'")
    timed = insert_failed(job, 20, error_type="TimeoutError", message="after %s s", prefix="t-")
    insert_failed(
        job, 5, state="retrying", error_type="TimeoutError", message="after %s s", prefix="r-"
    )
    assert keyed != timed

    def count(flt: BulkFilter, states=("dead", "retrying")) -> int:
        return filters.count([team_a.pk], list(states), flt)

    assert count(BulkFilter(fingerprint=keyed)) == 30
    assert count(BulkFilter(fingerprint=timed)) == 25
    assert count(BulkFilter(fingerprint=timed), ["dead"]) == 20
    assert count(BulkFilter(error="timeout")) == 25
    assert count(BulkFilter(error="100%")) == 0  # % is a character, not a wildcard
    assert count(BulkFilter(queue="billing", job="billing.charge")) == 55
    assert count(BulkFilter(job="no.such.job")) == 0
    assert count(BulkFilter(everything=True)) == 55
    assert count(BulkFilter(everything=True), []) == 0
    # The same filter through the queryset (the API's selection) selects the same runs.
    for flt in (BulkFilter(fingerprint=timed), BulkFilter(error="TIMEOUT")):
        assert filters.apply(Run.objects.filter(state__in=["dead", "retrying"]), flt).count() == 25

    # Retry on the failures list: a retrying run skips its backoff, a dead one is requeued.
    changed = transitions.act_on_matching(
        "retry", [team_a], ["retrying", "dead"], BulkFilter(fingerprint=timed), OPERATOR
    )
    assert changed == 25
    assert set(Run.objects.filter(error_fingerprint=timed).values_list("state", flat=True)) == {
        "ready"
    }
    assert set(Run.objects.filter(error_fingerprint=keyed).values_list("state", flat=True)) == {
        "dead"
    }
    (event,) = AuditEvent.objects.filter(action="run.retry")
    assert event.before["filter"] == {"group": fingerprints.to_hex(timed)}


def test_an_action_changes_only_the_states_it_accepts(team_a):
    job = make_definition(team_a, "billing.charge", queue="billing")
    insert_failed(job, 10)
    insert_failed(job, 10, state="retrying", prefix="r-")
    everything = BulkFilter(everything=True)
    # Discard takes dead runs only, cancel waiting ones only, whatever the caller asks.
    assert transitions.act_on_matching("discard", [team_a], ["retrying"], everything, OPERATOR) == 0
    assert (
        transitions.act_on_matching("cancel", [team_a], ["dead", "retrying"], everything, OPERATOR)
        == 10
    )
    assert (
        transitions.act_on_matching("discard", [team_a], ["dead", "retrying"], everything, OPERATOR)
        == 10
    )
    assert set(Run.objects.values_list("state", flat=True)) == {"cancelled"}
    assert AuditEvent.objects.filter(action__in=["run.cancel", "dlq.discard"]).count() == 2
    assert AuditEvent.objects.get(action="dlq.discard").target == "all"


def test_nothing_changes_while_a_shard_is_being_moved(team_a, monkeypatch):
    job = make_definition(team_a, "billing.charge", queue="billing")
    insert_failed(job, 5)
    monkeypatch.setattr(shards, "moving", lambda: frozenset({job.shard}))
    with pytest.raises(shards.Moving):
        transitions.act_on_matching(
            "requeue", [team_a], ["dead"], BulkFilter(everything=True), OPERATOR
        )
    assert set(Run.objects.values_list("state", flat=True)) == {"dead"}
    assert not AuditEvent.objects.exists()
