"""The materialiser: fire times become runs, missed runs follow the policy, bad rows are isolated.

These tests run inside a test transaction, so the database clock (`now()`) stands still: every
time below is relative to it.
"""

from __future__ import annotations

import threading
import time
from datetime import UTC, datetime, timedelta
from random import Random
from zoneinfo import ZoneInfo

import pytest
from django.db import DatabaseError, connections

from apps.audit.models import AuditEvent
from apps.audit.record import Actor
from apps.jobs import firetimes, services
from apps.jobs import schedule as sched
from apps.jobs.models import JobDefinition
from apps.runs import store
from apps.runs.ids import public_run_id
from apps.runs.models import Run
from apps.scheduler import materialiser
from apps.scheduler.daemon import Scheduler
from tests.conftest import other_session
from tests.scheduler.helpers import a_definition, db_now, floor_minute, names_in_shard

pytestmark = pytest.mark.django_db

BERLIN = ZoneInfo("Europe/Berlin")


def a_scheduler(**options) -> Scheduler:
    return Scheduler(node_id="test-node", **options)


def hourly_stopped_three_hours(policy: str) -> tuple[JobDefinition, list]:
    """An hourly Berlin job whose scheduler was stopped for 3 hours; return it and its 3 missed times.

    The cron minute sits 30 minutes away from now, so no fire time is near the grace boundary or
    inside the lookahead.
    """
    now = db_now()
    schedule = {
        "cron": f"{(now.minute + 30) % 60} * * * *",
        "timeZone": "Europe/Berlin",
        "jitterSeconds": 60,
        "missedRunPolicy": policy,
    }
    parsed = sched.parse_schedule(schedule)
    missed = firetimes.fire_times_between(parsed, now - timedelta(hours=3), now, 10)
    assert len(missed) == 3
    definition = a_definition(f"reports.hourly-{policy}", schedule, missed[0].utc)
    return definition, missed


def expected_key(name: str, due) -> str:
    return f"{name}@{due.astimezone(BERLIN).isoformat()}"


def test_run_once_inserts_one_catch_up_run_for_the_latest_missed_time():
    definition, missed = hourly_stopped_three_hours("run_once")

    a_scheduler().tick()

    runs = list(Run.objects.filter(definition=definition))
    assert [(r.trigger, r.due_at) for r in runs] == [("catch_up", missed[-1].utc)]
    run = runs[0]
    assert run.idempotency_key == expected_key(definition.name, missed[-1].utc)
    assert run.idempotency_key.endswith(missed[-1].local.isoformat())
    jitter = sched.jitter_offset(definition.name, 60)
    assert run.available_at == run.due_at + timedelta(seconds=jitter)
    definition.refresh_from_db()
    assert definition.next_due_at == missed[-1].utc + timedelta(hours=1)
    assert definition.next_due_at > db_now()


def test_run_all_inserts_a_catch_up_run_for_every_missed_time():
    definition, missed = hourly_stopped_three_hours("run_all")

    a_scheduler().tick()

    runs = Run.objects.filter(definition=definition).order_by("due_at")
    assert [r.due_at for r in runs] == [m.utc for m in missed]
    assert {r.trigger for r in runs} == {"catch_up"}
    assert [r.idempotency_key for r in runs] == [
        expected_key(definition.name, m.utc) for m in missed
    ]
    definition.refresh_from_db()
    assert definition.next_due_at > db_now()
    assert definition.missed_runs_note == ""


def test_skip_inserts_no_missed_run_and_moves_on():
    definition, missed = hourly_stopped_three_hours("skip")

    a_scheduler().tick()

    assert not Run.objects.filter(definition=definition).exists()
    definition.refresh_from_db()
    assert definition.next_due_at == missed[-1].utc + timedelta(hours=1)


