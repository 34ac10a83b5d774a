"""Detection and deduplication against real runs: one page per incident, reminders, one
recovery, team-wide conditions, and never another team's events."""

from __future__ import annotations

from datetime import timedelta

import orjson
import pytest
from django.db import connection
from django.db.models import F
from django.utils.dateparse import parse_datetime

from apps.notify import detect
from apps.notify.models import Delivery, Incident
from apps.runs import store
from apps.runs.ids import parse_run_id
from apps.runs.models import Run
from apps.scheduler import leases
from tests.conftest import add_ready_runs, claim, everywhere, make_definition
from tests.notify.conftest import die, drain, make_channel, messages_of, readme_verifier, succeed

pytestmark = pytest.mark.django_db(transaction=True)


def test_a_flapping_job_pages_once_and_recovers_once_on_its_teams_channels_only(
    team_a, team_b, receiver, notifier, settings
):
    job = make_definition(team_a, "billing.flaky", queue="billing", retry_max_attempts=1)
    channel = make_channel(team_a, receiver.url)
    # Channels that must stay silent: another job's, another event's, another team's.
    make_channel(team_a, receiver.url + "?other-job", name="other", jobs=["billing.other"])
    make_channel(team_a, receiver.url + "?other-queue", name="queue", queues=["search"])
    make_channel(team_a, receiver.url + "?late", name="late", events=["job.late"])
    make_channel(team_b, receiver.url + "?team-b", name="b")
    for flap in range(3):
        die(job, prefix=f"dead-{flap}")
        notifier.handle_one_detection(force=True)
        succeed(job, prefix=f"ok-{flap}")
        notifier.handle_one_detection(force=True)
    drain(notifier)
    assert messages_of(receiver) == [("run.dead", "open")]
    assert receiver.requests[0].path == "/hooks/cronlease"
    incident = Incident.objects.get()
    assert incident.occurrences == 3 and incident.closed_at is None

    settings.SCHEDULER_NOTIFY_RECOVERY_SECONDS = 0  # quiet long enough
    notifier.handle_one_detection(force=True)
    notifier.handle_one_detection(force=True)  # nothing twice
    drain(notifier)
    assert messages_of(receiver) == [("run.dead", "open"), ("job.recovered", "resolved")]
    page, recovery = (orjson.loads(r.body) for r in receiver.requests)
    assert page["job"] == "billing.flaky" and page["team"] == "team-a"
    assert page["url"] == f"https://cronlease.example.test/runs/{page['runId']}"
    assert "is dead after 1 attempt (RuntimeError: boom)" in page["summary"]
    # A page's `at` is when its run died (before the incident opened: it was detected after).
    first_death = Run.objects.get(pk=parse_run_id(page["runId"])).finished_at
    assert parse_datetime(page["at"]) == first_death.replace(
        microsecond=first_death.microsecond // 1000 * 1000
    )
    assert parse_datetime(page["at"]) <= parse_datetime(page["incident"]["openedAt"])
    assert recovery["incident"]["id"] == page["incident"]["id"]
    assert recovery["incident"]["closedAt"] is not None
    verify = readme_verifier()
    assert all(
        verify(channel.secret, r.body, r.headers["X-Cronlease-Signature"])
        for r in receiver.requests
    )

    die(job, prefix="dead-again")  # after the recovery: a new incident, a new page
    notifier.handle_one_detection(force=True)
    notifier.handle_one_detection(force=True)  # quiet, but its latest run is dead: still open
    drain(notifier)
    assert messages_of(receiver)[2:] == [("run.dead", "open")]
    assert Incident.objects.filter(closed_at__isnull=True).count() == 1
    assert {r.path for r in receiver.requests} == {"/hooks/cronlease"}


