"""Tests for apps/jobs/schedule.py: cron fire times under DST, jitter, shards, validation, preview.

Pure functions: no database, no Django settings needed.
"""

from __future__ import annotations

import hashlib
import re
from collections import Counter
from datetime import UTC, datetime, timedelta
from functools import lru_cache
from zoneinfo import ZoneInfo

import pytest
import time_machine
from cronsim import CronSim
from hypothesis import example, given, settings
from hypothesis import strategies as st

from apps.jobs.schedule import (
    CronSchedule,
    DelayedSchedule,
    FireTime,
    NoSchedule,
    OneOffSchedule,
    ScheduleError,
    fire_times_between,
    format_utc,
    idempotency_key,
    jitter_offset,
    next_fire_times,
    parse_schedule,
    preview,
    schedule_to_json,
    shard_for,
)

MOVED = "{} does not exist on this day (DST); runs at the next valid time"
FIRST_ONLY = "{} occurs twice on this day (DST); runs once, at the first occurrence"
SECOND_PASS = "{} occurs twice on this day (DST); this is the second pass"


def at(text: str) -> datetime:
    return datetime.fromisoformat(text)


def rendered(times: list[FireTime]) -> list[tuple[str, str, str]]:
    return [(t.local.isoformat(), format_utc(t.utc), t.note) for t in times]


# --- DST rules: each row is (local with offset, UTC, note) ---------------------------------------

