"""Tests for apps/jobs/schedule.py: the JSON form and its validation, preview, jitter, shards, keys.

Pure functions: no database, no Django settings needed.
"""

from __future__ import annotations

import hashlib
import re
from collections import Counter
from datetime import UTC, datetime, timedelta

import pytest
import time_machine
from hypothesis import example, given, settings
from hypothesis import strategies as st

from apps.jobs.firetimes import next_fire_times
from apps.jobs.schedule import (
    CronSchedule,
    DelayedSchedule,
    NoSchedule,
    OneOffSchedule,
    ScheduleError,
    idempotency_key,
    jitter_offset,
    parse_schedule,
    preview,
    schedule_to_json,
    shard_for,
)
from apps.runs.clock import format_utc


def at(text: str) -> datetime:
    return datetime.fromisoformat(text)


# --- jitter and shards -------------------------------------------------------------------------

NAMES = [f"team-{i % 37}.job-{i}" for i in range(10_000)]


def _expected_jitter(name: str, jitter_seconds: int) -> int:
    digest = hashlib.sha256(name.encode("utf-8")).digest()
    return int.from_bytes(digest[8:16], byteorder="big") % jitter_seconds


def _expected_shard(name: str, shard_count: int) -> int:
    digest = hashlib.sha256(name.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], byteorder="big") % shard_count


def _chi_square(counts: list[int]) -> float:
    expected = sum(counts) / len(counts)
    return sum((c - expected) ** 2 / expected for c in counts)


@pytest.mark.parametrize(
    ("name", "jitter_seconds"),
    [
        ("billing.export-invoices", 60),
        ("billing.export-invoices", 3600),
        ("search.reindex", 60),
        ("ünïcode.jöb", 900),
        ("a", 1),
    ],
)
def test_jitter_is_stable_and_matches_the_documented_hash(name, jitter_seconds):
    offset = jitter_offset(name, jitter_seconds)

    assert offset == _expected_jitter(name, jitter_seconds)
    assert offset == jitter_offset(name, jitter_seconds)
    assert 0 <= offset < jitter_seconds


@pytest.mark.parametrize("jitter_seconds", [0, -5])
def test_zero_jitter_means_no_offset(jitter_seconds):
    assert {jitter_offset(name, jitter_seconds) for name in NAMES[:500]} == {0}


def test_jitter_spreads_names_uniformly():
    offsets = [jitter_offset(name, 60) for name in NAMES]
    counts = Counter(offsets)

    assert all(0 <= o < 60 for o in offsets)
    assert len(counts) == 60
    # 59 degrees of freedom: the 99.9th percentile of chi-square is about 98.3.
    assert _chi_square([counts[o] for o in range(60)]) < 98.3