def test_a_death_not_yet_read_keeps_the_incident_open_for_one_page_and_one_recovery(
    team_a, receiver, notifier, settings, monkeypatch
):
    """A run that died just before a success, while the detector has not read it yet (it
    reads up to a settled time): the incident does not recover past it, and no second
    incident opens for it once it is read."""
    job = make_definition(team_a, "billing.flaps", queue="billing", retry_max_attempts=1)
    make_channel(team_a, receiver.url)
    die(job, prefix="first")
    notifier.handle_one_detection(force=True)
    die(job, prefix="unread")
    succeed(job, prefix="after")
    settings.SCHEDULER_NOTIFY_RECOVERY_SECONDS = 0
    read_dead_runs = detect.dead_runs
    monkeypatch.setattr(detect, "dead_runs", lambda *args: False)  # a look that lags
    notifier.handle_one_detection(force=True)
    assert Incident.objects.get().closed_at is None
    monkeypatch.setattr(detect, "dead_runs", read_dead_runs)
    notifier.handle_one_detection(force=True)
    notifier.handle_one_detection(force=True)
    drain(notifier)
    assert messages_of(receiver) == [("run.dead", "open"), ("job.recovered", "resolved")]
    incident = Incident.objects.get()
    assert incident.occurrences == 2 and incident.closed_at is not None


def test_team_wide_conditions_page_once_are_reminded_and_resolve(
    team_a, team_b, receiver, notifier, settings
):
    """A full DLQ, then a shard without a scheduler: conditions seen on every look."""
    settings.SCHEDULER_NOTIFY_DLQ_THRESHOLD = 2
    job = make_definition(team_a, "billing.export", queue="billing", retry_max_attempts=1)
    make_channel(team_a, receiver.url, events=["dlq.threshold"])
    die(job, "a")
    notifier.handle_one_detection(force=True)
    die(job, "b")
    notifier.handle_one_detection(force=True)
    notifier.handle_one_detection(force=True)
    drain(notifier)
    assert messages_of(receiver) == [("dlq.threshold", "open")]
    page = orjson.loads(receiver.requests[0].body)
    assert page["job"] is None and page["summary"].startswith("The dead-letter queue holds 2 runs")
    assert page["url"] == "https://cronlease.example.test/dlq?team=team-a"

    settings.SCHEDULER_NOTIFY_REMINDER_SECONDS = 3600
    Incident.objects.update(
        opened_at=F("opened_at") - timedelta(hours=2),
        last_notified_at=F("last_notified_at") - timedelta(hours=2),
    )
    notifier.handle_one_detection(force=True)
    notifier.handle_one_detection(force=True)  # reminded just now: nothing
    drain(notifier)
    assert messages_of(receiver)[1:] == [("dlq.threshold", "reminder")]
    assert orjson.loads(receiver.requests[1].body)["summary"].startswith("Still open after 2 h")

    everywhere("UPDATE runs_run SET state = 'cancelled' WHERE state = 'dead'")
    settings.SCHEDULER_NOTIFY_RECOVERY_SECONDS = 0
    notifier.handle_one_detection(force=True)
    drain(notifier)
    assert messages_of(receiver)[2:] == [("dlq.threshold", "resolved")]
    resolved = orjson.loads(receiver.requests[2].body)["summary"]
    assert resolved.startswith("Resolved, not seen for ")
    assert "(the incident was open 2 h)" in resolved
    assert resolved.endswith("Last seen: The dead-letter queue holds 2 runs (threshold 2).")

    # Shard of team A's job unowned for an hour; team B's jobs are elsewhere.
    settings.SCHEDULER_NOTIFY_RECOVERY_SECONDS = 3600
    elsewhere = next(
        make_definition(team_b, f"search.reindex-{n}")
        for n in range(100)
        if _shard_of(f"search.reindex-{n}") != job.shard
    )
    make_channel(team_a, receiver.url + "?a", name="shards", events=["scheduler.shard_unowned"])
    make_channel(team_b, receiver.url + "?b", events=["scheduler.shard_unowned"])
    leases.ensure_shards(settings.SCHEDULER_SHARD_COUNT)
    with connection.cursor() as cursor:
        cursor.execute(
            "UPDATE scheduler_shardlease SET owner = 'node', expires_at = CASE WHEN shard = %s"
            " THEN now() - interval '1 hour' ELSE now() + interval '1 hour' END",
            [job.shard],
        )
    receiver.requests.clear()
    notifier.handle_one_detection(force=True)
    drain(notifier)
    assert [r.path for r in receiver.requests] == ["/hooks/cronlease?a"]
    page = orjson.loads(receiver.requests[0].body)
    assert page["event"] == "scheduler.shard_unowned"
    # Since when: the lease expired an hour ago, long before this look.
    assert page["summary"].startswith(
        f"Shard {job.shard} of the team's jobs has had no scheduler since 20"
    )
    assert "(1 h): their cron runs are not created" in page["summary"]
    assert elsewhere.shard != job.shard

    with connection.cursor() as cursor:
        cursor.execute("UPDATE scheduler_shardlease SET expires_at = now() + interval '1 hour'")
    settings.SCHEDULER_NOTIFY_RECOVERY_SECONDS = 0
    notifier.handle_one_detection(force=True)
    drain(notifier)
    assert messages_of(receiver)[-1] == ("scheduler.shard_unowned", "resolved")
    assert "has had no scheduler since 20" in orjson.loads(receiver.requests[-1].body)["summary"]


