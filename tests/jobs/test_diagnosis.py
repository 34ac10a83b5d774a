"""Why is this not running: each hold named with its reason."""

from __future__ import annotations

from datetime import datetime, timedelta

import pytest

from apps.jobs.diagnosis import why_definition, why_run
from apps.jobs.models import Queue
from apps.runs import shards, store
from apps.runs.clock import format_utc
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


# --- schedule bounds -----------------------------------------------------------------------------


def hourly_within(start: datetime | None, end: datetime | None) -> dict:
    schedule = {"cron": "0 * * * *", "timeZone": "UTC", "jitterSeconds": 0}
    if start is not None:
        schedule["startAt"] = format_utc(start)
    if end is not None:
        schedule["endAt"] = format_utc(end)
    return schedule


def test_an_ended_schedule_says_when_it_ended(team_a):
    end = db_now().replace(minute=0, second=0, microsecond=0) - timedelta(hours=2)
    definition = make_definition(
        team_a, "why.ended", schedule=hourly_within(None, end), next_due_at=None
    )

    reasons = why_definition(definition, db_now())

    (reason,) = [r for r in reasons if r.code == "schedule_ended"]
    assert reason.message == f"The schedule ended at {format_utc(end)} (endAt)."
    assert reason.detail == {"endAt": format_utc(end)}
    assert "schedule_done" not in codes(reasons)


def test_a_paused_definition_whose_schedule_ended_says_both(team_a):
    now = db_now()
    end = now - timedelta(days=1)
    definition = make_definition(
        team_a,
        "why.ended-paused",
        schedule=hourly_within(None, end),
        next_due_at=end - timedelta(days=3),  # stale: left as it was when paused
        paused=True,
    )

    assert codes(why_definition(definition, now))[:1] == ["definition_paused"]
    assert "schedule_ended" in codes(why_definition(definition, now))


def test_a_schedule_whose_end_is_ahead_but_no_fire_time_is_left_has_ended(team_a):
    now = db_now()
    end = (now + timedelta(minutes=10)).replace(microsecond=0)
    # Its next fire time is about half an hour away, after the end.
    schedule = {"cron": f"{(now.minute + 30) % 60} * * * *", "endAt": format_utc(end)}
    definition = make_definition(team_a, "why.end-ahead", schedule=schedule, next_due_at=None)

    (reason,) = [r for r in why_definition(definition, now) if r.code == "schedule_ended"]
    assert reason.message == (
        f"The schedule ends at {format_utc(end)} (endAt) and has no fire time left before then."
    )


def test_a_schedule_with_a_due_time_left_before_its_end_has_not_ended(team_a):
    now = db_now()
    due = now.replace(minute=0, second=0, microsecond=0)
    definition = make_definition(
        team_a,
        "why.last-due",
        schedule=hourly_within(None, due + timedelta(minutes=30)),
        next_due_at=due,  # the scheduler has yet to insert the last run
    )

    assert "schedule_ended" not in codes(why_definition(definition, now))


def test_a_future_start_says_when_the_schedule_starts(team_a):
    now = db_now()
    start = now.replace(minute=0, second=0, microsecond=0) + timedelta(days=2)
    definition = make_definition(
        team_a, "why.not-started", schedule=hourly_within(start, None), next_due_at=start
    )

    reasons = why_definition(definition, now)

    (reason,) = [r for r in reasons if r.code == "schedule_not_started"]
    assert reason.message == (
        f"The schedule starts at {format_utc(start)} (startAt); "
        f"its first fire time is {format_utc(start)}."
    )
    assert reason.detail == {"startAt": format_utc(start), "nextDueAt": format_utc(start)}
    assert "next_fire" not in codes(reasons)


def test_a_started_schedule_shows_its_next_fire_time(team_a):
    now = db_now()
    following = now.replace(minute=0, second=0, microsecond=0) + timedelta(hours=1)
    definition = make_definition(
        team_a,
        "why.started",
        schedule=hourly_within(now - timedelta(days=1), now + timedelta(days=1)),
        next_due_at=following,
    )

    reason_codes = codes(why_definition(definition, now))

    assert "next_fire" in reason_codes
    assert not {"schedule_ended", "schedule_not_started"} & set(reason_codes)


def test_the_next_fire_time_is_a_run_already_made_for_it(team_a):
    """The materialiser made the next run ahead and moved next_due_at past it: why names the
    made run's time, as the job page does."""
    now = db_now()
    made = now + timedelta(seconds=40)
    definition = make_definition(
        team_a,
        "why.made-ahead",
        schedule={"cron": "* * * * *"},
        next_due_at=made + timedelta(minutes=1),
    )
    with shards.using(shards.alias_of_shard(definition.shard)):
        store.insert_runs([store.NewRun(definition.pk, "cron", made, made, "ahead")])

    (reason,) = [r for r in why_definition(definition, now) if r.code == "next_fire"]

    assert reason.detail == {"nextDueAt": format_utc(made)}


def test_a_fire_time_long_past_without_its_run_says_nothing_is_making_the_shards_runs(team_a):
    now = db_now()
    missed = now - timedelta(minutes=5)
    definition = make_definition(
        team_a, "why.unmade", queue="u", schedule={"cron": "* * * * *"}, next_due_at=missed
    )

    (reason,) = [r for r in why_definition(definition, now) if r.code == "not_materialised"]

    assert f"shard {definition.shard}" in reason.message and "/readyz" in reason.message
    assert reason.detail == {"nextDueAt": format_utc(missed), "shard": definition.shard}
    # Not while it is only a tick late, nor while a pause holds it.
    assert "not_materialised" not in codes(
        why_definition(definition, missed + timedelta(seconds=5))
    )
    Queue.objects.create(team=team_a, name="u", paused=True)
    assert "not_materialised" not in codes(why_definition(definition, now))