DST_CASES = [
    pytest.param(
        "30 2 * * *",
        "Europe/Berlin",
        "2026-03-27T12:00:00Z",
        [
            ("2026-03-28T02:30:00+01:00", "2026-03-28T01:30:00Z", ""),
            ("2026-03-29T03:00:00+02:00", "2026-03-29T01:00:00Z", MOVED.format("02:30")),
            ("2026-03-30T02:30:00+02:00", "2026-03-30T00:30:00Z", ""),
        ],
        id="berlin-named-hour-missing-on-spring-forward-runs-at-next-valid-time",
    ),
    pytest.param(
        "30 2 * * *",
        "Europe/Berlin",
        "2026-10-23T12:00:00Z",
        [
            ("2026-10-24T02:30:00+02:00", "2026-10-24T00:30:00Z", ""),
            ("2026-10-25T02:30:00+02:00", "2026-10-25T00:30:00Z", FIRST_ONLY.format("02:30")),
            ("2026-10-26T02:30:00+01:00", "2026-10-26T01:30:00Z", ""),
        ],
        id="berlin-named-hour-repeated-on-fall-back-runs-once-at-first-occurrence",
    ),
    pytest.param(
        "0 * * * *",
        "Europe/Berlin",
        "2026-03-28T23:30:00Z",
        [
            ("2026-03-29T01:00:00+01:00", "2026-03-29T00:00:00Z", ""),
            (
                "2026-03-29T03:00:00+02:00",
                "2026-03-29T01:00:00Z",
                "02:00 does not exist on this day (DST); that run is skipped",
            ),
            ("2026-03-29T04:00:00+02:00", "2026-03-29T02:00:00Z", ""),
        ],
        id="berlin-hourly-skips-the-missing-slot-and-notes-it-on-the-next-run",
    ),
    pytest.param(
        "0 * * * *",
        "Europe/Berlin",
        "2026-10-24T22:30:00Z",
        [
            ("2026-10-25T01:00:00+02:00", "2026-10-24T23:00:00Z", ""),
            ("2026-10-25T02:00:00+02:00", "2026-10-25T00:00:00Z", ""),
            ("2026-10-25T02:00:00+01:00", "2026-10-25T01:00:00Z", SECOND_PASS.format("02:00")),
            ("2026-10-25T03:00:00+01:00", "2026-10-25T02:00:00Z", ""),
        ],
        id="berlin-hourly-fires-in-both-passes-of-the-repeated-hour",
    ),
    pytest.param(
        "*/15 * * * *",
        "Europe/Berlin",
        "2026-10-24T23:45:00Z",
        [
            ("2026-10-25T02:00:00+02:00", "2026-10-25T00:00:00Z", ""),
            ("2026-10-25T02:15:00+02:00", "2026-10-25T00:15:00Z", ""),
            ("2026-10-25T02:30:00+02:00", "2026-10-25T00:30:00Z", ""),
            ("2026-10-25T02:45:00+02:00", "2026-10-25T00:45:00Z", ""),
            ("2026-10-25T02:00:00+01:00", "2026-10-25T01:00:00Z", SECOND_PASS.format("02:00")),
            ("2026-10-25T02:15:00+01:00", "2026-10-25T01:15:00Z", SECOND_PASS.format("02:15")),
            ("2026-10-25T02:30:00+01:00", "2026-10-25T01:30:00Z", SECOND_PASS.format("02:30")),
            ("2026-10-25T02:45:00+01:00", "2026-10-25T01:45:00Z", SECOND_PASS.format("02:45")),
            ("2026-10-25T03:00:00+01:00", "2026-10-25T02:00:00Z", ""),
        ],
        id="berlin-every-15-minutes-fires-each-quarter-twice-in-the-repeated-hour",
    ),
    pytest.param(
        "*/15 * * * *",
        "Europe/Berlin",
        "2026-03-29T00:30:00Z",
        [
            ("2026-03-29T01:45:00+01:00", "2026-03-29T00:45:00Z", ""),
            (
                "2026-03-29T03:00:00+02:00",
                "2026-03-29T01:00:00Z",
                "02:00, 02:15, 02:30 and 02:45 do not exist on this day (DST); "
                "those runs are skipped",
            ),
            ("2026-03-29T03:15:00+02:00", "2026-03-29T01:15:00Z", ""),
        ],
        id="berlin-every-15-minutes-skips-the-missing-hour",
    ),
    pytest.param(
        "0 2 * * *",
        "America/New_York",
        "2026-03-06T12:00:00Z",
        [
            ("2026-03-07T02:00:00-05:00", "2026-03-07T07:00:00Z", ""),
            ("2026-03-08T03:00:00-04:00", "2026-03-08T07:00:00Z", MOVED.format("02:00")),
            ("2026-03-09T02:00:00-04:00", "2026-03-09T06:00:00Z", ""),
        ],
        id="new-york-named-hour-missing-on-spring-forward-runs-at-0300",
    ),
    pytest.param(
        "0 2 * * *",
        "America/New_York",
        "2026-10-30T12:00:00Z",
        [
            ("2026-10-31T02:00:00-04:00", "2026-10-31T06:00:00Z", ""),
            # New York repeats 01:00-01:59; 02:00 happens once, so nothing to note.
            ("2026-11-01T02:00:00-05:00", "2026-11-01T07:00:00Z", ""),
            ("2026-11-02T02:00:00-05:00", "2026-11-02T07:00:00Z", ""),
        ],
        id="new-york-0200-is-not-repeated-on-fall-back",
    ),
    pytest.param(
        "30 1 * * *",
        "America/New_York",
        "2026-10-30T12:00:00Z",
        [
            ("2026-10-31T01:30:00-04:00", "2026-10-31T05:30:00Z", ""),
            ("2026-11-01T01:30:00-04:00", "2026-11-01T05:30:00Z", FIRST_ONLY.format("01:30")),
            ("2026-11-02T01:30:00-05:00", "2026-11-02T06:30:00Z", ""),
        ],
        id="new-york-named-hour-repeated-on-fall-back-runs-once",
    ),
    pytest.param(
        "15 2 * * *",
        "Australia/Lord_Howe",
        "2026-10-02T00:00:00Z",
        [
            ("2026-10-03T02:15:00+10:30", "2026-10-02T15:45:00Z", ""),
            ("2026-10-04T02:30:00+11:00", "2026-10-03T15:30:00Z", MOVED.format("02:15")),
            ("2026-10-05T02:15:00+11:00", "2026-10-04T15:15:00Z", ""),
        ],
        id="lord-howe-half-hour-gap-runs-at-0230",
    ),
    pytest.param(
        "45 1 * * *",
        "Australia/Lord_Howe",
        "2026-04-03T00:00:00Z",
        [
            ("2026-04-04T01:45:00+11:00", "2026-04-03T14:45:00Z", ""),
            ("2026-04-05T01:45:00+11:00", "2026-04-04T14:45:00Z", FIRST_ONLY.format("01:45")),
            ("2026-04-06T01:45:00+10:30", "2026-04-05T15:15:00Z", ""),
        ],
        id="lord-howe-half-hour-repeat-runs-once",
    ),
    pytest.param(
        "30 2 * * *",
        "Asia/Kolkata",
        "2026-03-27T12:00:00Z",
        [
            ("2026-03-28T02:30:00+05:30", "2026-03-27T21:00:00Z", ""),
            ("2026-03-29T02:30:00+05:30", "2026-03-28T21:00:00Z", ""),
            ("2026-03-30T02:30:00+05:30", "2026-03-29T21:00:00Z", ""),
        ],
        id="kolkata-has-no-dst-and-no-notes",
    ),
    pytest.param(
        "0 1,13 * * *",
        "Europe/Berlin",
        "2026-03-28T06:00:00Z",
        [
            ("2026-03-28T13:00:00+01:00", "2026-03-28T12:00:00Z", ""),
            ("2026-03-29T01:00:00+01:00", "2026-03-29T00:00:00Z", ""),
            ("2026-03-29T13:00:00+02:00", "2026-03-29T11:00:00Z", ""),
            ("2026-03-30T01:00:00+02:00", "2026-03-29T23:00:00Z", ""),
        ],
        id="berlin-hour-list-keeps-local-times-across-spring-forward",
    ),
    pytest.param(
        "0 1,13 * * *",
        "Europe/Berlin",
        "2026-10-24T06:00:00Z",
        [
            ("2026-10-24T13:00:00+02:00", "2026-10-24T11:00:00Z", ""),
            ("2026-10-25T01:00:00+02:00", "2026-10-24T23:00:00Z", ""),
            ("2026-10-25T13:00:00+01:00", "2026-10-25T12:00:00Z", ""),
        ],
        id="berlin-hour-list-keeps-local-times-across-fall-back",
    ),
    pytest.param(
        "0 0 * * *",
        "America/Santiago",
        "2026-09-04T12:00:00Z",
        [
            ("2026-09-05T00:00:00-04:00", "2026-09-05T04:00:00Z", ""),
            ("2026-09-06T01:00:00-03:00", "2026-09-06T04:00:00Z", MOVED.format("00:00")),
            ("2026-09-07T00:00:00-03:00", "2026-09-07T03:00:00Z", ""),
        ],
        id="santiago-midnight-missing-runs-at-0100",
    ),
]