def test_a_scheduler_starting_after_an_outage_pages_the_shards_nobody_held(
    team_a, receiver, notifier, settings
):
    """Every scheduler was down (the notifier runs inside them): the first to start looks for
    events before it takes the shards, so the gap is paged, not taken over unseen."""
    from apps.scheduler.daemon import Scheduler

    make_definition(team_a, "billing.export", queue="billing")
    make_channel(team_a, receiver.url, events=["scheduler.shard_unowned"])
    leases.ensure_shards(settings.SCHEDULER_SHARD_COUNT)
    with connection.cursor() as cursor:
        cursor.execute("UPDATE scheduler_shardlease SET expires_at = now() - interval '1 hour'")
    Scheduler(node_id="first-back").look_before_taking()
    drain(notifier)
    assert messages_of(receiver) == [("scheduler.shard_unowned", "open")]


def _shard_of(name: str) -> int:
    from apps.jobs.schedule import shard_for

    return shard_for(name)


def _watched_every_five_minutes(team, name: str):
    """A job due every five minutes with a lateness SLO of a minute, made two hours ago."""
    job = make_definition(
        team,
        name,
        queue="billing",
        schedule={"cron": "*/5 * * * *", "jitterSeconds": 0},
        lateness_slo_seconds=60,
        timeout_seconds=60,
    )
    everywhere(
        "UPDATE jobs_jobdefinition SET created_at = now() - interval '2 hours' WHERE id = %s",
        [job.pk],
    )
    return job


def test_late_runs_and_missed_cron_times_each_page_once(team_a, receiver, notifier):
    job = _watched_every_five_minutes(team_a, "billing.nightly")
    add_ready_runs(job, 1, age_seconds=300)  # claimed 300 s after it became available
    claim(queues=["billing"], max_runs=1, worker_id="w", team_ids=[team_a.pk])
    make_channel(team_a, receiver.url, events=["job.late", "job.missed"])
    notifier.handle_one_detection(force=True)
    notifier.handle_one_detection(force=True)
    drain(notifier)
    assert sorted(messages_of(receiver)) == [("job.late", "open"), ("job.missed", "open")]
    bodies = {orjson.loads(r.body)["event"]: orjson.loads(r.body) for r in receiver.requests}
    assert "started 300" in bodies["job.late"]["summary"] and bodies["job.late"]["runId"]
    assert "No successful run for the cron time" in bodies["job.missed"]["summary"]
    assert Delivery.objects.count() == 2