def test_run_all_keeps_only_the_latest_runs_up_to_the_cap_and_notes_it():
    now = db_now()
    stopped_at = floor_minute(now) - timedelta(minutes=150)
    schedule = {"cron": "* * * * *", "jitterSeconds": 0, "missedRunPolicy": "run_all"}
    definition = a_definition("metrics.minutely", schedule, stopped_at)
    scheduler = a_scheduler(missed_cap=100)

    scheduler.tick()

    catch_up = list(
        Run.objects.filter(definition=definition, trigger="catch_up").order_by("due_at")
    )
    assert len(catch_up) == 100
    # The latest 100 missed minutes, back to back, ending just before the grace window.
    cutoff = now - scheduler.grace
    assert catch_up[-1].due_at < cutoff <= catch_up[-1].due_at + timedelta(minutes=1)
    gaps = {(b.due_at - a.due_at) for a, b in zip(catch_up, catch_up[1:], strict=False)}
    assert gaps == {timedelta(minutes=1)}
    # Times inside the grace window and the lookahead are ordinary cron runs.
    cron = list(Run.objects.filter(definition=definition, trigger="cron").order_by("due_at"))
    assert cron and cron[0].due_at == catch_up[-1].due_at + timedelta(minutes=1)
    assert cron[-1].due_at <= now + scheduler.lookahead
    definition.refresh_from_db()
    assert "cap of 100" in definition.missed_runs_note
    assert definition.next_due_at == cron[-1].due_at + timedelta(minutes=1)


def test_paused_definitions_are_not_materialised():
    now = db_now()
    due = floor_minute(now) + timedelta(minutes=1)
    definition = a_definition("paused.job", {"cron": "* * * * *"}, due, paused=True)

    a_scheduler().tick()

    assert not Run.objects.filter(definition=definition).exists()
    definition.refresh_from_db()
    assert definition.next_due_at == due


def test_a_paused_queue_makes_no_runs_and_its_resume_does_not_back_fill_the_pause():
    now = db_now()
    missed = floor_minute(now) - timedelta(minutes=3)  # due while the queue was paused
    definition = a_definition("queued.job", {"cron": "* * * * *"}, missed, queue="held")
    kept = a_definition("other.job", {"cron": "* * * * *"}, missed, queue="open")
    actor = Actor.cli("test")
    services.set_queue_paused(definition.team, "held", True, actor)

    scheduler = a_scheduler()
    scheduler.tick()
    assert not Run.objects.filter(definition=definition).exists()
    assert Run.objects.filter(definition=kept).exists()  # another queue goes on
    definition.refresh_from_db()
    assert definition.next_due_at == missed

    services.set_queue_paused(definition.team, "held", False, actor)
    definition.refresh_from_db()
    # Restarted from now, as a definition's own resume does: no run for the paused minutes.
    assert definition.next_due_at == floor_minute(now) + timedelta(minutes=1)
    scheduler.tick()
    assert min(Run.objects.filter(definition=definition).values_list("due_at", flat=True)) > now


def test_a_pause_deletes_the_runs_made_ahead_that_nobody_claimed():
    now = db_now()
    due = floor_minute(now) + timedelta(minutes=1)
    by_job = a_definition("ahead.job", {"cron": "* * * * *"}, due, queue="ahead")
    by_queue = a_definition("ahead.queue", {"cron": "* * * * *"}, due, queue="ahead-q")
    a_scheduler().tick()
    assert Run.objects.filter(definition__in=[by_job, by_queue], due_at=due).count() == 2

    actor = Actor.cli("test")
    services.set_paused(by_job, True, actor)
    services.set_queue_paused(by_queue.team, "ahead-q", True, actor)
    # Their fire time falls inside the pause: it is not run after the resume either.
    assert not Run.objects.filter(definition__in=[by_job, by_queue]).exists()


def test_resuming_a_delayed_job_that_already_ran_does_not_run_it_again():
    definition = a_definition("once.later", {"delaySeconds": 0}, db_now())
    a_scheduler().tick()
    assert Run.objects.filter(definition=definition).count() == 1
    definition.refresh_from_db()
    assert definition.next_due_at is None
    actor = Actor.cli("test")
    paused, _ = services.set_paused(definition, True, actor)
    services.set_paused(paused, False, actor)
    a_scheduler().tick()
    assert Run.objects.filter(definition=definition).count() == 1
    assert JobDefinition.objects.get(pk=definition.pk).next_due_at is None