@pytest.mark.parametrize(("cron", "zone", "after", "expected"), DST_CASES)
def test_fire_times_follow_the_dst_rules(cron, zone, after, expected):
    schedule = CronSchedule(cron, zone)

    times = next_fire_times(schedule, at(after), len(expected))

    assert [t[0] for t in rendered(times)] == [e[0] for e in expected], "local time with offset"
    assert [t[1] for t in rendered(times)] == [e[1] for e in expected], "UTC"
    assert [t[2] for t in rendered(times)] == [e[2] for e in expected], "notes"
    for fire in times:
        # Not ==: Python never finds a time in a repeated hour equal to one in another zone.
        assert fire.local.astimezone(UTC) == fire.utc, "local and utc must be the same instant"
        assert fire.local.tzinfo == ZoneInfo(zone)
        assert fire.utc.tzinfo is UTC


@pytest.mark.parametrize(
    ("cron", "after", "expected_local", "expected_utc"),
    [
        pytest.param(
            "30 2 * * *",
            "2026-10-25T02:10:00+01:00",
            "2026-10-26T02:30:00+01:00",
            "2026-10-26T01:30:00Z",
            id="named-hour-started-in-second-pass-does-not-run-again",
        ),
        pytest.param(
            "30 2 * * *",
            "2026-10-25T02:10:00+02:00",
            "2026-10-25T02:30:00+02:00",
            "2026-10-25T00:30:00Z",
            id="named-hour-started-in-first-pass-runs-in-first-pass",
        ),
        pytest.param(
            "0 * * * *",
            "2026-10-25T02:50:00+02:00",
            "2026-10-25T02:00:00+01:00",
            "2026-10-25T01:00:00Z",
            id="wall-clock-started-late-in-first-pass-still-gets-second-pass",
        ),
        pytest.param(
            "*/15 * * * *",
            "2026-10-25T02:10:00+01:00",
            "2026-10-25T02:15:00+01:00",
            "2026-10-25T01:15:00Z",
            id="wall-clock-started-in-second-pass-continues-it",
        ),
    ],
)
def test_starting_inside_the_repeated_hour(cron, after, expected_local, expected_utc):
    (fire,) = next_fire_times(CronSchedule(cron, "Europe/Berlin"), at(after), 1)

    assert fire.local.isoformat() == expected_local
    assert format_utc(fire.utc) == expected_utc


@pytest.mark.parametrize(
    "after",
    ["2026-03-28T22:00:00Z", "2026-03-29T00:30:00Z", "2026-03-29T01:30:00Z"],
    ids=["before-the-gap", "just-before-the-gap", "between-the-gap-and-the-run"],
)
def test_skipped_slot_note_does_not_depend_on_where_the_search_starts(after):
    times = fire_times_between(
        CronSchedule("0 */2 * * *", "Europe/Berlin"), at(after), at("2026-03-29T02:00:00Z"), 10
    )

    fire = times[-1]

    assert fire.local.isoformat() == "2026-03-29T04:00:00+02:00"
    assert format_utc(fire.utc) == "2026-03-29T02:00:00Z"
    assert fire.note == "02:00 does not exist on this day (DST); that run is skipped"


def test_named_hours_that_collapse_into_one_valid_time_run_once():
    times = next_fire_times(
        CronSchedule("0,30 2,3 * * *", "Europe/Berlin"), at("2026-03-29T00:00:00Z"), 3
    )

    assert rendered(times) == [
        ("2026-03-29T03:00:00+02:00", "2026-03-29T01:00:00Z", MOVED.format("02:00")),
        ("2026-03-29T03:30:00+02:00", "2026-03-29T01:30:00Z", ""),
        ("2026-03-30T02:00:00+02:00", "2026-03-30T00:00:00Z", ""),
    ]