def test_a_missed_time_recovers_when_that_time_has_run_not_an_earlier_one(
    team_a, receiver, notifier, settings
):
    job = _watched_every_five_minutes(team_a, "billing.every5")
    make_channel(team_a, receiver.url, events=["job.missed", "job.recovered"])
    notifier.handle_one_detection(force=True)
    missed = Incident.objects.get(event="job.missed")

    def run_and_succeed(due, key: str) -> None:
        store.insert_runs([store.NewRun(job.pk, "cron", due, due, key)])
        (lease,) = claim(queues=["billing"], max_runs=1, worker_id="w", team_ids=[team_a.pk])
        store.complete([(lease.id, lease.fencing_token, None)], team_ids=[team_a.pk])

    # The time before the missed one ran late, finishing after it: no answer to the missed time.
    run_and_succeed(missed.last_event_at - timedelta(minutes=5), "earlier")
    settings.SCHEDULER_NOTIFY_RECOVERY_SECONDS = 0
    notifier.handle_one_detection(force=True)
    assert Incident.objects.get(pk=missed.pk).closed_at is None
    run_and_succeed(missed.last_event_at, "the-missed-time")
    notifier.handle_one_detection(force=True)
    drain(notifier)
    assert Incident.objects.get(pk=missed.pk).closed_at is not None
    assert messages_of(receiver) == [("job.missed", "open"), ("job.recovered", "resolved")]


def test_a_run_late_while_it_waits_keeps_its_incident_open_until_it_stops_waiting(
    team_a, receiver, notifier, settings
):
    """A run no worker takes is late for as long as it waits: its incident's quiet time counts
    from the last look that found it waiting, not from when it was due (a recovery came 3 s
    after the run started 41 s late, saying "no job.late for 36 s")."""
    job = make_definition(team_a, "billing.stuck", queue="stuck", lateness_slo_seconds=60)
    make_channel(team_a, receiver.url, events=["job.late", "job.recovered"])
    add_ready_runs(job, 1, age_seconds=300)
    notifier.handle_one_detection(force=True)
    late = Incident.objects.get(event="job.late")
    assert "has not started" in late.summary
    # A minute passes, the run still waiting.
    Incident.objects.filter(pk=late.pk).update(
        opened_at=F("opened_at") - timedelta(minutes=1),
        last_seen_at=F("last_seen_at") - timedelta(minutes=1),
    )
    notifier.handle_one_detection(force=True)
    (lease,) = claim(queues=["stuck"], max_runs=1, worker_id="w", team_ids=[team_a.pk])
    store.complete([(lease.id, lease.fencing_token, None)], team_ids=[team_a.pk])
    settings.SCHEDULER_NOTIFY_RECOVERY_SECONDS = 30
    notifier.handle_one_detection(force=True)
    assert Incident.objects.get(pk=late.pk).closed_at is None  # waiting a moment ago
    Incident.objects.filter(pk=late.pk).update(
        last_seen_at=F("last_seen_at") - timedelta(minutes=1)
    )
    notifier.handle_one_detection(force=True)
    drain(notifier)
    assert Incident.objects.get(pk=late.pk).closed_at is not None
    assert messages_of(receiver) == [("job.late", "open"), ("job.recovered", "resolved")]


def test_a_later_run_late_in_its_turn_is_another_occurrence_and_the_one_messages_name(
    team_a, receiver, notifier, settings
):
    """Each look found the newest late run and took its words, but kept the first run's id and
    count: a reminder said "1 occurrence … run B has not started" and linked run A."""
    from apps.runs.ids import public_run_id

    job = make_definition(team_a, "billing.stalled", queue="stalled", lateness_slo_seconds=5)
    make_channel(team_a, receiver.url, events=["job.late"])
    (first,) = add_ready_runs(job, 1, prefix="a", age_seconds=300)
    notifier.handle_one_detection(force=True)
    notifier.handle_one_detection(force=True)  # the same run again: no other occurrence
    late = Incident.objects.get(event="job.late")
    assert (late.occurrences, late.run_id) == (1, public_run_id(first))
    (second,) = add_ready_runs(job, 1, prefix="b", age_seconds=200)
    notifier.handle_one_detection(force=True)
    notifier.handle_one_detection(force=True)
    late.refresh_from_db()
    assert (late.occurrences, late.run_id) == (2, public_run_id(second))
    settings.SCHEDULER_NOTIFY_REMINDER_SECONDS = 60
    Incident.objects.update(last_notified_at=F("last_notified_at") - timedelta(minutes=2))
    notifier.handle_one_detection(force=True)
    drain(notifier)
    assert messages_of(receiver) == [("job.late", "open"), ("job.late", "reminder")]
    reminder = orjson.loads(receiver.requests[1].body)
    assert reminder["runId"] == public_run_id(second)
    assert reminder["url"].endswith(f"/runs/{public_run_id(second)}")
    assert ", 2 occurrences (last seen" in reminder["summary"]
    assert public_run_id(second) in reminder["summary"]


