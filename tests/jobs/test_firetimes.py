"""Tests for apps/jobs/firetimes.py: cron fire times under DST, checked against a brute force.

Pure functions: no database, no Django settings needed.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from datetime import UTC, datetime, timedelta
from functools import lru_cache
from zoneinfo import ZoneInfo

import pytest
from cronsim import CronSim

from apps.jobs.firetimes import (
    FireTime,
    fire_times_between,
    next_fire_times,
    schedule_fire_times,
)
from apps.jobs.schedule import CronSchedule
from apps.runs.clock import format_utc

MOVED = "{} does not exist on this day (DST); runs at the next valid time"
FIRST_ONLY = "{} occurs twice on this day (DST); runs once, at the first occurrence"
SECOND_PASS = "{} occurs twice on this day (DST); this is the second pass"
FIRST_PASS = "{} occurs twice on this day (DST); this is the first pass"


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
            ("2026-10-25T02:00:00+02:00", "2026-10-25T00:00:00Z", FIRST_PASS.format("02:00")),
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
            ("2026-10-25T02:00:00+02:00", "2026-10-25T00:00:00Z", FIRST_PASS.format("02:00")),
            ("2026-10-25T02:15:00+02:00", "2026-10-25T00:15:00Z", FIRST_PASS.format("02:15")),
            ("2026-10-25T02:30:00+02:00", "2026-10-25T00:30:00Z", FIRST_PASS.format("02:30")),
            ("2026-10-25T02:45:00+02:00", "2026-10-25T00:45:00Z", FIRST_PASS.format("02:45")),
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


# --- the day rules (L, LW, nW, dL, d#n) go through the same DST rules ------------------------------

DAY_RULE_DST_CASES = [
    pytest.param(
        "0 2 L * *",
        "Europe/Berlin",
        "2027-09-29T00:00:00Z",
        [
            ("2027-09-30T02:00:00+02:00", "2027-09-30T00:00:00Z", ""),
            # 2027-10-31 is both October's last day and its last Sunday: the clocks fall back.
            ("2027-10-31T02:00:00+02:00", "2027-10-31T00:00:00Z", FIRST_ONLY.format("02:00")),
            ("2027-11-30T02:00:00+01:00", "2027-11-30T01:00:00Z", ""),
        ],
        id="berlin-last-day-on-the-fall-back-runs-once-at-the-first-0200",
    ),
    pytest.param(
        "0 * L 10 *",
        "Europe/Berlin",
        "2027-10-30T23:30:00Z",
        [
            ("2027-10-31T02:00:00+02:00", "2027-10-31T00:00:00Z", FIRST_PASS.format("02:00")),
            ("2027-10-31T02:00:00+01:00", "2027-10-31T01:00:00Z", SECOND_PASS.format("02:00")),
            ("2027-10-31T03:00:00+01:00", "2027-10-31T02:00:00Z", ""),
        ],
        id="berlin-hourly-on-the-last-day-fires-in-both-passes",
    ),
    pytest.param(
        "30 2 LW * *",
        "Asia/Jerusalem",
        "2030-02-27T00:00:00Z",
        [
            ("2030-02-28T02:30:00+02:00", "2030-02-28T00:30:00Z", ""),
            # March 2030 ends on a Sunday: its last weekday is Friday the 29th, when Israel's
            # clocks spring forward at 02:00.
            ("2030-03-29T03:00:00+03:00", "2030-03-29T00:00:00Z", MOVED.format("02:30")),
            ("2030-04-30T02:30:00+03:00", "2030-04-29T23:30:00Z", ""),
        ],
        id="jerusalem-last-weekday-on-the-spring-forward-runs-at-0300",
    ),
    pytest.param(
        "30 2 LW * *",
        "Europe/Berlin",
        "2030-02-27T00:00:00Z",
        [
            ("2030-02-28T02:30:00+01:00", "2030-02-28T01:30:00Z", ""),
            ("2030-03-29T02:30:00+01:00", "2030-03-29T01:30:00Z", ""),
            ("2030-04-30T02:30:00+02:00", "2030-04-30T00:30:00Z", ""),
        ],
        id="berlin-last-weekday-is-before-the-sunday-change",
    ),
    pytest.param(
        "30 2 * * 5L",
        "Asia/Jerusalem",
        "2026-02-26T00:00:00Z",
        [
            ("2026-02-27T02:30:00+02:00", "2026-02-27T00:30:00Z", ""),
            ("2026-03-27T03:00:00+03:00", "2026-03-27T00:00:00Z", MOVED.format("02:30")),
            ("2026-04-24T02:30:00+03:00", "2026-04-23T23:30:00Z", ""),
        ],
        id="jerusalem-last-friday-on-the-spring-forward-runs-at-0300",
    ),
    pytest.param(
        "30 2 * * 0#5",
        "Europe/Berlin",
        "2026-03-01T00:00:00Z",
        [
            ("2026-03-29T03:00:00+02:00", "2026-03-29T01:00:00Z", MOVED.format("02:30")),
            ("2026-05-31T02:30:00+02:00", "2026-05-31T00:30:00Z", ""),
        ],
        id="berlin-fifth-sunday-on-the-spring-forward-runs-at-0300",
    ),
    pytest.param(
        "0 2 * * SUN#4",
        "Europe/Berlin",
        "2026-10-01T00:00:00Z",
        [
            ("2026-10-25T02:00:00+02:00", "2026-10-25T00:00:00Z", FIRST_ONLY.format("02:00")),
            ("2026-11-22T02:00:00+01:00", "2026-11-22T01:00:00Z", ""),
        ],
        id="berlin-fourth-sunday-on-the-fall-back-runs-once",
    ),
    pytest.param(
        "0 0 1W * *",
        "America/Santiago",
        "2026-08-30T12:00:00Z",
        [
            # 2026-09-06 is Santiago's spring forward at midnight; 1W picks Tuesday the 1st.
            ("2026-09-01T00:00:00-04:00", "2026-09-01T04:00:00Z", ""),
            ("2026-10-01T00:00:00-03:00", "2026-10-01T03:00:00Z", ""),
        ],
        id="santiago-nearest-weekday-keeps-its-local-midnight",
    ),
]


@pytest.mark.parametrize(("cron", "zone", "after", "expected"), DAY_RULE_DST_CASES)
def test_day_rules_follow_the_dst_rules(cron, zone, after, expected):
    times = next_fire_times(CronSchedule(cron, zone), at(after), len(expected))

    assert rendered(times) == expected


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
    """Apply the DST rules (README, "DST rules") minute by minute; cronsim only says which wall times match.

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
            # Every matching wall time fires, in each pass (both noted); slots in a gap are
            # noted on the next.
            dropped = dropped or bool(gap_slots)
            if naive in matches:
                fires.append((utc, seen[naive] > 1 or dropped))
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
    # The European changes fall on the last Sunday of March and October.
    "30 2 * * 0L",
    "*/30 * * * 0L",
    "0 2 L * *",
    "30 1 * * 0#1",
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