# --- DST rules against a brute force over every UTC minute --------------------------------------


@lru_cache
def _transitions(zone_name: str, year: int) -> tuple[datetime, ...]:
    zone = ZoneInfo(zone_name)
    moments, instant = [], datetime(year, 1, 1, tzinfo=UTC)
    previous = instant.astimezone(zone).utcoffset()
    while instant.year == year:
        instant += timedelta(minutes=15)
        offset = instant.astimezone(zone).utcoffset()
        if offset != previous:
            moments.append(instant)
            previous = offset
    return tuple(moments)


@lru_cache
def _minutes(zone_name: str, start: datetime, end: datetime) -> tuple[list, list, Counter]:
    """Return each UTC minute in (start, end], its local time, and each wall time's count."""
    zone = ZoneInfo(zone_name)
    count = int((end - start) / timedelta(minutes=1))
    instants = [start + timedelta(minutes=i) for i in range(1, count + 1)]
    locals_ = [u.astimezone(zone) for u in instants]
    return instants, locals_, Counter(local.replace(tzinfo=None) for local in locals_)


def _brute_force(cron: str, zone_name: str, start: datetime, end: datetime) -> list[tuple]:
    """Apply the DESIGN.md rules minute by minute; cronsim only says which wall times match.

    Return (utc, has_note) for every expected fire time in (start, end].
    """
    matches = set()
    for naive in CronSim(cron, (start - timedelta(days=2)).replace(tzinfo=None)):
        if naive > (end + timedelta(days=2)).replace(tzinfo=None):
            break
        matches.add(naive)
    hour_field = cron.split()[1]
    wall_clock = "*" in hour_field or "/" in hour_field
    instants, locals_, seen = _minutes(zone_name, start, end)

    fires: list[tuple[datetime, bool]] = []
    dropped = False
    for index, (utc, local) in enumerate(zip(instants, locals_, strict=True)):
        naive = local.replace(tzinfo=None)
        gap_slots = []
        if index and local.utcoffset() > locals_[index - 1].utcoffset():
            walk = locals_[index - 1].replace(tzinfo=None) + timedelta(minutes=1)
            while walk < naive:
                if walk in matches:
                    gap_slots.append(walk)
                walk += timedelta(minutes=1)
        if wall_clock:
            # Every matching wall time fires, in each pass; slots in a gap are noted on the next.
            dropped = dropped or bool(gap_slots)
            if naive in matches:
                fires.append((utc, local.fold == 1 or dropped))
                dropped = False
        elif gap_slots:
            # Named hours: slots in a gap run at the first instant after it.
            fires.append((utc, True))
        elif naive in matches and local.fold == 0:
            # Named hours: only the first pass of a repeated wall time, noted if it repeats.
            fires.append((utc, seen[naive] > 1))
    deduped: list[tuple[datetime, bool]] = []
    for utc, noted in fires:
        if not deduped or deduped[-1][0] != utc:
            deduped.append((utc, noted))
    return deduped


BRUTE_FORCE_ZONES = [
    "Europe/Berlin",
    "America/New_York",
    "Australia/Lord_Howe",
    "America/Santiago",
    "Pacific/Chatham",
    "Asia/Kolkata",
]
BRUTE_FORCE_CRONS = [
    "0 * * * *",
    "*/15 * * * *",
    "5 */3 * * *",
    "30 2 * * *",
    "15 2 * * *",
    "45 1 * * *",
    "* 2 * * *",
    "0 0 * * *",
    "30 23 * * *",
    "0 1,13 * * *",
    "50 3 * * 0",
]


@pytest.mark.parametrize("zone_name", BRUTE_FORCE_ZONES)
@pytest.mark.parametrize("cron", BRUTE_FORCE_CRONS)
def test_fire_times_match_a_minute_by_minute_brute_force(cron, zone_name):
    moments = _transitions(zone_name, 2026) or (datetime(2026, 6, 1, tzinfo=UTC),)
    for moment in moments:
        start, end = moment - timedelta(hours=30), moment + timedelta(hours=30)

        times = fire_times_between(CronSchedule(cron, zone_name), start, end, limit=10_000)

        expected = _brute_force(cron, zone_name, start, end)
        assert [t.utc for t in times] == [utc for utc, _ in expected], moment
        assert [bool(t.note) for t in times] == [noted for _, noted in expected], moment
        for fire in times:
            assert fire.local.astimezone(UTC) == fire.utc


# --- cron syntax, compared with cronsim where there is no DST ------------------------------------


