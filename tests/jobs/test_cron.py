"""Tests for apps/jobs/cron.py: cron syntax (fields, names, ranges, steps, macros) and its limits.

Pure functions: no database, no Django settings needed.
"""

from __future__ import annotations

from datetime import datetime, timedelta

import pytest
from cronsim import CronSim

from apps.jobs.firetimes import fire_times_between, next_fire_times
from apps.jobs.schedule import CronSchedule, ScheduleError, parse_schedule


def at(text: str) -> datetime:
    return datetime.fromisoformat(text)


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


# --- hostile input: prefixes, lengths, huge numbers ----------------------------------------------


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