def test_cron_run_due_within_the_lookahead_gets_its_jitter_and_key():
    now = db_now()
    due = floor_minute(now) + timedelta(minutes=1)
    schedule = {"cron": "* * * * *", "timeZone": "Europe/Berlin", "jitterSeconds": 45}
    definition = a_definition("billing.export-invoices", schedule, due)

    a_scheduler().tick()

    run = Run.objects.get(definition=definition)
    assert (run.trigger, run.due_at, run.state) == ("cron", due, "scheduled")
    assert run.available_at == due + timedelta(seconds=sched.jitter_offset(definition.name, 45))
    assert run.idempotency_key == expected_key(definition.name, due)
    assert (run.queue, run.priority, run.shard) == (
        definition.queue,
        definition.priority,
        definition.shard,
    )
    definition.refresh_from_db()
    assert definition.next_due_at == due + timedelta(minutes=1)


def test_one_off_and_delayed_definitions_run_once_then_have_nothing_due():
    now = db_now()
    run_at = (now - timedelta(minutes=5)).replace(microsecond=0)
    one_off = a_definition("ops.migrate-once", {"runAt": run_at.isoformat()}, run_at)
    delayed_due = now + timedelta(seconds=30)
    delayed = a_definition("ops.delayed", {"delaySeconds": 300}, delayed_due)

    a_scheduler().tick()

    run = Run.objects.get(definition=one_off)
    # A past runAt runs at once, as a scheduled (cron) run without jitter.
    assert (run.trigger, run.due_at, run.available_at) == ("cron", run_at, run_at)
    assert run.idempotency_key == f"ops.migrate-once@{run_at.astimezone(UTC).isoformat()}"
    run = Run.objects.get(definition=delayed)
    assert (run.trigger, run.due_at, run.available_at) == ("cron", delayed_due, delayed_due)
    for definition in (one_off, delayed):
        definition.refresh_from_db()
        assert definition.next_due_at is None


def test_materialising_again_after_a_failover_inserts_nothing_twice():
    now = db_now()
    start = floor_minute(now) - timedelta(minutes=5)
    definition = a_definition(
        "etl.load", {"cron": "* * * * *", "jitterSeconds": 0, "missedRunPolicy": "run_all"}, start
    )
    old_owner = a_scheduler()
    old_owner.tick()
    first = sorted(Run.objects.filter(definition=definition).values_list("due_at", flat=True))
    advanced = JobDefinition.objects.get(pk=definition.pk).next_due_at

    # A new owner that read the definition before the old one's commit does the same work again.
    old_owner.leave()
    JobDefinition.objects.filter(pk=definition.pk).update(next_due_at=start)
    new_owner = Scheduler(node_id="other-node")
    assert new_owner.tick().acquired == list(range(16))

    again = sorted(Run.objects.filter(definition=definition).values_list("due_at", flat=True))
    assert again == first
    assert len(set(first)) == len(first) >= 6
    assert JobDefinition.objects.get(pk=definition.pk).next_due_at == advanced


def test_a_bad_schedule_is_pushed_forward_and_the_rest_of_the_shard_still_runs():
    now = db_now()
    due = floor_minute(now) + timedelta(minutes=1)
    bad_name, good_name = names_in_shard(3, 2, prefix="mixed")
    # Stored behind the API's back: validation would have refused it.
    bad = a_definition(bad_name, {"cron": "every tuesday"}, now - timedelta(minutes=1))
    good = a_definition(good_name, {"cron": "* * * * *"}, due)
    scheduler = a_scheduler()

    scheduler.tick()
    scheduler.tick()

    assert Run.objects.filter(definition=good).count() == 1
    assert not Run.objects.filter(definition=bad).exists()
    bad.refresh_from_db()
    assert bad.next_due_at > now + scheduler.lookahead
    assert not bad.paused


def test_a_shard_is_materialised_in_batches_until_none_is_due():
    now = db_now()
    due = floor_minute(now) + timedelta(minutes=1)
    names = names_in_shard(5, 5, prefix="batch")
    for name in names:
        a_definition(name, {"cron": "* * * * *"}, due)
    scheduler = a_scheduler(batch=2)
    scheduler.read_clock()
    scheduler.handle_one_lease_round()

    steps = [scheduler.handle_one_materialise(5) for _ in range(4)]

    assert steps == [True, True, False, False]
    assert Run.objects.filter(definition__name__in=names).count() == 5