@pytest.mark.parametrize(
    ("cron", "reference"),
    [
        ("0 9 * * MON-FRI", None),
        ("*/7 3-5 * JAN,jul *", None),
        ("0 0 1,15 * 3", None),
        ("0 0 */2 * SUN", None),
        ("23 0-20/2 * * *", None),
        ("0 4 8-14 * *", None),
        ("5 4 * * sun", None),
        ("0 0,12 1 */2 *", None),
        ("0 0 29 2 *", None),
        ("0 12 * * 5-7", None),
        ("59 23 31 DEC *", None),
        ("0 0 * * 7", None),
        ("10/20 1/6 * * *", None),
        ("0 0 * * MON-SUN", "0 0 * * *"),
        ("@hourly", "0 * * * *"),
        ("@daily", "0 0 * * *"),
        ("@weekly", "0 0 * * 0"),
        ("@monthly", "0 0 1 * *"),
        ("@yearly", "0 0 1 1 *"),
        ("@annually", "0 0 1 1 *"),
    ],
)
def test_cron_syntax_matches_cronsim_in_utc(cron, reference):
    after = at("2026-01-01T00:00:00Z")
    walker = CronSim(reference or cron, after)
    expected = [next(walker) for _ in range(60)]

    times = next_fire_times(CronSchedule(cron, "UTC"), after, 60)

    assert [t.utc for t in times] == expected
    assert all(t.note == "" for t in times)


def test_next_fire_times_is_strictly_after_and_exactly_count():
    schedule = CronSchedule("0 * * * *")

    times = next_fire_times(schedule, at("2026-05-01T10:00:00Z"), 5)

    assert [format_utc(t.utc) for t in times] == [
        "2026-05-01T11:00:00Z",
        "2026-05-01T12:00:00Z",
        "2026-05-01T13:00:00Z",
        "2026-05-01T14:00:00Z",
        "2026-05-01T15:00:00Z",
    ]


def test_next_fire_times_accepts_after_in_any_zone():
    schedule = CronSchedule("30 2 * * *", "Europe/Berlin")
    in_utc = next_fire_times(schedule, at("2026-03-27T12:00:00Z"), 3)

    in_new_york = next_fire_times(schedule, at("2026-03-27T08:00:00-04:00"), 3)

    assert in_new_york == in_utc


def test_next_fire_times_rejects_naive_after():
    with pytest.raises(ValueError, match="aware"):
        next_fire_times(CronSchedule("0 * * * *"), datetime(2026, 1, 1), 1)


def test_sparse_cron_still_returns_count():
    times = next_fire_times(CronSchedule("0 0 29 2 *"), at("2026-01-01T00:00:00Z"), 3)

    assert [format_utc(t.utc) for t in times] == [
        "2028-02-29T00:00:00Z",
        "2032-02-29T00:00:00Z",
        "2036-02-29T00:00:00Z",
    ]


# --- day of week: Sunday is 0 and 7, ranges never wrap ------------------------------------------

WEEK_START = at("2026-01-04T00:00:00Z")  # a Sunday
DAY_TOKENS = [str(n) for n in range(8)] + ["SUN", "MON", "TUE", "WED", "THU", "FRI", "SAT"]


def weekdays_of(dow: str) -> set[int]:
    """Return the cron weekdays (0 = Sunday) on which `0 0 * * <dow>` fires in one week."""
    week = fire_times_between(
        CronSchedule(f"0 0 * * {dow}", jitter_seconds=0),
        WEEK_START - timedelta(minutes=1),
        WEEK_START + timedelta(days=6),
        limit=10,
    )
    return {t.local.isoweekday() % 7 for t in week}


def reference_weekdays(start: str, end: str, step: int) -> set[int] | None:
    """The documented rule, spelled out: None for a range that runs backwards.

    A number is itself (0 and 7 are Sunday); a name is its index from SUN = 0; a range that
    ends on the name SUN after a later day ends on day 7 (MON-SUN is the whole week).
    """
    names = DAY_TOKENS[8:]
    first = names.index(start) if start in names else int(start)
    last = names.index(end) if end in names else int(end)
    if end == "SUN" and first > 0:
        last = 7
    if first > last:
        return None
    days, day = set(), first
    while day <= last:
        days.add(0 if day == 7 else day)
        day += step
    return days


@pytest.mark.parametrize(
    "dow", ["SUN-SUN", "0-SUN", "SUN-0", "7-7", "0-0", "SUN", "sun", "7", "0", "7-SUN", "*/7"]
)
def test_every_spelling_of_sunday_fires_on_sunday_only(dow):
    assert weekdays_of(dow) == {0}


@pytest.mark.parametrize(
    ("dow", "expected"),
    [
        ("5-7", {5, 6, 0}),
        ("SAT-SUN", {6, 0}),
        ("FRI-SUN", {5, 6, 0}),
        ("MON-SUN", {0, 1, 2, 3, 4, 5, 6}),
        ("SUN-SAT", {0, 1, 2, 3, 4, 5, 6}),
        ("0-7", {0, 1, 2, 3, 4, 5, 6}),
        ("*", {0, 1, 2, 3, 4, 5, 6}),
        ("*/2", {0, 2, 4, 6}),
        ("*/3", {0, 3, 6}),
        ("1-7/2", {1, 3, 5, 0}),
        ("MON-SUN/2", {1, 3, 5, 0}),
        ("SUN-SUN/2", {0}),
        ("SUN/3", {0, 3, 6}),
        ("SAT,SUN", {6, 0}),
    ],
)
def test_day_of_week_ranges_steps_and_lists_name_the_documented_days(dow, expected):
    assert weekdays_of(dow) == expected