def test_jitter_spreads_names_across_a_long_window():
    buckets = Counter(jitter_offset(name, 3600) // 360 for name in NAMES)

    # Each tenth of the hour should hold about 1 000 names; 4 standard deviations is 120.
    assert all(abs(buckets[b] - 1000) < 120 for b in range(10)), buckets


@pytest.mark.parametrize("name", ["billing.export-invoices", "search.reindex", "ünïcode.jöb"])
@pytest.mark.parametrize("shard_count", [1, 16, 7])
def test_shard_is_stable_and_matches_the_documented_hash(name, shard_count):
    shard = shard_for(name, shard_count)

    assert shard == _expected_shard(name, shard_count)
    assert 0 <= shard < shard_count


def test_shard_defaults_to_16_and_spreads_names_uniformly():
    shards = [shard_for(name) for name in NAMES]
    counts = Counter(shards)

    assert set(counts) == set(range(16))
    # 15 degrees of freedom: the 99.9th percentile of chi-square is about 37.7.
    assert _chi_square([counts[s] for s in range(16)]) < 37.7


def test_shard_count_must_be_positive():
    with pytest.raises(ValueError):
        shard_for("billing.export-invoices", 0)


# --- validation --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "path", "reason"),
    [
        pytest.param(None, "schedule", "must be an object", id="null"),
        pytest.param("0 2 * * *", "schedule", "must be an object", id="bare-string"),
        pytest.param([], "schedule", "must be an object", id="list"),
        pytest.param({"cron": "0 2 * * *", "tz": "UTC"}, "schedule", "unknown field 'tz'", id="unknown-key"),
        pytest.param({"cron": "0 2 * * *", "runAt": "2026-12-01T10:00:00Z"}, "schedule", "mixes", id="cron-and-runAt"),
        pytest.param({"runAt": "2026-12-01T10:00:00Z", "delaySeconds": 5}, "schedule", "mixes", id="runAt-and-delay"),
        pytest.param({"delaySeconds": 5, "timeZone": "UTC"}, "schedule", "mixes", id="delay-with-zone"),
        pytest.param({"timeZone": "UTC"}, "schedule.cron", "required", id="zone-without-cron"),
        pytest.param({"cron": ""}, "schedule.cron", "must be a cron expression", id="empty-cron"),
        pytest.param({"cron": 5}, "schedule.cron", "must be a cron expression", id="cron-not-string"),
        pytest.param({"cron": "61 * * * *"}, "schedule.cron", "minute field: 61 is out of range 0-59", id="minute-range"),
        pytest.param({"cron": "0 24 * * *"}, "schedule.cron", "hour field: 24 is out of range 0-23", id="hour-range"),
        pytest.param({"cron": "0 0 0 * *"}, "schedule.cron", "day-of-month field: 0 is out of range", id="dom-range"),
        pytest.param({"cron": "0 0 * 13 *"}, "schedule.cron", "month field: 13 is out of range", id="month-range"),
        pytest.param({"cron": "0 0 * * 8"}, "schedule.cron", "day-of-week field: 8 is out of range", id="dow-range"),
        pytest.param({"cron": "0 0 * FOO *"}, "schedule.cron", "'FOO' is not a number or a month name", id="bad-name"),
        pytest.param({"cron": "5-1 * * * *"}, "schedule.cron", "runs backwards", id="backwards-range"),
        pytest.param({"cron": "*/0 * * * *"}, "schedule.cron", "step '0'", id="zero-step"),
        pytest.param({"cron": "1,,2 * * * *"}, "schedule.cron", "empty item", id="empty-list-item"),
        pytest.param({"cron": "L 0 * * *"}, "schedule.cron", "minute field: 'L' is not allowed here", id="L-in-minute"),
        pytest.param({"cron": "0 0 ? * MON"}, "schedule.cron", "day-of-month field: '?' is not supported", id="quartz-question-mark"),
        pytest.param({"cron": "0 0 * * MON#6"}, "schedule.cron", "day-of-week field: 'MON#6'", id="hash-past-five"),
        pytest.param({"cron": "0 0 30W 2 *"}, "schedule.cron", "never fires: day 30 does not occur in February", id="never-fires-W"),
        pytest.param({"cron": "* * *"}, "schedule.cron", "has 3 fields; expected 5", id="too-few-fields"),
        pytest.param({"cron": "0 0 2 * * *"}, "schedule.cron", "seconds and year fields are not supported", id="six-fields"),
        pytest.param({"cron": "@reboot"}, "schedule.cron", "@reboot is not supported", id="reboot"),
        pytest.param({"cron": "@every 5m"}, "schedule.cron", "unknown macro", id="unknown-macro"),
        pytest.param({"cron": "0 0 30 2 *"}, "schedule.cron", "never fires: day 30 does not occur in February", id="never-fires"),
        pytest.param({"cron": "0 0 31 4,6 *"}, "schedule.cron", "never fires: day 31 does not occur in April or June", id="never-fires-31"),
        pytest.param({"cron": "0 2 * * *", "timeZone": "Mars/Base"}, "schedule.timeZone", "unknown time zone 'Mars/Base'", id="unknown-zone"),
        pytest.param({"cron": "0 2 * * *", "timeZone": "localtime"}, "schedule.timeZone", "unknown time zone", id="host-localtime"),
        pytest.param({"cron": "0 2 * * *", "timeZone": "../etc/passwd"}, "schedule.timeZone", "unknown time zone", id="path-zone"),
        pytest.param({"cron": "0 2 * * *", "timeZone": 1}, "schedule.timeZone", "IANA", id="zone-not-string"),
        pytest.param({"cron": "0 2 * * *", "jitterSeconds": "60"}, "schedule.jitterSeconds", "whole number", id="jitter-string"),
        pytest.param({"cron": "0 2 * * *", "jitterSeconds": 1.5}, "schedule.jitterSeconds", "whole number", id="jitter-float"),
        pytest.param({"cron": "0 2 * * *", "jitterSeconds": True}, "schedule.jitterSeconds", "whole number", id="jitter-bool"),
        pytest.param({"cron": "0 2 * * *", "jitterSeconds": -1}, "schedule.jitterSeconds", "negative", id="jitter-negative"),
        pytest.param({"cron": "*/15 * * * *", "jitterSeconds": 901}, "schedule.jitterSeconds", "(900 seconds)", id="jitter-over-period"),
        pytest.param({"cron": "0 1,23 * * *", "jitterSeconds": 7201}, "schedule.jitterSeconds", "(7200 seconds)", id="jitter-over-overnight-gap"),
        pytest.param({"cron": "0 2 * * *", "missedRunPolicy": "sometimes"}, "schedule.missedRunPolicy", "run_once, run_all, skip", id="bad-policy"),
        pytest.param({"cron": "0 2 * * *", "missedRunPolicy": None}, "schedule.missedRunPolicy", "must be one of", id="null-policy"),
        pytest.param({"runAt": "2026-12-01T10:00:00"}, "schedule.runAt", "no UTC offset", id="naive-runAt"),
        pytest.param({"runAt": "2026-12-01"}, "schedule.runAt", "no UTC offset", id="date-only-runAt"),
        pytest.param({"runAt": "next tuesday"}, "schedule.runAt", "ISO-8601", id="prose-runAt"),
        pytest.param({"runAt": 1764583200}, "schedule.runAt", "ISO-8601", id="epoch-runAt"),
        pytest.param({"delaySeconds": -1}, "schedule.delaySeconds", "negative", id="delay-negative"),
        pytest.param({"delaySeconds": "300"}, "schedule.delaySeconds", "whole number", id="delay-string"),
        pytest.param({"delaySeconds": 1.5}, "schedule.delaySeconds", "whole number", id="delay-float"),
        pytest.param({"delaySeconds": False}, "schedule.delaySeconds", "whole number", id="delay-bool"),
        pytest.param({"delaySeconds": 10**12}, "schedule.delaySeconds", "at most", id="delay-huge"),
        pytest.param({"cron": "0 2 * * *", "startAt": "2026-06-01T00:00:00"}, "schedule.startAt", "no UTC offset", id="naive-startAt"),
        pytest.param({"cron": "0 2 * * *", "endAt": "2026-06-01"}, "schedule.endAt", "no UTC offset", id="date-only-endAt"),
        pytest.param({"cron": "0 2 * * *", "endAt": "soon"}, "schedule.endAt", "ISO-8601", id="prose-endAt"),
        pytest.param({"cron": "0 2 * * *", "startAt": 1780272000}, "schedule.startAt", "ISO-8601", id="epoch-startAt"),
        pytest.param({"cron": "0 2 * * *", "startAt": "2026-06-01T00:00:00Z", "endAt": "2026-06-01T00:00:00Z"}, "schedule.endAt", "must be after startAt (2026-06-01T00:00:00Z)", id="end-equals-start"),
        pytest.param({"cron": "0 2 * * *", "startAt": "2026-06-01T02:00:00+02:00", "endAt": "2026-05-31T23:00:00Z"}, "schedule.endAt", "must be after startAt (2026-06-01T00:00:00Z)", id="end-before-start"),
        pytest.param({"startAt": "2026-06-01T00:00:00Z"}, "schedule.cron", "is required with", id="bounds-without-cron"),
        pytest.param({"cron": "0 2 * * *", "startAt": "9999-12-31T00:00:00Z"}, "schedule.startAt", "is later than 9999-01-01T00:00:00Z", id="startAt-past-9999"),
        pytest.param({"runAt": "2026-06-01T00:00:00Z", "endAt": "2026-07-01T00:00:00Z"}, "schedule.endAt", "bounds only a cron schedule", id="bounds-with-runAt"),
        pytest.param({"delaySeconds": 5, "startAt": "2026-06-01T00:00:00Z"}, "schedule.startAt", "bounds only a cron schedule", id="bounds-with-delay"),
        pytest.param({"cron": "0 2 * * *", "overlapPolicy": "queue"}, "schedule.overlapPolicy", "allow_all, skip, buffer_one, cancel_other", id="bad-overlap"),
        pytest.param({"cron": "0 2 * * *", "overlapPolicy": "SKIP"}, "schedule.overlapPolicy", "must be one of", id="overlap-case"),
        pytest.param({"cron": "0 2 * * *", "overlapPolicy": None}, "schedule.overlapPolicy", "must be one of", id="null-overlap"),
        pytest.param({"cron": "0 2 * * *", "overlapPolicy": ["skip"]}, "schedule.overlapPolicy", "must be one of", id="overlap-list"),
        pytest.param({"overlapPolicy": "skip"}, "schedule.cron", "is required with", id="overlap-without-cron"),
        pytest.param({"runAt": "2026-06-01T00:00:00Z", "overlapPolicy": "skip"}, "schedule.overlapPolicy", "only to a cron schedule", id="overlap-with-runAt"),
        pytest.param({"delaySeconds": 5, "overlapPolicy": "allow_all"}, "schedule.overlapPolicy", "only to a cron schedule", id="overlap-with-delay"),
    ],
)  # fmt: skip
def test_bad_schedule_names_the_field_and_why(raw, path, reason):
    with pytest.raises(ScheduleError) as caught:
        parse_schedule(raw)

    assert list(caught.value.errors) == [path]
    assert reason in caught.value.errors[path]
    assert isinstance(caught.value, ValueError)


