"""Backfill over the API: preview, then create each cron time of the range once."""

from __future__ import annotations

from datetime import datetime, timedelta

import pytest
from django.utils.dateparse import parse_datetime

from apps.audit.models import AuditEvent
from apps.runs.clock import format_utc
from apps.runs.models import Run
from tests.conftest import db_now

pytestmark = pytest.mark.django_db(transaction=True)

HOURLY_BERLIN = {"cron": "30 * * * *", "timeZone": "Europe/Berlin", "jitterSeconds": 0}


def test_backfill_across_a_dst_change_creates_each_time_once(api_a):
    api_a.post("/api/v1/jobs", {"name": "etl.hourly", "queue": "etl", "schedule": HOURLY_BERLIN})
    window = {"from": "2026-10-24T22:00:00Z", "to": "2026-10-25T04:00:00Z"}
    preview = api_a.post("/api/v1/jobs/etl.hourly/backfill", window)
    assert preview.status_code == 200, preview.text
    # 22:30Z … 03:30Z: six instants, 02:30 local twice (fall back), so six runs.
    assert (
        preview.json()["count"] == 6
        and preview.json()["new"] == 6
        and preview.json()["created"] == 0
    )
    assert Run.objects.count() == 0
    done = api_a.post("/api/v1/jobs/etl.hourly/backfill", {**window, "confirm": True}).json()
    assert done["created"] == 6
    keys = sorted(Run.objects.values_list("idempotency_key", flat=True))
    assert (
        "etl.hourly@2026-10-25T02:30:00+02:00" in keys
        and "etl.hourly@2026-10-25T02:30:00+01:00" in keys
    )
    assert set(Run.objects.values_list("trigger", flat=True)) == {"backfill"}
    again = api_a.post("/api/v1/jobs/etl.hourly/backfill", {**window, "confirm": True}).json()
    assert again["created"] == 0 and again["existing"] == 6
    assert Run.objects.count() == 6
    assert AuditEvent.objects.filter(action="job.backfill").count() == 2


def test_spring_forward_range(api_a):
    api_a.post(
        "/api/v1/jobs",
        {
            "name": "etl.nightly",
            "queue": "etl",
            "schedule": {"cron": "30 2 * * *", "timeZone": "Europe/Berlin", "jitterSeconds": 0},
        },
    )
    done = api_a.post(
        "/api/v1/jobs/etl.nightly/backfill",
        {"from": "2026-03-28T00:00:00Z", "to": "2026-03-30T23:00:00Z", "confirm": True},
    ).json()
    assert done["created"] == 3
    assert done["sample"] == [
        "2026-03-28T02:30:00+01:00",
        "2026-03-29T03:00:00+02:00",
        "2026-03-30T02:30:00+02:00",
    ]