@pytest.mark.parametrize("step", [1, 2, 3])
def test_every_day_of_week_range_matches_the_reference(step):
    checked = 0
    for start in DAY_TOKENS:
        for end in DAY_TOKENS:
            dow = f"{start}-{end}" + (f"/{step}" if step > 1 else "")
            expected = reference_weekdays(start, end, step)
            if expected is None:
                with pytest.raises(ScheduleError) as caught:
                    parse_schedule({"cron": f"0 0 * * {dow}"})
                assert "runs backwards" in caught.value.errors["schedule.cron"], dow
            else:
                assert weekdays_of(dow) == expected, dow
                assert weekdays_of(dow.lower()) == expected, dow
            checked += 1
    assert checked == len(DAY_TOKENS) ** 2


@pytest.mark.parametrize(
    ("cron", "hint"),
    [
        ("0 0 * * SAT-MON", "'6-7,0-1'"),
        ("0 0 * * 5-1", "'5-7,0-1'"),
        ("0 0 * * 5-0", "'5-7'"),
        ("0 0 * * FRI-0", "'5-7'"),
        ("50-10 * * * *", "'50-59,0-10'"),
        ("0 22-2 * * *", "'22-23,0-2'"),
        ("0 0 * NOV-FEB *", "'11-12,1-2'"),
    ],
)
def test_a_range_that_wraps_around_is_refused_with_the_split_to_write(cron, hint):
    with pytest.raises(ScheduleError) as caught:
        parse_schedule({"cron": cron})

    reason = caught.value.errors["schedule.cron"]
    assert "runs backwards" in reason and "do not wrap around" in reason and hint in reason


# --- fire_times_between ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("after", "until", "limit", "expected"),
    [
        pytest.param(
            "2026-05-01T10:00:00Z",
            "2026-05-01T13:00:00Z",
            100,
            ["2026-05-01T11:00:00Z", "2026-05-01T12:00:00Z", "2026-05-01T13:00:00Z"],
            id="after-exclusive-until-inclusive",
        ),
        pytest.param(
            "2026-05-01T09:59:59Z",
            "2026-05-01T11:59:59Z",
            100,
            ["2026-05-01T10:00:00Z", "2026-05-01T11:00:00Z"],
            id="between-fire-times",
        ),
        pytest.param(
            "2026-05-01T10:00:00Z",
            "2026-05-01T20:00:00Z",
            2,
            ["2026-05-01T11:00:00Z", "2026-05-01T12:00:00Z"],
            id="limit-keeps-the-earliest",
        ),
        pytest.param("2026-05-01T10:00:00Z", "2026-05-01T10:00:00Z", 100, [], id="empty-window"),
        pytest.param("2026-05-01T10:00:00Z", "2026-05-01T09:00:00Z", 100, [], id="until-before"),
        pytest.param("2026-05-01T10:00:00Z", "2026-05-01T20:00:00Z", 0, [], id="limit-zero"),
    ],
)
def test_fire_times_between_boundaries_and_limit(after, until, limit, expected):
    times = fire_times_between(CronSchedule("0 * * * *"), at(after), at(until), limit)

    assert [format_utc(t.utc) for t in times] == expected
    assert [t.local.isoformat() for t in times] == [e.replace("Z", "+00:00") for e in expected]