def test_a_cron_runs_idempotency_key_is_stable_across_retries():
    now = db_now()
    due = floor_minute(now)
    definition = a_definition(
        "billing.retry-me",
        {"cron": "* * * * *", "timeZone": "Europe/Berlin", "jitterSeconds": 0},
        due,
        retry_base_seconds=0,
        retry_max_attempts=3,
    )
    # A long lease TTL makes the grace cover the whole current minute: the run is a plain cron run.
    a_scheduler(lease_seconds=60).tick()
    run = Run.objects.get(definition=definition, due_at=due)
    assert run.trigger == "cron"
    key = expected_key(definition.name, due)

    first = store.claim(queues=["default"], max_runs=1, worker_id="w-1", lease_seconds=30)
    assert [lease.idempotency_key for lease in first] == [key]
    [outcome] = store.fail(
        [(run.pk, first[0].fencing_token, {"message": "boom"}, True)],
        team_ids=[definition.team_id],
    )
    assert outcome.status == 200 and outcome.state == "retrying"
    second = store.claim(queues=["default"], max_runs=1, worker_id="w-2", lease_seconds=30)

    assert [(lease.id, lease.attempt) for lease in second] == [(run.pk, 2)]
    assert second[0].idempotency_key == key
    assert second[0].fencing_token > first[0].fencing_token
    run.refresh_from_db()
    assert run.idempotency_key == key


def test_a_definition_whose_runs_cannot_be_inserted_does_not_block_the_others(monkeypatch):
    now = db_now()
    due = floor_minute(now) + timedelta(minutes=1)
    poisoned_name, *healthy_names = names_in_shard(9, 3, prefix="poison")
    poisoned = a_definition(poisoned_name, {"cron": "* * * * *"}, due)
    healthy = [a_definition(name, {"cron": "* * * * *"}, due) for name in healthy_names]
    real_insert = materialiser.insert_runs

    def insert_refusing_poison(runs):
        if any(run.definition_id == poisoned.pk for run in runs):
            raise DatabaseError("value too long for type character varying(300)")
        return real_insert(runs)

    monkeypatch.setattr(materialiser, "insert_runs", insert_refusing_poison)
    scheduler = a_scheduler()

    scheduler.tick()

    assert Run.objects.filter(definition__in=healthy).count() == 2
    assert not Run.objects.filter(definition=poisoned).exists()
    poisoned.refresh_from_db()
    assert poisoned.next_due_at == now + materialiser.BAD_DEFINITION_RETRY
    for definition in healthy:
        definition.refresh_from_db()
        assert definition.next_due_at == due + timedelta(minutes=1)


def test_a_one_off_long_past_keeps_its_due_time_but_is_available_now():
    now = db_now()
    run_at = datetime(1970, 1, 1, tzinfo=UTC)
    one_off = a_definition("ops.ancient", {"runAt": run_at.isoformat()}, run_at)

    a_scheduler().tick()

    run = Run.objects.get(definition=one_off)
    # Its lateness counts from now, not from 1970 (which would move every figure of its queue).
    assert run.due_at == run_at
    assert now - timedelta(seconds=5) <= run.available_at <= db_now()


# --- schedule bounds (startAt, endAt) -------------------------------------------------------


def test_a_schedule_ending_inside_an_outage_catches_up_only_to_its_end_then_stops():
    now = db_now()
    stopped_at = floor_minute(now) - timedelta(hours=3)
    end = stopped_at + timedelta(minutes=4)
    schedule = {
        "cron": "* * * * *",
        "jitterSeconds": 0,
        "missedRunPolicy": "run_all",
        "endAt": end.isoformat(),
    }
    definition = a_definition("etl.ending", schedule, stopped_at)

    a_scheduler().tick()

    runs = Run.objects.filter(definition=definition).order_by("due_at")
    assert [r.due_at for r in runs] == [stopped_at + timedelta(minutes=m) for m in range(5)]
    assert {r.trigger for r in runs} == {"catch_up"}
    definition.refresh_from_db()
    assert definition.next_due_at is None


def test_a_schedule_ending_within_the_lookahead_inserts_its_last_run_and_stops():
    now = db_now()
    due = floor_minute(now) + timedelta(minutes=1)
    schedule = {"cron": "* * * * *", "jitterSeconds": 0, "endAt": due.isoformat()}
    definition = a_definition("etl.last-minute", schedule, due)

    a_scheduler(lookahead_seconds=600).tick()

    assert [r.due_at for r in Run.objects.filter(definition=definition)] == [due]
    definition.refresh_from_db()
    assert definition.next_due_at is None