def test_every_bad_cron_field_is_reported_at_once():
    with pytest.raises(ScheduleError) as caught:
        parse_schedule(
            {
                "cron": "61 25 * * *",
                "timeZone": "Mars/Base",
                "jitterSeconds": -1,
                "missedRunPolicy": "maybe",
            }
        )

    errors = caught.value.errors
    assert set(errors) == {
        "schedule.cron",
        "schedule.timeZone",
        "schedule.jitterSeconds",
        "schedule.missedRunPolicy",
    }
    assert "minute field" in errors["schedule.cron"] and "hour field" in errors["schedule.cron"]
    assert errors["schedule.timeZone"] == "unknown time zone 'Mars/Base'"


@pytest.mark.parametrize(
    ("raw", "expected", "canonical"),
    [
        pytest.param(
            {"cron": "0 2 * * *"},
            CronSchedule("0 2 * * *", "UTC", 60, "run_once"),
            {"cron": "0 2 * * *", "timeZone": "UTC", "jitterSeconds": 60, "missedRunPolicy": "run_once", "overlapPolicy": "allow_all"},
            id="cron-defaults",
        ),
        pytest.param(
            {"cron": "  30  2 * *   * ", "timeZone": "Europe/Berlin", "jitterSeconds": 0, "missedRunPolicy": "skip"},
            CronSchedule("30 2 * * *", "Europe/Berlin", 0, "skip"),
            {"cron": "30 2 * * *", "timeZone": "Europe/Berlin", "jitterSeconds": 0, "missedRunPolicy": "skip", "overlapPolicy": "allow_all"},
            id="cron-whitespace-normalised",
        ),
        pytest.param(
            {"cron": "*/15 * * * *", "jitterSeconds": 900, "missedRunPolicy": "run_all"},
            CronSchedule("*/15 * * * *", "UTC", 900, "run_all"),
            {"cron": "*/15 * * * *", "timeZone": "UTC", "jitterSeconds": 900, "missedRunPolicy": "run_all", "overlapPolicy": "allow_all"},
            id="jitter-equal-to-period",
        ),
        pytest.param(
            {"cron": "@weekly", "timeZone": "Asia/Kolkata", "jitterSeconds": 3600},
            CronSchedule("@weekly", "Asia/Kolkata", 3600, "run_once"),
            {"cron": "@weekly", "timeZone": "Asia/Kolkata", "jitterSeconds": 3600, "missedRunPolicy": "run_once", "overlapPolicy": "allow_all"},
            id="macro",
        ),
        pytest.param(
            {"runAt": "2026-12-01T11:00:00+01:00"},
            OneOffSchedule(datetime(2026, 12, 1, 10, tzinfo=UTC)),
            {"runAt": "2026-12-01T10:00:00Z"},
            id="one-off-normalised-to-utc",
        ),
        pytest.param(
            {"runAt": "2026-12-01T10:00:00Z"},
            OneOffSchedule(datetime(2026, 12, 1, 10, tzinfo=UTC)),
            {"runAt": "2026-12-01T10:00:00Z"},
            id="one-off-z",
        ),
        pytest.param(
            {"cron": "0 0 LW * *", "startAt": "2026-06-01T02:00:00+02:00", "endAt": "2026-12-31T23:59:59.9999Z"},
            CronSchedule("0 0 LW * *", "UTC", 60, "run_once", datetime(2026, 6, 1, tzinfo=UTC), datetime(2026, 12, 31, 23, 59, 59, 999000, tzinfo=UTC)),
            {"cron": "0 0 LW * *", "timeZone": "UTC", "jitterSeconds": 60, "missedRunPolicy": "run_once", "overlapPolicy": "allow_all", "startAt": "2026-06-01T00:00:00Z", "endAt": "2026-12-31T23:59:59.999Z"},
            id="bounds-normalised-to-utc-milliseconds",
        ),
        pytest.param(
            {"cron": "0 0 * * 5#3", "startAt": None, "endAt": "2027-01-01T00:00:00Z"},
            CronSchedule("0 0 * * 5#3", end_at=datetime(2027, 1, 1, tzinfo=UTC)),
            {"cron": "0 0 * * 5#3", "timeZone": "UTC", "jitterSeconds": 60, "missedRunPolicy": "run_once", "overlapPolicy": "allow_all", "endAt": "2027-01-01T00:00:00Z"},
            id="null-bound-is-no-bound",
        ),
        pytest.param(
            {"cron": "*/5 * * * *", "jitterSeconds": 0, "overlapPolicy": "buffer_one"},
            CronSchedule("*/5 * * * *", "UTC", 0, "run_once", overlap_policy="buffer_one"),
            {"cron": "*/5 * * * *", "timeZone": "UTC", "jitterSeconds": 0, "missedRunPolicy": "run_once", "overlapPolicy": "buffer_one"},
            id="overlap-policy",
        ),
        pytest.param({"delaySeconds": 300}, DelayedSchedule(300), {"delaySeconds": 300}, id="delayed"),
        pytest.param({"delaySeconds": 0}, DelayedSchedule(0), {"delaySeconds": 0}, id="delayed-now"),
        pytest.param({}, NoSchedule(), {}, id="none"),
    ],
)  # fmt: skip
def test_good_schedule_normalises_with_defaults_and_round_trips(raw, expected, canonical):
    schedule = parse_schedule(raw)

    assert schedule == expected
    assert schedule_to_json(schedule) == canonical
    assert parse_schedule(schedule_to_json(schedule)) == schedule