# --- next_fire_times -----------------------------------------------------------------------------


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


# --- bounds: startAt and endAt, both inclusive ------------------------------------------------------


def bounded(cron: str, zone: str = "UTC", start: str | None = None, end: str | None = None):
    return CronSchedule(
        cron, zone, start_at=at(start) if start else None, end_at=at(end) if end else None
    )


@pytest.mark.parametrize(
    ("schedule", "after", "expected"),
    [
        pytest.param(
            bounded("0 * * * *", start="2026-05-01T12:00:00Z"),
            "2026-05-01T00:00:00Z",
            ["2026-05-01T12:00:00Z", "2026-05-01T13:00:00Z", "2026-05-01T14:00:00Z"],
            id="a-fire-time-at-start-runs",
        ),
        pytest.param(
            bounded("0 * * * *", start="2026-05-01T12:00:00.001Z"),
            "2026-05-01T00:00:00Z",
            ["2026-05-01T13:00:00Z", "2026-05-01T14:00:00Z", "2026-05-01T15:00:00Z"],
            id="a-fire-time-just-before-start-does-not",
        ),
        pytest.param(
            bounded("0 * * * *", start="2026-05-01T12:00:00Z"),
            "2026-05-01T12:30:00Z",
            ["2026-05-01T13:00:00Z", "2026-05-01T14:00:00Z", "2026-05-01T15:00:00Z"],
            id="a-start-in-the-past-changes-nothing",
        ),
        pytest.param(
            bounded("0 * * * *", end="2026-05-01T12:00:00Z"),
            "2026-05-01T09:30:00Z",
            ["2026-05-01T10:00:00Z", "2026-05-01T11:00:00Z", "2026-05-01T12:00:00Z"],
            id="a-fire-time-at-end-runs-and-is-the-last",
        ),
        pytest.param(
            bounded("0 * * * *", end="2026-05-01T11:59:59.999Z"),
            "2026-05-01T09:30:00Z",
            ["2026-05-01T10:00:00Z", "2026-05-01T11:00:00Z"],
            id="a-fire-time-just-after-end-does-not",
        ),
        pytest.param(
            bounded("0 * * * *", end="2026-05-01T12:00:00Z"),
            "2026-05-01T12:00:00Z",
            [],
            id="nothing-after-the-end",
        ),
        pytest.param(
            bounded("0 * * * *", start="2026-05-01T10:30:00+02:00", end="2026-05-01T11:00:00Z"),
            "2026-04-01T00:00:00Z",
            ["2026-05-01T09:00:00Z", "2026-05-01T10:00:00Z", "2026-05-01T11:00:00Z"],
            id="offsets-are-instants",
        ),
        pytest.param(
            bounded("0 0 L * *", start="2028-02-01T00:00:00Z", end="2028-04-30T00:00:00Z"),
            "2026-01-01T00:00:00Z",
            ["2028-02-29T00:00:00Z", "2028-03-31T00:00:00Z", "2028-04-30T00:00:00Z"],
            id="a-day-rule-within-bounds",
        ),
    ],
)
def test_bounds_keep_fire_times_between_start_and_end_inclusive(schedule, after, expected):
    times = next_fire_times(schedule, at(after), 3)

    assert [format_utc(t.utc) for t in times] == expected