def test_an_ended_schedule_gets_no_next_due_time_and_is_never_materialised():
    now = db_now()
    schedule = {"cron": "* * * * *", "endAt": (now - timedelta(minutes=1)).isoformat()}

    assert services.initial_next_due_at(schedule, now) is None
    definition = a_definition("etl.over", schedule, services.initial_next_due_at(schedule, now))
    a_scheduler(lookahead_seconds=600).tick()

    assert not Run.objects.filter(definition=definition).exists()


def test_a_schedule_starting_later_first_fires_at_its_start_and_not_before():
    now = db_now()
    start = floor_minute(now) + timedelta(minutes=5)
    schedule = {"cron": "* * * * *", "jitterSeconds": 0, "startAt": start.isoformat()}
    next_due = services.initial_next_due_at(schedule, now)
    assert next_due == start
    definition = a_definition("etl.later", schedule, next_due)

    scheduler = a_scheduler(lookahead_seconds=60)
    scheduler.tick()
    assert not Run.objects.filter(definition=definition).exists()
    scheduler.lookahead = timedelta(minutes=10)
    scheduler.tick()

    due_times = [r.due_at for r in Run.objects.filter(definition=definition).order_by("due_at")]
    assert due_times[0] == start
    assert all(due >= start for due in due_times)


# --- overlap policy -------------------------------------------------------------------------

POLICIES = ("allow_all", "skip", "buffer_one", "cancel_other")
# The existing runs a fire time meets: each is (state, trigger), oldest first. The waiting one
# is an API run: runs of the definition count whatever created them.
EXISTING = {
    "none": (),
    "waiting": (("scheduled", "api"),),
    "leased": (("leased", "cron"),),
    "leased+waiting": (("leased", "cron"), ("scheduled", "api")),
    "retrying": (("retrying", "cron"),),
}
# What the fire time does: whether it inserts its run, and what becomes of the existing runs
# ((state, cancel_requested), oldest first).
KEEP = "keep"
CANCEL = "cancel"
EXPECTED = {
    # policy: {existing: (new run?, what happens to the existing runs)}
    "allow_all": {case: (True, KEEP) for case in EXISTING},
    "skip": {"none": (True, KEEP)} | {case: (False, KEEP) for case in EXISTING if case != "none"},
    "buffer_one": {
        "none": (True, KEEP),
        "waiting": (False, KEEP),
        "leased": (True, KEEP),
        "leased+waiting": (False, KEEP),
        "retrying": (False, KEEP),
    },
    "cancel_other": {case: (True, CANCEL) for case in EXISTING},
}


def utc_key(name: str, due) -> str:
    """The key of a cron run of a UTC schedule."""
    return sched.idempotency_key(name, due.astimezone(ZoneInfo("UTC")))


def existing_runs(definition: JobDefinition, due, states) -> list[int]:
    """Runs of the definition in these states, due a minute apart before `due`, oldest first."""
    ids = []
    for index, (state, trigger) in enumerate(states):
        earlier = due - timedelta(minutes=len(states) - index)
        key = utc_key(definition.name, earlier) if trigger == "cron" else f"api-{index}"
        [run_id] = store.insert_runs(
            [store.NewRun(definition.pk, trigger, earlier, earlier - timedelta(minutes=5), key)]
        )
        if state in ("leased", "retrying"):
            [lease] = store.claim(
                queues=[definition.queue], max_runs=1, worker_id="w-1", lease_seconds=300
            )
            assert lease.id == run_id
            if state == "retrying":
                [outcome] = store.fail(
                    [(run_id, lease.fencing_token, {"message": "boom"}, True)],
                    team_ids=[definition.team_id],
                )
                assert outcome.state == "retrying"
        ids.append(run_id)
    return ids


def after_cancel(state: str) -> tuple[str, bool]:
    """What cancel_other makes of an existing run in this state."""
    return ("leased", True) if state == "leased" else ("cancelled", False)