@pytest.mark.parametrize("given", ["10:00:00.250", "10:00:00.250999"])
def test_one_off_keeps_utc_and_millisecond_precision_through_json(given):
    schedule = parse_schedule({"runAt": f"2026-12-01T{given}+02:00"})

    assert schedule.run_at.tzinfo is UTC
    assert schedule.run_at.microsecond == 250_000
    assert schedule_to_json(schedule) == {"runAt": "2026-12-01T08:00:00.250Z"}
    assert parse_schedule(schedule_to_json(schedule)) == schedule


@pytest.mark.parametrize("today", ["2026-03-29T01:30:00Z", "2031-10-26T01:30:00Z"])
def test_validation_does_not_depend_on_today(today):
    with time_machine.travel(at(today), tick=False):
        accepted = parse_schedule({"cron": "0 1,23 * * *", "jitterSeconds": 7200})
        with pytest.raises(ScheduleError) as caught:
            parse_schedule({"cron": "0 1,23 * * *", "jitterSeconds": 7201})

    assert accepted.jitter_seconds == 7200
    assert "(7200 seconds)" in caught.value.errors["schedule.jitterSeconds"]


# --- hostile input: random text and JSON values --------------------------------------------------


CRON_PIECES = st.sampled_from(
    ["*", "/", "-", ",", " ", "0", "1", "5", "7", "12", "59", "60", "9" * 30, "SUN", "mon",
     "JAN", "L", "W", "#", "?", "@daily", "@", "TZ=", "=", "\t", "\n", "\u00a0", "ſ", "٣"]
)  # fmt: skip
CRON_TEXT = st.one_of(
    st.lists(CRON_PIECES, max_size=40).map("".join),
    st.text(max_size=300),
    st.text(alphabet="0123456789*/-, ", min_size=150, max_size=400),
)
SCHEDULE_VALUES = st.one_of(
    st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=40), CRON_TEXT
)