def test_backfill_refuses_bad_ranges_and_non_cron_jobs(api_a):
    api_a.post("/api/v1/jobs", {"name": "etl.manual", "queue": "etl"})
    answer = api_a.post(
        "/api/v1/jobs/etl.manual/backfill",
        {"from": "2026-01-01T00:00:00Z", "to": "2026-01-02T00:00:00Z"},
    )
    assert answer.status_code == 400 and "schedule" in answer.json()["errors"]
    api_a.post("/api/v1/jobs", {"name": "etl.cron", "queue": "etl", "schedule": HOURLY_BERLIN})
    bad = api_a.post(
        "/api/v1/jobs/etl.cron/backfill", {"from": "nope", "to": "2026-01-02T00:00:00Z", "extra": 1}
    )
    assert bad.status_code == 400 and {"from", "extra"} <= set(bad.json()["errors"])
    reversed_range = api_a.post(
        "/api/v1/jobs/etl.cron/backfill",
        {"from": "2026-01-02T00:00:00Z", "to": "2026-01-01T00:00:00Z"},
    )
    assert reversed_range.status_code == 400 and "to" in reversed_range.json()["errors"]
    # A backfill is for the past: a range ahead is refused, one into the future stops at now.
    ahead = api_a.post(
        "/api/v1/jobs/etl.cron/backfill",
        {"from": "2999-01-01T00:00:00Z", "to": "2999-01-02T00:00:00Z"},
    )
    assert ahead.status_code == 400 and "from" in ahead.json()["errors"], ahead.text
    for start in ("0001-01-01T00:00:00Z", "0001-01-01T00:00:00+01:00"):
        ends = api_a.post(
            "/api/v1/jobs/etl.cron/backfill", {"from": start, "to": "9999-12-31T23:59:00Z"}
        )
        assert ends.status_code == 400, ends.text
        assert ends.json()["errors"] == {
            "from": [
                "The range reaches the first or last instants a time can hold (in 0001-01-01 or 9999-12-31, in the zone of the schedule): fire times cannot be computed there."
            ]
        }
    now = db_now()
    across = api_a.post(
        "/api/v1/jobs/etl.cron/backfill",
        {"from": format_utc(now - timedelta(hours=3)), "to": format_utc(now + timedelta(days=30))},
    )
    assert across.status_code == 200, across.text
    assert across.json()["count"] in (2, 3)  # the hours of the last three that have passed
    # Where it stopped is said: the count is up to now, not up to the `to` asked for.
    until = parse_datetime(across.json()["until"])
    assert now <= until <= db_now()
    confirmed = {"from": format_utc(now - timedelta(hours=3)), "confirm": True,
                 "to": format_utc(now + timedelta(days=30))}  # fmt: skip
    api_a.post("/api/v1/jobs/etl.cron/backfill", confirmed)
    (event,) = AuditEvent.objects.filter(action="job.backfill")
    assert now <= datetime.fromisoformat(event.after["to"]) <= db_now()


def test_a_range_of_one_instant_is_that_fire_time(api_a):
    """Both ends are in the range: a range from a fire time to itself holds it (it was refused
    as empty)."""
    api_a.post("/api/v1/jobs", {"name": "etl.hourly", "queue": "etl", "schedule": HOURLY_BERLIN})
    at = {"from": "2026-10-24T22:30:00Z", "to": "2026-10-24T22:30:00Z", "confirm": True}
    done = api_a.post("/api/v1/jobs/etl.hourly/backfill", at)
    assert done.status_code == 200, done.text
    assert (done.json()["count"], done.json()["created"]) == (1, 1)
    assert done.json()["sample"] == ["2026-10-25T00:30:00+02:00"]


def test_a_fire_time_whose_key_a_run_holds_is_counted_as_existing(api_a):
    """A run holding a fire time's key (made before such keys were refused to producers) makes
    the insert skip that time: the preview counts it, so what it says is what is made."""
    from apps.jobs.models import JobDefinition
    from apps.runs import store

    api_a.post("/api/v1/jobs", {"name": "etl.hourly", "queue": "etl", "schedule": HOURLY_BERLIN})
    definition = JobDefinition.objects.get(name="etl.hourly")
    now = db_now()
    key = "etl.hourly@2026-10-25T01:30:00+02:00"
    store.insert_runs([store.NewRun(definition.pk, "api", now, now, key)])
    window = {"from": "2026-10-24T22:00:00Z", "to": "2026-10-25T01:00:00Z"}
    preview = api_a.post("/api/v1/jobs/etl.hourly/backfill", window).json()
    assert (preview["count"], preview["existing"], preview["new"]) == (3, 1, 2)
    done = api_a.post("/api/v1/jobs/etl.hourly/backfill", {**window, "confirm": True}).json()
    assert done["created"] == preview["new"]