@pytest.mark.parametrize("case", list(EXISTING))
@pytest.mark.parametrize("policy", POLICIES)
def test_an_overlap_policy_decides_the_next_fire_time_from_the_runs_it_meets(policy, case):
    now = db_now()
    due = floor_minute(now)
    schedule = {"cron": "* * * * *", "jitterSeconds": 0, "overlapPolicy": policy}
    definition = a_definition(
        "etl.load", schedule, due, queue="etl", retry_base_seconds=3600, retry_max_seconds=3600
    )
    prior = existing_runs(definition, due, EXISTING[case])
    inserts, fate = EXPECTED[policy][case]

    # A lease TTL of 60 s makes the grace cover the minute: the fire time is a plain cron run.
    # No lookahead: allow_all would take the next minute's run too.
    report = a_scheduler(lease_seconds=60, lookahead_seconds=0).tick()

    new = list(Run.objects.filter(definition=definition, due_at=due))
    assert [(run.trigger, run.state) for run in new] == ([("cron", "scheduled")] if inserts else [])
    states = [
        (run.state, run.cancel_requested)
        for run in sorted(Run.objects.filter(pk__in=prior), key=lambda run: run.due_at)
    ]
    if fate == KEEP:
        assert states == [(state, False) for state, _ in EXISTING[case]]
    else:
        assert states == [after_cancel(state) for state, _ in EXISTING[case]]
    assert (report.inserted, report.skipped) == (int(inserts), int(not inserts))
    assert report.cancelled == (len(prior) if fate == CANCEL else 0)
    definition.refresh_from_db()
    assert definition.next_due_at == due + timedelta(minutes=1)
    events = list(AuditEvent.objects.filter(action="job.overlap_cancel"))
    assert len(events) == (1 if fate == CANCEL and prior else 0)


def test_cancel_other_audits_one_event_per_fire_time_with_its_counts():
    now = db_now()
    due = floor_minute(now)
    schedule = {"cron": "* * * * *", "jitterSeconds": 0, "overlapPolicy": "cancel_other"}
    definition = a_definition("etl.latest", schedule, due, queue="etl")
    leased, waiting = existing_runs(definition, due, EXISTING["leased+waiting"])

    a_scheduler(lease_seconds=60).tick()

    event = AuditEvent.objects.get(action="job.overlap_cancel")
    assert (event.source, event.actor, event.team_id) == ("system", "scheduler", definition.team_id)
    assert (event.target_type, event.target) == ("job", "etl.latest")
    assert event.after == {
        "overlapPolicy": "cancel_other",
        "dueAt": due.strftime("%Y-%m-%dT%H:%M:%SZ"),
        "cancelled": 1,
        "cancelRequested": 1,
        "runIds": [public_run_id(leased), public_run_id(waiting)],
    }
    # The leased run's worker is told at its next heartbeat.
    lease = Run.objects.get(pk=leased)
    [outcome] = store.heartbeat([(leased, lease.fencing_token)], team_ids=[definition.team_id])
    assert (outcome.status, outcome.code) == (409, "cancelled")


def test_cancel_other_spares_the_run_of_its_own_fire_time():
    # A failover: the run of this fire time exists already (the first owner inserted it).
    now = db_now()
    due = floor_minute(now)
    schedule = {"cron": "* * * * *", "jitterSeconds": 0, "overlapPolicy": "cancel_other"}
    definition = a_definition("etl.again", schedule, due, queue="etl")
    [own] = store.insert_runs(
        [store.NewRun(definition.pk, "cron", due, due, utc_key(definition.name, due))]
    )

    report = a_scheduler(lease_seconds=60).tick()

    assert Run.objects.get(pk=own).state == "scheduled"
    assert Run.objects.filter(definition=definition).count() == 1
    assert (report.inserted, report.cancelled) == (0, 0)