@given(
    cron=CRON_TEXT,
    extra=st.dictionaries(
        st.sampled_from(
            ["timeZone", "jitterSeconds", "missedRunPolicy", "startAt", "endAt", "overlapPolicy"]
        ),
        st.one_of(SCHEDULE_VALUES, st.datetimes(timezones=st.timezones()).map(str)),
    ),
)
@example(cron="1" * 5000 + " * * * *", extra={})
@example(cron="TZ=Europe/Berlin 0 0 * * *", extra={"timeZone": "Europe/Berlin"})
@settings(max_examples=400, deadline=None)
def test_parse_schedule_on_random_text_returns_or_raises_schedule_error(cron, extra):
    try:
        schedule = parse_schedule({"cron": cron, **extra})
    except ScheduleError as exc:
        assert exc.errors and all(isinstance(reason, str) for reason in exc.errors.values())
    else:
        assert isinstance(schedule, CronSchedule)
        assert parse_schedule(schedule_to_json(schedule)) == schedule
        next_fire_times(schedule, at("2026-01-04T00:00:00Z"), 2)


@given(raw=st.one_of(SCHEDULE_VALUES, st.dictionaries(
    st.sampled_from(["cron", "runAt", "delaySeconds", "timeZone", "jitterSeconds", "overlapPolicy", "x"]),
    SCHEDULE_VALUES,
)))  # fmt: skip
@settings(max_examples=300, deadline=None)
def test_parse_schedule_on_any_json_value_returns_or_raises_schedule_error(raw):
    try:
        parse_schedule(raw)
    except ScheduleError as exc:
        assert exc.errors