@pytest.mark.parametrize(
    ("start", "expected"),
    [
        # 02:30 does not exist on 2026-03-29 in Berlin; the run moves to 03:00+02:00 (01:00Z).
        ("2026-03-29T01:00:00Z", "2026-03-29T03:00:00+02:00"),
        ("2026-03-29T01:00:01Z", "2026-03-30T02:30:00+02:00"),
    ],
)
def test_a_start_bound_applies_where_a_dst_change_moved_the_time(start, expected):
    schedule = bounded("30 2 * * *", "Europe/Berlin", start=start)

    (first,) = next_fire_times(schedule, at("2026-03-20T00:00:00Z"), 1)

    assert first.local.isoformat() == expected


def test_an_end_bound_inside_a_repeated_hour_keeps_only_the_first_pass():
    schedule = bounded("0 * * * *", "Europe/Berlin", end="2026-10-25T00:30:00Z")

    times = fire_times_between(schedule, at("2026-10-24T23:30:00Z"), at("2026-10-25T05:00:00Z"), 10)

    first = FIRST_PASS.format("02:00")
    assert rendered(times) == [("2026-10-25T02:00:00+02:00", "2026-10-25T00:00:00Z", first)]


def test_fire_times_between_stops_at_the_end_bound_and_the_limit():
    schedule = bounded("*/10 * * * *", start="2026-05-01T10:05:00Z", end="2026-05-01T11:00:00Z")

    every = fire_times_between(
        schedule, at("2026-05-01T00:00:00Z"), at("2026-05-02T00:00:00Z"), 100
    )
    capped = fire_times_between(schedule, at("2026-05-01T00:00:00Z"), at("2026-05-02T00:00:00Z"), 2)

    assert [format_utc(t.utc) for t in every] == [
        "2026-05-01T10:10:00Z",
        "2026-05-01T10:20:00Z",
        "2026-05-01T10:30:00Z",
        "2026-05-01T10:40:00Z",
        "2026-05-01T10:50:00Z",
        "2026-05-01T11:00:00Z",
    ]
    assert capped == every[:2]


def test_a_gap_that_dropped_slots_is_noted_with_other_clock_changes_before_the_next_run():
    """The gap was searched for between the next run and a day before the slot before it:
    with a fall back and another spring forward in between (a yearly cron), the search found
    the wrong change and the dropped slots were noted nowhere."""
    yearly = next_fire_times(
        CronSchedule("0 0-2/1 29 3 *", "Europe/Berlin"), at("2026-03-28T00:00:00Z"), 4
    )
    assert rendered(yearly) == [
        ("2026-03-29T00:00:00+01:00", "2026-03-28T23:00:00Z", ""),
        ("2026-03-29T01:00:00+01:00", "2026-03-29T00:00:00Z", ""),
        ("2027-03-29T00:00:00+02:00", "2027-03-28T22:00:00Z",
         "02:00 does not exist on this day (DST); that run is skipped"),
        ("2027-03-29T01:00:00+02:00", "2027-03-28T23:00:00Z", ""),
    ]  # fmt: skip
    # Samoa's skipped Friday, whose next December Friday is a year on.
    fridays = next_fire_times(
        CronSchedule("0 * * 12 5", "Pacific/Apia"), at("2011-12-29T00:00:00Z"), 2
    )
    assert [(fire.local.isoformat(), fire.note) for fire in fridays] == [
        ("2012-12-07T00:00:00+14:00", "00:00 to 23:00 (24 times) do not exist on this day"
         " (the zone's UTC offset changed); those runs are skipped"),
        ("2012-12-07T01:00:00+14:00", ""),
    ]  # fmt: skip