def test_a_definition_with_an_overlap_policy_is_materialised_at_its_fire_time_not_ahead():
    now = db_now()
    due = floor_minute(now) + timedelta(minutes=1)
    skip_name, free_name = names_in_shard(4, 2, prefix="ahead")
    cron = {"cron": "* * * * *", "jitterSeconds": 0}
    policed = a_definition(skip_name, {**cron, "overlapPolicy": "skip"}, due)
    free = a_definition(free_name, cron, due)
    scheduler = a_scheduler(lookahead_seconds=120)

    scheduler.tick()

    # The lookahead takes the free one's run early; the policed one waits for its time, when
    # the runs it is judged against are the ones of that time.
    assert Run.objects.filter(definition=free).count() >= 1
    assert not Run.objects.filter(definition=policed).exists()
    policed.refresh_from_db()
    assert policed.next_due_at == due
    scheduler.now = due
    scheduler.handle_one_materialise(4)
    assert [r.due_at for r in Run.objects.filter(definition=policed)] == [due]
    policed.refresh_from_db()
    assert policed.next_due_at == due + timedelta(minutes=1)


@pytest.mark.parametrize("cap", [1000, 2])
@pytest.mark.parametrize(
    ("policy", "kept"), [("skip", "first"), ("buffer_one", "first"), ("cancel_other", "last")]
)
def test_a_catch_up_after_an_outage_keeps_one_run_the_first_making_the_others_overlap(
    policy, kept, cap
):
    now = db_now()
    stopped_at = floor_minute(now) - timedelta(minutes=10)
    schedule = {
        "cron": "* * * * *",
        "jitterSeconds": 0,
        "missedRunPolicy": "run_all",
        "overlapPolicy": policy,
    }
    definition = a_definition(f"etl.outage-{policy}", schedule, stopped_at)
    scheduler = a_scheduler(missed_cap=cap)
    times = firetimes.fire_times_between(
        sched.parse_schedule(schedule), stopped_at - timedelta(seconds=1), now, 100
    )

    report = scheduler.tick()

    # With a cap below the missed times too: the first missed time for skip and buffer_one.
    [run] = Run.objects.filter(definition=definition)
    assert run.due_at == (times[0] if kept == "first" else times[-1]).utc
    if cap > len(times):
        assert report.skipped == len(times) - 1 >= 9
    definition.refresh_from_db()
    assert now < definition.next_due_at <= now + timedelta(minutes=1)
    # No note of the cap: one run was inserted, as without it.
    assert "cap of" not in definition.missed_runs_note


def test_keep_slots_judges_the_slots_in_order():
    slots = tuple(
        materialiser.Slot(datetime(2030, 1, 1, 0, m, tzinfo=UTC), datetime(2030, 1, 1), "cron")
        for m in range(3)
    )
    keep = materialiser.keep_slots

    assert keep("allow_all", slots, waiting=True, leased=True) == slots
    assert keep("skip", slots, waiting=False, leased=False) == slots[:1]
    assert keep("skip", slots, waiting=False, leased=True) == ()
    assert keep("buffer_one", slots, waiting=False, leased=True) == slots[:1]
    assert keep("buffer_one", slots, waiting=True, leased=False) == ()
    assert keep("cancel_other", slots, waiting=True, leased=True) == slots[2:]
    assert keep("skip", (), waiting=False, leased=False) == ()
    with pytest.raises(ValueError, match="unknown overlap policy"):
        keep("sometimes", slots, waiting=False, leased=False)


# --- overlap policy against other transactions (committed data, real connections) -------------


def a_held_shard(scheduler: Scheduler) -> Scheduler:
    """The scheduler, holding every shard, its clock set by each test (materialise_at)."""
    scheduler.handle_one_lease_round()
    assert len(scheduler.held) == 16
    return scheduler


def materialise_at(scheduler: Scheduler, definition: JobDefinition, now: datetime) -> None:
    scheduler.now = now
    scheduler.handle_one_materialise(definition.shard)