def test_backfill_reads_times_with_offsets_and_names_every_bad_field(api_a):
    api_a.post("/api/v1/jobs", {"name": "etl.cron", "queue": "etl", "schedule": HOURLY_BERLIN})
    # A space stands for the "+" of an offset that a form or a query string turned into one.
    spaced = api_a.post(
        "/api/v1/jobs/etl.cron/backfill",
        {"from": "2026-01-01T00:00:00 01:00", "to": "2026-01-01T03:00:00+01:00"},
    )
    assert spaced.status_code == 200, spaced.text
    assert spaced.json()["sample"] == [
        "2026-01-01T00:30:00+01:00",
        "2026-01-01T01:30:00+01:00",
        "2026-01-01T02:30:00+01:00",
    ]
    bad = api_a.post(
        "/api/v1/jobs/etl.cron/backfill",
        {"from": "2026-01-01T00:00:00", "to": "2026-01-01T12:99:00Z", "confirm": "yes"},
    )
    assert bad.status_code == 400 and set(bad.json()["errors"]) == {"from", "to", "confirm"}
    assert bad.json()["errors"]["from"] == ["Give an ISO 8601 time with an offset or Z."]
    missing = api_a.post("/api/v1/jobs/etl.cron/backfill", {"confirm": True})
    assert missing.status_code == 400 and set(missing.json()["errors"]) == {"from", "to"}
    not_an_object = api_a.post("/api/v1/jobs/etl.cron/backfill", ["2026-01-01T00:00:00Z"])
    assert not_an_object.status_code == 400 and set(not_an_object.json()["errors"]) == {"body"}
    assert Run.objects.count() == 0


def test_a_range_past_the_cap_creates_only_the_cap(api_a, settings):
    settings.SCHEDULER_BACKFILL_CAP = 4
    api_a.post("/api/v1/jobs", {"name": "etl.cron", "queue": "etl", "schedule": HOURLY_BERLIN})
    done = api_a.post(
        "/api/v1/jobs/etl.cron/backfill",
        {"from": "2026-01-01T00:00:00Z", "to": "2026-01-02T00:00:00Z", "confirm": True},
    )
    assert done.status_code == 200, done.text
    assert (
        done.json()["count"] == 4 and done.json()["capped"] is True and done.json()["created"] == 4
    )
    assert Run.objects.count() == 4
    # It says where it stopped (it said the range's `to`): the next one starts after it.
    last = max(Run.objects.values_list("due_at", flat=True))
    assert done.json()["until"] == format_utc(last) == "2026-01-01T03:30:00Z"
    rest = api_a.post(
        "/api/v1/jobs/etl.cron/backfill",
        {"from": "2026-01-01T03:30:01Z", "to": "2026-01-02T00:00:00Z", "confirm": True},
    )
    assert rest.json()["created"] == 4 and rest.json()["until"] == "2026-01-01T07:30:00Z"


def test_the_same_backfill_sent_at_once_answers_what_each_made(api_a, live_server, token_a):
    """Four copies of one confirmed backfill at once: the runs are made once, and each answer
    counts as new what it made (the others' are existing). Counted before the insert, the
    losers answered "5 473 new" over none created."""
    import threading

    from tests.conftest import Api

    api_a.post(
        "/api/v1/jobs",
        {
            "name": "etl.five",
            "queue": "etl",
            "schedule": {"cron": "*/5 * * * *", "jitterSeconds": 0},
        },
    )
    body = {"from": "2026-06-01T00:00:00Z", "to": "2026-06-10T00:00:00Z", "confirm": True}
    start = threading.Barrier(4)
    answers: list[dict] = []

    def send() -> None:
        client = Api(live_server.url, token_a)
        start.wait()
        answers.append(client.post("/api/v1/jobs/etl.five/backfill", body).json())
        client.http.close()

    threads = [threading.Thread(target=send) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    count = answers[0]["count"]
    assert len(answers) == 4 and sum(a["created"] for a in answers) == count == Run.objects.count()
    for answer in answers:
        assert (answer["new"], answer["existing"]) == (
            answer["created"],
            count - answer["created"],
        ), answer