# --- idempotency keys and formatting -------------------------------------------------------------


def test_idempotency_key_is_name_at_local_time_with_offset():
    (fire,) = next_fire_times(
        CronSchedule("0 2 * * *", "Europe/Berlin"), at("2026-03-14T12:00:00Z"), 1
    )

    assert idempotency_key("billing.export-invoices", fire.local) == (
        "billing.export-invoices@2026-03-15T02:00:00+01:00"
    )


def test_idempotency_keys_differ_between_the_two_passes_of_a_repeated_hour():
    times = next_fire_times(
        CronSchedule("0 * * * *", "Europe/Berlin"), at("2026-10-24T23:30:00Z"), 2
    )

    assert [idempotency_key("ops.ping", t.local) for t in times] == [
        "ops.ping@2026-10-25T02:00:00+02:00",
        "ops.ping@2026-10-25T02:00:00+01:00",
    ]


# --- preview -----------------------------------------------------------------------------------

LOCAL_ISO = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d[+-]\d\d:\d\d$")
UTC_ISO = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ$")


def test_preview_of_the_design_example():
    name = "billing.export-invoices"
    schedule = parse_schedule({"cron": "30 2 * * *", "timeZone": "Europe/Berlin"})
    jitter = _expected_jitter(name, 60)

    items = preview(name, schedule, at("2026-03-27T12:00:00Z"), 3)

    assert items[1] == {
        "local": "2026-03-29T03:00:00+02:00",
        "utc": "2026-03-29T01:00:00Z",
        "start": format_utc(at("2026-03-29T01:00:00Z") + timedelta(seconds=jitter)),
        "note": "02:30 does not exist on this day (DST); runs at the next valid time",
        "dst": True,
    }
    assert [item["local"] for item in items] == [
        "2026-03-28T02:30:00+01:00",
        "2026-03-29T03:00:00+02:00",
        "2026-03-30T02:30:00+02:00",
    ]
    assert [item["note"] for item in items] == ["", items[1]["note"], ""]
    for item in items:
        assert set(item) == {"local", "utc", "start", "note", "dst"}
        assert LOCAL_ISO.match(item["local"]) and UTC_ISO.match(item["utc"])
        assert UTC_ISO.match(item["start"])