@pytest.mark.django_db(transaction=True)
def test_cancel_other_leaves_a_fire_time_to_the_next_tick_while_another_transaction_holds_a_run():
    # The past, so the runs are claimable now; the materialiser's clock is the test's.
    due = floor_minute(db_now()) - timedelta(days=1)
    schedule = {"cron": "* * * * *", "jitterSeconds": 0, "overlapPolicy": "cancel_other"}
    definition = a_definition("etl.held", schedule, due, queue="etl")
    [waiting] = existing_runs(definition, due, EXISTING["waiting"])
    scheduler = a_held_shard(a_scheduler(lease_seconds=60))

    with other_session() as holder:
        # A heartbeat, a claim or a report holds the row for a moment; this one keeps holding.
        holder.execute("SELECT 1 FROM runs_run WHERE id = %s FOR UPDATE", [waiting])
        materialise_at(scheduler, definition, due + timedelta(seconds=1))

        assert Run.objects.get(pk=waiting).state == "scheduled"
        assert not Run.objects.filter(definition=definition, due_at=due).exists()
        assert JobDefinition.objects.get(pk=definition.pk).next_due_at == due
        assert scheduler.report.cancelled == 0
        holder.rollback()

    materialise_at(scheduler, definition, due + timedelta(seconds=2))

    assert Run.objects.get(pk=waiting).state == "cancelled"
    assert Run.objects.get(definition=definition, due_at=due).state == "scheduled"
    assert JobDefinition.objects.get(pk=definition.pk).next_due_at == due + timedelta(minutes=1)


def unfinished(definition: JobDefinition) -> list[tuple[str, bool]]:
    """(state, cancel_requested) of the definition's runs that are not finished."""
    return list(
        Run.objects.filter(definition=definition)
        .exclude(state__in=("succeeded", "dead", "cancelled"))
        .values_list("state", "cancel_requested")
    )


# What each policy promises of the runs it leaves, checked after every fire time. The claimer
# completes runs, and fails some (skip and cancel_other only: a failed run waiting again beside a
# buffered one is a retry, which buffer_one does not bound; see the README).
INVARIANTS = {
    # Never two runs that are not finished.
    "skip": lambda runs: len(runs) <= 1,
    # Never two waiting.
    "buffer_one": lambda runs: sum(state != "leased" for state, _ in runs) <= 1,
    # Only the newest neither finished nor told to stop.
    "cancel_other": lambda runs: sum(not asked for _, asked in runs) <= 1,
}


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("policy", list(INVARIANTS))
def test_an_overlap_policy_holds_while_a_worker_claims_and_finishes_runs_at_the_same_time(policy):
    """The materialiser steps through 120 fire times, as fast as it can, while a worker on its
    own connection leases the runs, keeps each for a few of those fire times, then completes it
    (or, but for buffer_one, fails it: a retry waits again)."""
    start = floor_minute(db_now()) - timedelta(days=1)
    schedule = {"cron": "* * * * *", "jitterSeconds": 0, "overlapPolicy": policy}
    definition = a_definition(
        f"etl.busy-{policy}", schedule, start, queue="busy", retry_base_seconds=0
    )
    scheduler = a_held_shard(a_scheduler(lease_seconds=60))
    stop = threading.Event()
    leased: list[int] = []
    random = Random(policy)

    def worker() -> None:
        held: list[tuple[store.Lease, int]] = []
        try:
            while not stop.is_set():
                for lease in store.claim(
                    queues=["busy"], max_runs=2, worker_id="w-1", lease_seconds=300
                ):
                    leased.append(lease.id)
                    held.append((lease, random.randint(1, 12)))
                done = [lease for lease, turns in held if turns <= 0]
                held = [(lease, turns - 1) for lease, turns in held if turns > 0]
                failing = policy != "buffer_one" and random.random() < 0.3
                if done and failing:
                    items = [
                        (lease.id, lease.fencing_token, {"message": "x"}, True) for lease in done
                    ]
                    store.fail(items, team_ids=[definition.team_id])
                elif done:
                    items = [(lease.id, lease.fencing_token, None) for lease in done]
                    store.complete(items, team_ids=[definition.team_id])
                time.sleep(random.random() / 500)
        finally:
            connections.close_all()

    claimer = threading.Thread(target=worker)
    claimer.start()
    broken = []
    try:
        for minute in range(120):
            materialise_at(scheduler, definition, start + timedelta(minutes=minute, seconds=1))
            runs = unfinished(definition)
            if not INVARIANTS[policy](runs):
                broken.append((minute, runs))
            time.sleep(random.random() / 500)
    finally:
        stop.set()
        claimer.join(timeout=30)

    assert broken == []
    created = Run.objects.filter(definition=definition).count()
    # Both sides did something: runs were leased, and fire times were both run and skipped.
    assert len(set(leased)) >= 10
    assert 10 <= created
    if policy != "cancel_other":
        assert created < 120
    else:
        assert Run.objects.filter(definition=definition, cancel_requested=True).exists()