@pytest.mark.parametrize(
    "zone, last",
    [("UTC", "23:00"), ("Pacific/Kiritimati", "23:00"), ("Pacific/Pago_Pago", "00:00")],
)
def test_the_last_day_datetime_can_hold_has_its_fire_times(zone, last):
    """Sampling the offsets around 9999-12-31 left datetime's range: its times were never
    listed (the preview stopped at the day before). West of UTC its evening is past the range
    once in UTC: the times end there (the preview stops at the OverflowError)."""
    fires = schedule_fire_times(CronSchedule("0 0,23 31 12 *", zone), at("9998-12-31T23:59:00Z"))
    listed = []
    with contextlib.suppress(OverflowError):
        listed.extend(fire.local.strftime("%Y-%m-%d %H:%M") for fire in fires)
    assert listed[-1] == f"9999-12-31 {last}"
    assert "9999-12-31 00:00" in listed


def test_a_day_skipped_by_a_change_of_the_zones_offset_is_not_called_dst():
    """Samoa crossed the date line in 2011: 30 December did not exist in Pacific/Apia, which
    was on daylight saving time before and after. The notes said "(DST)"."""
    offset = "the zone's UTC offset changed"
    named = next_fire_times(
        CronSchedule("0 12 * * *", "Pacific/Apia"), at("2011-12-29T00:00:00Z"), 3
    )
    assert rendered(named) == [
        ("2011-12-29T12:00:00-10:00", "2011-12-29T22:00:00Z", ""),
        ("2011-12-31T00:00:00+14:00", "2011-12-30T10:00:00Z",
         f"12:00 does not exist on this day ({offset}); runs at the next valid time"),
        ("2011-12-31T12:00:00+14:00", "2011-12-30T22:00:00Z", ""),
    ]  # fmt: skip
    wall = next_fire_times(
        CronSchedule("0 */6 * * *", "Pacific/Apia"), at("2011-12-30T09:00:00Z"), 1
    )
    assert wall[0].note == (
        f"00:00, 06:00, 12:00 and 18:00 do not exist on this day ({offset}); those runs are skipped"
    )
    berlin = next_fire_times(
        CronSchedule("30 2 * * *", "Europe/Berlin"), at("2026-03-28T12:00:00Z"), 1
    )
    assert berlin[0].note == MOVED.format("02:30")  # a DST change is still called one


def test_slots_a_gap_dropped_are_noted_on_the_next_run_however_far_away_it_is():
    """The note looked two days back only: a cron that skips days, whose next run came later
    (Monday after Samoa's skipped Friday; next Sunday after New York's spring forward), had no
    run saying what the gap dropped."""
    offset = "the zone's UTC offset changed"
    weekdays = next_fire_times(
        CronSchedule("0 * * * 1-5", "Pacific/Apia"), at("2011-12-30T08:30:00Z"), 2
    )
    assert rendered(weekdays) == [
        ("2011-12-29T23:00:00-10:00", "2011-12-30T09:00:00Z", ""),
        ("2012-01-02T00:00:00+14:00", "2012-01-01T10:00:00Z",
         f"00:00 to 23:00 (24 times) do not exist on this day ({offset}); those runs are skipped"),
    ]  # fmt: skip
    sundays = next_fire_times(
        CronSchedule("0 0-2/2 * * 0", "America/New_York"), at("2026-03-08T06:00:00Z"), 2
    )
    assert rendered(sundays) == [
        ("2026-03-15T00:00:00-04:00", "2026-03-15T04:00:00Z",
         "02:00 does not exist on this day (DST); that run is skipped"),
        ("2026-03-15T02:00:00-04:00", "2026-03-15T06:00:00Z", ""),
    ]  # fmt: skip
    # A later spring forward of a cron whose slots it did not touch says nothing; a year apart
    # says nothing either (that gap dropped none of its slots).
    mondays = next_fire_times(
        CronSchedule("0 */12 * * 1", "America/New_York"), at("2026-03-08T06:00:00Z"), 1
    )
    yearly = next_fire_times(
        CronSchedule("0 */2 1 4 *", "Europe/Berlin"), at("2027-03-31T00:00:00Z"), 1
    )
    assert mondays[0].note == "" and yearly[0].note == ""