def test_preview_without_jitter_starts_on_time():
    schedule = parse_schedule(
        {"cron": "0 2 * * *", "timeZone": "Europe/Berlin", "jitterSeconds": 0}
    )

    items = preview("billing.export-invoices", schedule, at("2026-03-14T12:00:00Z"), 2)

    assert items == [
        {"local": "2026-03-15T02:00:00+01:00", "utc": "2026-03-15T01:00:00Z", "start": "2026-03-15T01:00:00Z", "note": "", "dst": False},
        {"local": "2026-03-16T02:00:00+01:00", "utc": "2026-03-16T01:00:00Z", "start": "2026-03-16T01:00:00Z", "note": "", "dst": False},
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("schedule", "after", "created_at", "expected"),
    [
        pytest.param(
            OneOffSchedule(datetime(2026, 12, 1, 10, tzinfo=UTC)),
            "2026-11-30T00:00:00Z",
            None,
            [{"local": "2026-12-01T10:00:00+00:00", "utc": "2026-12-01T10:00:00Z", "start": "2026-12-01T10:00:00Z", "note": "", "dst": False}],
            id="one-off-ahead",
        ),
        pytest.param(
            OneOffSchedule(datetime(2026, 12, 1, 10, tzinfo=UTC)),
            "2026-12-01T10:00:00Z",
            None,
            [],
            id="one-off-at-from-is-excluded",
        ),
        pytest.param(
            DelayedSchedule(300),
            "2026-05-01T10:00:00Z",
            "2026-05-01T11:58:00+02:00",
            [{"local": "2026-05-01T10:03:00+00:00", "utc": "2026-05-01T10:03:00Z", "start": "2026-05-01T10:03:00Z", "note": "", "dst": False}],
            id="delayed-from-creation",
        ),
        pytest.param(
            DelayedSchedule(300),
            "2026-05-01T12:00:00Z",
            None,
            [{"local": "2026-05-01T12:05:00+00:00", "utc": "2026-05-01T12:05:00Z", "start": "2026-05-01T12:05:00Z", "note": "", "dst": False}],
            id="delayed-from-now",
        ),
        pytest.param(NoSchedule(), "2026-05-01T12:00:00Z", None, [], id="none"),
    ],
)  # fmt: skip
def test_preview_of_one_off_delayed_and_none(schedule, after, created_at, expected):
    items = preview(
        "orders.refund",
        schedule,
        at(after),
        10,
        created_at=at(created_at) if created_at else None,
    )

    assert items == expected


def test_preview_returns_exactly_count_items():
    items = preview("ops.ping", CronSchedule("*/5 * * * *"), at("2026-05-01T12:00:00Z"), 1000)

    assert len(items) == 1000
    assert items[-1]["utc"] == "2026-05-04T23:20:00Z"


# --- preview of a bounded schedule ---------------------------------------------------------------


def test_preview_of_a_bounded_schedule_shows_only_its_times_and_says_when_it_starts_and_ends():
    schedule = parse_schedule(
        {
            "cron": "0 0 L * *",
            "jitterSeconds": 0,
            "startAt": "2028-01-15T00:00:00Z",
            "endAt": "2028-03-31T00:00:00Z",
        }
    )

    items = preview("billing.close-month", schedule, at("2027-06-01T00:00:00Z"), 10)

    assert [(item["utc"], item["note"]) for item in items] == [
        (
            "2028-01-31T00:00:00Z",
            "first run: the schedule starts at 2028-01-15T00:00:00Z (startAt)",
        ),
        ("2028-02-29T00:00:00Z", ""),
        ("2028-03-31T00:00:00Z", "last run: the schedule ends at 2028-03-31T00:00:00Z (endAt)"),
    ]
    assert not any(item["dst"] for item in items)


def test_preview_says_nothing_of_a_start_already_passed_nor_of_an_end_beyond_the_count():
    schedule = parse_schedule(
        {"cron": "0 * * * *", "startAt": "2026-05-01T00:00:00Z", "endAt": "2026-05-02T00:00:00Z"}
    )

    items = preview("ops.ping", schedule, at("2026-05-01T10:00:00Z"), 3)

    assert [item["utc"] for item in items] == [
        "2026-05-01T11:00:00Z",
        "2026-05-01T12:00:00Z",
        "2026-05-01T13:00:00Z",
    ]
    assert [item["note"] for item in items] == ["", "", ""]


def test_preview_ends_on_the_last_time_when_the_count_reaches_exactly_it():
    schedule = parse_schedule({"cron": "0 * * * *", "endAt": "2026-05-01T13:00:00Z"})

    items = preview("ops.ping", schedule, at("2026-05-01T10:00:00Z"), 3)

    assert items[-1]["utc"] == "2026-05-01T13:00:00Z"
    assert items[-1]["note"] == "last run: the schedule ends at 2026-05-01T13:00:00Z (endAt)"