def test_fire_times_between_covers_both_passes_of_a_repeated_hour():
    times = fire_times_between(
        CronSchedule("0 * * * *", "Europe/Berlin"),
        at("2026-10-25T00:00:00Z"),
        at("2026-10-25T01:00:00Z"),
        limit=10,
    )

    assert rendered(times) == [
        ("2026-10-25T02:00:00+01:00", "2026-10-25T01:00:00Z", SECOND_PASS.format("02:00"))
    ]


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
        pytest.param({"cron": "0 0 L * *"}, "schedule.cron", "'L' is not supported", id="quartz-L"),
        pytest.param({"cron": "0 0 * * MON#2"}, "schedule.cron", "not supported", id="quartz-hash"),
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
            {"cron": "0 2 * * *", "timeZone": "UTC", "jitterSeconds": 60, "missedRunPolicy": "run_once"},
            id="cron-defaults",
        ),
        pytest.param(
            {"cron": "  30  2 * *   * ", "timeZone": "Europe/Berlin", "jitterSeconds": 0, "missedRunPolicy": "skip"},
            CronSchedule("30 2 * * *", "Europe/Berlin", 0, "skip"),
            {"cron": "30 2 * * *", "timeZone": "Europe/Berlin", "jitterSeconds": 0, "missedRunPolicy": "skip"},
            id="cron-whitespace-normalised",
        ),
        pytest.param(
            {"cron": "*/15 * * * *", "jitterSeconds": 900, "missedRunPolicy": "run_all"},
            CronSchedule("*/15 * * * *", "UTC", 900, "run_all"),
            {"cron": "*/15 * * * *", "timeZone": "UTC", "jitterSeconds": 900, "missedRunPolicy": "run_all"},
            id="jitter-equal-to-period",
        ),
        pytest.param(
            {"cron": "@weekly", "timeZone": "Asia/Kolkata", "jitterSeconds": 3600},
            CronSchedule("@weekly", "Asia/Kolkata", 3600, "run_once"),
            {"cron": "@weekly", "timeZone": "Asia/Kolkata", "jitterSeconds": 3600, "missedRunPolicy": "run_once"},
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


def test_one_off_keeps_utc_and_sub_second_precision_through_json():
    schedule = parse_schedule({"runAt": "2026-12-01T10:00:00.250+02:00"})

    assert schedule.run_at.tzinfo is UTC
    assert schedule_to_json(schedule) == {"runAt": "2026-12-01T08:00:00.250000Z"}
    assert parse_schedule(schedule_to_json(schedule)) == schedule


@pytest.mark.parametrize("today", ["2026-03-29T01:30:00Z", "2031-10-26T01:30:00Z"])
def test_validation_does_not_depend_on_today(today):
    with time_machine.travel(at(today), tick=False):
        accepted = parse_schedule({"cron": "0 1,23 * * *", "jitterSeconds": 7200})
        with pytest.raises(ScheduleError) as caught:
            parse_schedule({"cron": "0 1,23 * * *", "jitterSeconds": 7201})

    assert accepted.jitter_seconds == 7200
    assert "(7200 seconds)" in caught.value.errors["schedule.jitterSeconds"]


# --- hostile input: prefixes, lengths, huge numbers, random text ---------------------------------


@pytest.mark.parametrize(
    ("cron", "zone"),
    [
        ("TZ=Europe/Berlin 0 0 * * *", "Europe/Berlin"),
        ("CRON_TZ=Europe/Berlin 0 0 * * *", "Europe/Berlin"),
        ("cron_tz=America/New_York 30 2 * * 1-5", "America/New_York"),
        ("TZ=UTC @daily", "UTC"),
        ("TZ=Asia/Kolkata\n0 9 * * *", "Asia/Kolkata"),
    ],
)
def test_a_time_zone_prefix_is_refused_pointing_to_the_time_zone_field(cron, zone):
    with pytest.raises(ScheduleError) as caught:
        parse_schedule({"cron": cron})

    assert list(caught.value.errors) == ["schedule.cron"]
    reason = caught.value.errors["schedule.cron"]
    assert "timeZone" in reason and f"'{zone}'" in reason
    assert "seconds" not in reason


def test_a_crontab_variable_assignment_is_refused_as_not_part_of_a_schedule():
    with pytest.raises(ScheduleError) as caught:
        parse_schedule({"cron": "SHELL=/bin/bash 0 0 * * *"})

    reason = caught.value.errors["schedule.cron"]
    assert "'SHELL=/bin/bash'" in reason and "variable" in reason and "seconds" not in reason


def _cron_of_length(length: int) -> str:
    """A valid cron of exactly `length` characters: a long list in the minute field."""
    tail = " * * * *"
    minutes = ",".join(str(n % 60) for n in range(length))
    cron = minutes[: length - len(tail)].rstrip(",") + tail
    while len(cron) < length:
        cron = "0" + cron  # leading zeros keep the first minute's value
    return cron


def test_a_cron_of_200_characters_is_accepted_and_one_longer_is_refused():
    accepted = parse_schedule({"cron": _cron_of_length(200)})
    assert len(accepted.cron) == 200

    for length in (201, 5000, 2_000_000):
        with pytest.raises(ScheduleError) as caught:
            parse_schedule({"cron": _cron_of_length(length) if length < 10_000 else "0," * length})
        assert "at most 200 characters" in caught.value.errors["schedule.cron"]


def test_the_length_limit_counts_the_expression_after_whitespace_is_collapsed():
    schedule = parse_schedule({"cron": "  0" + " " * 300 + "2 * * *  "})

    assert schedule.cron == "0 2 * * *"


@pytest.mark.parametrize(
    "cron",
    [
        "1" * 5000 + " * * * *",
        "*/" + "9" * 5000 + " * * * *",
        "0 0 1-" + "9" * 4400 + " * *",
        "0 0 * * " + "0" * 4400 + "1",
    ],
    ids=["huge-value", "huge-step", "huge-range-end", "padded-value"],
)
def test_a_huge_digit_string_is_a_schedule_error_not_a_crash(cron):
    with pytest.raises(ScheduleError) as caught:
        parse_schedule({"cron": cron})

    assert list(caught.value.errors) == ["schedule.cron"]


@pytest.mark.parametrize(
    ("cron", "field", "maximum"),
    [
        ("*/60 * * * *", "minute", 59),
        ("*/99999999999999999999 * * * *", "minute", 59),
        ("0-30/100 * * * *", "minute", 59),
        ("0 */24 * * *", "hour", 23),
        ("0 0 */32 * *", "day-of-month", 31),
        ("0 0 * */13 *", "month", 12),
        ("0 0 * * */8", "day-of-week", 7),
        ("0 0 * * MON/8", "day-of-week", 7),
    ],
)
def test_a_step_larger_than_the_field_maximum_is_refused_naming_the_field(cron, field, maximum):
    with pytest.raises(ScheduleError) as caught:
        parse_schedule({"cron": cron})

    reason = caught.value.errors["schedule.cron"]
    assert reason.startswith(f"{field} field: step ") and f"from 1 to {maximum}" in reason


@pytest.mark.parametrize(
    "cron", ["*/59 * * * *", "0 */23 * * *", "0 0 */31 * *", "0 0 * */12 *", "0 0 * * */7"]
)
def test_a_step_up_to_the_field_maximum_is_accepted(cron):
    assert parse_schedule({"cron": cron}).cron == cron


@pytest.mark.parametrize("cron", ["0 0 * * ſun", "0 0 * * frı", "0 0 * ᴊan *"])
def test_names_are_ascii_only_even_when_they_upper_case_to_a_name(cron):
    with pytest.raises(ScheduleError):
        parse_schedule({"cron": cron})


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
        st.sampled_from(["timeZone", "jitterSeconds", "missedRunPolicy"]), SCHEDULE_VALUES
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
        next_fire_times(schedule, WEEK_START, 2)


@given(raw=st.one_of(SCHEDULE_VALUES, st.dictionaries(
    st.sampled_from(["cron", "runAt", "delaySeconds", "timeZone", "jitterSeconds", "x"]),
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


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (datetime(2026, 3, 29, 1, 0, tzinfo=UTC), "2026-03-29T01:00:00Z"),
        (at("2026-03-29T03:00:00.999+02:00"), "2026-03-29T01:00:00Z"),
        (at("2026-03-28T20:00:00-05:00"), "2026-03-29T01:00:00Z"),
    ],
)
def test_format_utc_renders_seconds_with_z(value, expected):
    assert format_utc(value) == expected


def test_format_utc_rejects_naive_times():
    with pytest.raises(ValueError):
        format_utc(datetime(2026, 3, 29, 1))


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
    }
    assert [item["local"] for item in items] == [
        "2026-03-28T02:30:00+01:00",
        "2026-03-29T03:00:00+02:00",
        "2026-03-30T02:30:00+02:00",
    ]
    assert [item["note"] for item in items] == ["", items[1]["note"], ""]
    for item in items:
        assert set(item) == {"local", "utc", "start", "note"}
        assert LOCAL_ISO.match(item["local"]) and UTC_ISO.match(item["utc"])
        assert UTC_ISO.match(item["start"])


def test_preview_without_jitter_starts_on_time():
    schedule = parse_schedule(
        {"cron": "0 2 * * *", "timeZone": "Europe/Berlin", "jitterSeconds": 0}
    )

    items = preview("billing.export-invoices", schedule, at("2026-03-14T12:00:00Z"), 2)

    assert items == [
        {"local": "2026-03-15T02:00:00+01:00", "utc": "2026-03-15T01:00:00Z", "start": "2026-03-15T01:00:00Z", "note": ""},
        {"local": "2026-03-16T02:00:00+01:00", "utc": "2026-03-16T01:00:00Z", "start": "2026-03-16T01:00:00Z", "note": ""},
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("schedule", "after", "created_at", "expected"),
    [
        pytest.param(
            OneOffSchedule(datetime(2026, 12, 1, 10, tzinfo=UTC)),
            "2026-11-30T00:00:00Z",
            None,
            [{"local": "2026-12-01T10:00:00+00:00", "utc": "2026-12-01T10:00:00Z", "start": "2026-12-01T10:00:00Z", "note": ""}],
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
            [{"local": "2026-05-01T10:03:00+00:00", "utc": "2026-05-01T10:03:00Z", "start": "2026-05-01T10:03:00Z", "note": ""}],
            id="delayed-from-creation",
        ),
        pytest.param(
            DelayedSchedule(300),
            "2026-05-01T12:00:00Z",
            None,
            [{"local": "2026-05-01T12:05:00+00:00", "utc": "2026-05-01T12:05:00Z", "start": "2026-05-01T12:05:00Z", "note": ""}],
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