def test_a_channel_added_during_an_incident_hears_its_recovery_once_it_had_a_reminder(
    team_a, receiver, notifier, settings
):
    """The README's rule: not paged for an incident already open; reminded; and told of the
    recovery if it was told of the incident (a reminder), not otherwise."""
    job = make_definition(team_a, "billing.midway", queue="billing", retry_max_attempts=1)
    make_channel(team_a, receiver.url + "?first", name="first")
    die(job, "a")
    notifier.handle_one_detection(force=True)
    make_channel(team_a, receiver.url + "?reminded", name="reminded")
    settings.SCHEDULER_NOTIFY_REMINDER_SECONDS = 60
    Incident.objects.update(last_notified_at=F("last_notified_at") - timedelta(minutes=2))
    notifier.handle_one_detection(force=True)
    make_channel(team_a, receiver.url + "?late", name="late")
    succeed(job, "ok")
    settings.SCHEDULER_NOTIFY_RECOVERY_SECONDS = 0
    notifier.handle_one_detection(force=True)
    drain(notifier)
    heard = sorted(
        (request.path.split("?")[1], orjson.loads(request.body)["phase"])
        for request in receiver.requests
    )
    assert heard == [
        ("first", "open"), ("first", "reminder"), ("first", "resolved"),
        ("reminded", "reminder"), ("reminded", "resolved"),
    ]  # fmt: skip


def test_a_reminder_counts_every_occurrence_of_its_incident(team_a, receiver, notifier, settings):
    job = make_definition(team_a, "billing.flaky", queue="billing", retry_max_attempts=1)
    make_channel(team_a, receiver.url, events=["run.dead"])
    for key in ("a", "b", "c"):
        die(job, key)
    notifier.handle_one_detection(force=True)
    die(job, "d")
    notifier.handle_one_detection(force=True)
    settings.SCHEDULER_NOTIFY_REMINDER_SECONDS = 60
    Incident.objects.update(last_notified_at=F("last_notified_at") - timedelta(minutes=2))
    notifier.handle_one_detection(force=True)
    drain(notifier)
    assert messages_of(receiver) == [("run.dead", "open"), ("run.dead", "reminder")]
    opened, reminder = (orjson.loads(r.body)["summary"] for r in receiver.requests)
    assert "3 runs died" in opened
    # The latest occurrence is one death; the incident's count is all four.
    assert ", 4 occurrences (last seen" in reminder and "is dead after" in reminder


def test_a_job_deleted_during_its_incident_closes_it_saying_so(
    team_a, receiver, notifier, settings
):
    """The channels that were paged hear that the incident is over because its job is gone:
    closed without a message, a receiver's alert stayed open for good."""
    from apps.audit.record import Actor
    from apps.jobs import services

    job = make_definition(team_a, "billing.gone", queue="billing", retry_max_attempts=1)
    make_channel(team_a, receiver.url)
    die(job)
    notifier.handle_one_detection(force=True)
    services.delete_definition(job, Actor.cli("test"))
    settings.SCHEDULER_NOTIFY_RECOVERY_SECONDS = 0
    notifier.handle_one_detection(force=True)
    drain(notifier)
    assert messages_of(receiver) == [("run.dead", "open"), ("job.recovered", "resolved")]
    resolved = orjson.loads(receiver.requests[1].body)
    assert resolved["job"] == "billing.gone"
    assert resolved["summary"].startswith(
        "billing.gone was deleted: its run.dead incident is closed"
    )
    assert resolved["incident"]["closedAt"] is not None
    assert Incident.objects.get().closed_at is not None