def test_preview_of_an_ended_schedule_is_empty():
    schedule = parse_schedule({"cron": "0 * * * *", "endAt": "2026-05-01T13:00:00Z"})

    assert preview("ops.ping", schedule, at("2026-05-01T13:00:00Z"), 10) == []


def test_preview_keeps_a_dst_note_beside_a_bound_note():
    schedule = parse_schedule(
        {
            "cron": "30 2 * * *",
            "timeZone": "Europe/Berlin",
            "jitterSeconds": 0,
            "startAt": "2026-03-29T00:00:00Z",
        }
    )

    (item,) = preview("billing.export-invoices", schedule, at("2026-03-20T00:00:00Z"), 1)

    assert item["local"] == "2026-03-29T03:00:00+02:00" and item["dst"] is True
    assert item["note"] == (
        "02:30 does not exist on this day (DST); runs at the next valid time; "
        "first run: the schedule starts at 2026-03-29T00:00:00Z (startAt)"
    )


@pytest.mark.parametrize(
    ("cron", "expected"),
    [
        ("0 0 LW * *", ["2026-01-30T00:00:00+00:00", "2026-02-27T00:00:00+00:00"]),
        ("0 0 * * FRI#3", ["2026-01-16T00:00:00+00:00", "2026-02-20T00:00:00+00:00"]),
    ],
)
def test_preview_shows_the_day_rules(cron, expected):
    items = preview("x.y", parse_schedule({"cron": cron}), at("2026-01-01T00:00:00Z"), 2)

    assert [item["local"] for item in items] == expected


@pytest.mark.parametrize(
    ("cron", "named"),
    [
        ("0\t0 * * *", "U+0009"),
        ("0\u00a00 * * *", "U+00A0 (no-break space)"),
        ("0\u20030 * * *", "U+2003 (em space)"),
        ("0 0 * * *\n", "U+000A"),
        ("0\r0 * * *", "U+000D"),
    ],
)
def test_white_space_other_than_spaces_is_refused_not_rewritten(cron, named):
    """Strings are taken as sent: such a character was read as a space and stored as one."""
    with pytest.raises(ScheduleError) as caught:
        parse_schedule({"cron": cron})
    assert caught.value.errors == {"schedule.cron": f"separate the fields with spaces, not {named}"}


@pytest.mark.parametrize("zone", ["right/UTC", "posix/Europe/Berlin", "Factory", "localtime"])
def test_only_iana_zone_names_are_taken(zone):
    """Files of the host's zoneinfo tree that are not IANA names (another host may lack them)."""
    with pytest.raises(ScheduleError) as caught:
        parse_schedule({"cron": "0 0 * * *", "timeZone": zone})
    assert caught.value.errors == {"schedule.timeZone": f"unknown time zone '{zone}'"}
    assert parse_schedule({"cron": "0 0 * * *", "timeZone": "Etc/GMT-3"}).time_zone == "Etc/GMT-3"


def test_bounds_that_hold_no_fire_time_are_refused_as_a_schedule_that_never_runs():
    never = {
        "cron": "0 0 1 1 *",
        "startAt": "2027-01-02T00:00:00Z",
        "endAt": "2027-01-03T00:00:00Z",
    }
    with pytest.raises(ScheduleError) as caught:
        parse_schedule(never)
    assert list(caught.value.errors) == ["schedule.endAt"]
    assert "would never run" in caught.value.errors["schedule.endAt"]
    # Both bounds are inclusive: a fire time on either one is enough.
    new_year = "2028-01-01T00:00:00Z"
    for start, end in ((new_year, "2028-01-02T00:00:00Z"), ("2027-12-31T00:00:00Z", new_year)):
        assert parse_schedule({**never, "startAt": start, "endAt": end}).cron == "0 0 1 1 *"
    # In the definition's zone: midnight in Berlin is 23:00 the day before in UTC.
    berlin = {**never, "timeZone": "Europe/Berlin", "startAt": "2027-12-31T23:00:00Z"}
    assert parse_schedule({**berlin, "endAt": "2027-12-31T23:30:00Z"}).time_zone == "Europe/Berlin"
