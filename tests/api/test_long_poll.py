"""Long-polling claims: woken by NOTIFY, and empty when the wait runs out."""

from __future__ import annotations

import threading
import time

import pytest
from django.db import connections

from apps.runs import shards
from apps.runs.store import NewRun, insert_runs
from tests.conftest import db_now, make_definition, stored_run

pytestmark = [pytest.mark.shards, pytest.mark.django_db(transaction=True, databases="__all__")]


def test_wait_returns_soon_after_a_run_becomes_ready(api_a, team_a):
    definition = make_definition(team_a, "poll.job", queue="poll")
    answer: dict = {}

    def lease() -> None:
        started = time.monotonic()
        answer["leases"] = api_a.lease(["poll"], 5, waitSeconds=5)
        answer["returned"] = time.monotonic()
        answer["started"] = started

    thread = threading.Thread(target=lease)
    thread.start()
    time.sleep(1.5)
    inserted_at = time.monotonic()
    now = db_now()
    with shards.using(shards.alias_of_shard(definition.shard)):
        insert_runs([NewRun(definition.pk, "api", now, now, "poll-1")])
    connections.close_all()
    thread.join(10)
    assert len(answer["leases"]) == 1
    assert answer["returned"] - inserted_at < 1.0
    assert stored_run().state == "leased"


def test_wait_returns_empty_after_the_wait(api_a, team_a):
    make_definition(team_a, "poll.idle", queue="idle")
    started = time.monotonic()
    assert api_a.lease(["idle"], 5, waitSeconds=2) == []
    assert 2.0 <= time.monotonic() - started < 3.5


def test_wait_wakes_for_a_run_whose_time_comes(api_a, team_a):
    from datetime import timedelta

    definition = make_definition(team_a, "poll.later", queue="later")
    soon = db_now() + timedelta(seconds=1)
    with shards.using(shards.alias_of_shard(definition.shard)):
        insert_runs([NewRun(definition.pk, "api", soon, soon, "later-1")])
    started = time.monotonic()
    leases = api_a.lease(["later"], 5, waitSeconds=5)
    assert len(leases) == 1
    assert time.monotonic() - started < 2.5


@pytest.mark.parametrize("limited", ["job", "queue"])
def test_a_long_poll_wakes_when_a_full_rate_window_has_room_again(
    api_a, team_a, monkeypatch, limited
):
    """A backlog held by a spent rate window sends no NOTIFY when the window frees: the waiter
    was woken by its re-check alone (every 2 s), so a window of a second ran at half its rate.
    It now sets its alarm for the moment the window has room. The re-check is put out of reach
    here, so only that alarm can answer the second call."""
    from apps.jobs.models import Queue
    from apps.runs import leasing
    from tests.conftest import add_ready_runs

    monkeypatch.setattr(leasing, "RECHECK_SECONDS", 60.0)
    if limited == "job":
        definition = make_definition(
            team_a, "rated.job", queue="rated", rate_limit_count=2, rate_limit_period_seconds=1
        )
    else:
        Queue.objects.create(
            team=team_a, name="rated", rate_limit_count=2, rate_limit_period_seconds=1
        )
        leasing.control_state.forget()
        definition = make_definition(team_a, "rated.job", queue="rated")
    add_ready_runs(definition, 6)
    assert len(api_a.lease(["rated"], 10)) == 2  # the window is full now
    started = time.monotonic()
    second = api_a.lease(["rated"], 10, waitSeconds=20)
    waited = time.monotonic() - started
    assert len(second) == 2, waited
    assert waited < 10, waited  # before: the whole wait (20 s), then the claim
