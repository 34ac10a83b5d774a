"""Tests for apps/jobs/cron.py: cron syntax (fields, names, ranges, steps, macros) and its limits.

Pure functions: no database, no Django settings needed.
"""

from __future__ import annotations

from calendar import monthrange
from datetime import date, datetime, timedelta

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


# --- L, LW, nW in day of month; dL, d#n in day of week (Quartz's meaning) -------------------------


def fire_dates(cron: str, after: str, count: int) -> list[str]:
    """The dates of the first `count` fire times of `cron` in UTC after `after`."""
    times = next_fire_times(CronSchedule(cron, "UTC", 0), at(after), count)
    return [t.local.date().isoformat() for t in times]


# Each row checked by hand against a printed calendar. December 2027 to August 2028 crosses the
# leap February (2028-02-29 is a Tuesday).
WINTER_2028 = "2027-11-30T12:00:00Z"
# Rows in 2026, where month starts and ends fall on weekends often.
YEAR_2026 = "2025-12-31T12:00:00Z"
FORMS = [
    pytest.param("0 0 L * *", WINTER_2028,
                 ["2027-12-31", "2028-01-31", "2028-02-29", "2028-03-31", "2028-04-30",
                  "2028-05-31", "2028-06-30", "2028-07-31"], id="L-last-day-leap-february"),
    pytest.param("0 0 l 2 *", "2025-12-31T12:00:00Z",
                 ["2026-02-28", "2027-02-28", "2028-02-29", "2029-02-28"], id="l-any-case-february"),
    pytest.param("0 0 LW * *", WINTER_2028,
                 ["2027-12-31", "2028-01-31", "2028-02-29", "2028-03-31", "2028-04-28",
                  "2028-05-31", "2028-06-30", "2028-07-31"], id="LW-sunday-30-april-is-friday-28"),
    pytest.param("0 0 LW 1,2,5,10 *", YEAR_2026,
                 ["2026-01-30", "2026-02-27", "2026-05-29", "2026-10-30"],
                 id="LW-saturday-and-sunday-last-days-go-back-to-friday"),
    pytest.param("0 0 1W 1,2,3,8,11 *", YEAR_2026,
                 ["2026-01-01", "2026-02-02", "2026-03-02", "2026-08-03", "2026-11-02"],
                 id="1W-saturday-1st-is-monday-3rd-sunday-1st-is-monday-2nd"),
    pytest.param("0 0 15W 1,2,5,8 *", YEAR_2026,
                 ["2026-01-15", "2026-02-16", "2026-05-15", "2026-08-14"],
                 id="15W-sunday-to-monday-saturday-to-friday"),
    pytest.param("0 0 31W * *", YEAR_2026,
                 ["2026-01-30", "2026-03-31", "2026-05-29", "2026-07-31", "2026-08-31",
                  "2026-10-30", "2026-12-31"],
                 id="31W-never-leaves-the-month-and-skips-months-without-a-31st"),
    pytest.param("0 0 29W 2 *", YEAR_2026, ["2028-02-29", "2032-02-27", "2036-02-29"],
                 id="29W-leap-years-only-sunday-29th-goes-back-to-friday"),
    pytest.param("0 0 * * 5L", WINTER_2028,
                 ["2027-12-31", "2028-01-28", "2028-02-25", "2028-03-31", "2028-04-28",
                  "2028-05-26", "2028-06-30", "2028-07-28"], id="5L-last-friday"),
    pytest.param("0 0 * * FRIL", WINTER_2028,
                 ["2027-12-31", "2028-01-28", "2028-02-25"], id="FRIL-last-friday-by-name"),
    pytest.param("0 0 * * friL", WINTER_2028,
                 ["2027-12-31", "2028-01-28", "2028-02-25"], id="friL-any-case"),
    pytest.param("0 0 * * 0L", WINTER_2028,
                 ["2027-12-26", "2028-01-30", "2028-02-27", "2028-03-26", "2028-04-30",
                  "2028-05-28", "2028-06-25", "2028-07-30"], id="0L-last-sunday"),
    pytest.param("0 0 * * 7L", WINTER_2028, ["2027-12-26", "2028-01-30", "2028-02-27"],
                 id="7L-is-0L"),
    pytest.param("0 0 * * 5#3", WINTER_2028,
                 ["2027-12-17", "2028-01-21", "2028-02-18", "2028-03-17", "2028-04-21",
                  "2028-05-19", "2028-06-16", "2028-07-21"], id="5#3-third-friday"),
    pytest.param("0 0 * * FRI#3", WINTER_2028, ["2027-12-17", "2028-01-21", "2028-02-18"],
                 id="FRI#3-by-name"),
    pytest.param("0 0 * * 2#5", WINTER_2028, ["2028-02-29", "2028-05-30", "2028-08-29"],
                 id="2#5-months-without-a-fifth-tuesday-are-skipped"),
    pytest.param("0 0 * * 0#2", WINTER_2028, ["2027-12-12", "2028-01-09", "2028-02-13"],
                 id="0#2-second-sunday"),
    pytest.param("0 0 * * 7#2", WINTER_2028, ["2027-12-12", "2028-01-09", "2028-02-13"],
                 id="7#2-is-0#2"),
    pytest.param("0 0 * * SUN#2", WINTER_2028, ["2027-12-12", "2028-01-09", "2028-02-13"],
                 id="SUN#2-is-0#2"),
    pytest.param("0 0 1,15,L 2 *", WINTER_2028,
                 ["2028-02-01", "2028-02-15", "2028-02-29", "2029-02-01"], id="L-in-a-list"),
    pytest.param("0 0 * * 1#1,5L", WINTER_2028,
                 ["2027-12-06", "2027-12-31", "2028-01-03", "2028-01-28", "2028-02-07",
                  "2028-02-25"], id="first-monday-or-last-friday"),
    pytest.param("0 0 L * 5#3", WINTER_2028,
                 ["2027-12-17", "2027-12-31", "2028-01-21", "2028-01-31", "2028-02-18",
                  "2028-02-29"], id="both-day-fields-restricted-either-matches"),
    pytest.param("0 0 L * */2", WINTER_2028,
                 ["2028-02-29", "2028-04-30", "2028-08-31", "2028-09-30"],
                 id="a-day-of-week-starting-with-star-must-match-too"),
]  # fmt: skip


@pytest.mark.parametrize(("cron", "after", "expected"), FORMS)
def test_each_day_rule_fires_on_the_hand_checked_dates(cron, after, expected):
    assert fire_dates(cron, after, len(expected)) == expected


# The rule for the two day fields, as cron has had it since Vixie: both restricted, a day
# matching either runs; either starting with "*" (even "*/2"), a day must match both.
DAY_FIELD_RULES = [
    pytest.param("0 0 13 * 5", ["2026-01-02", "2026-01-09", "2026-01-13", "2026-01-16",
                                "2026-01-23", "2026-01-30"], id="13th-or-any-friday"),
    pytest.param("0 0 1-7 * 1", ["2026-01-01", "2026-01-02", "2026-01-03", "2026-01-04",
                                 "2026-01-05", "2026-01-06", "2026-01-07", "2026-01-12"],
                 id="days-1-to-7-or-any-monday-not-the-first-monday"),
    pytest.param("0 0 1-7 * *", ["2026-01-01", "2026-01-02", "2026-01-03", "2026-01-04",
                                 "2026-01-05", "2026-01-06", "2026-01-07", "2026-02-01"],
                 id="star-day-of-week-leaves-day-of-month-alone"),
    pytest.param("0 0 * * 1", ["2026-01-05", "2026-01-12", "2026-01-19"],
                 id="star-day-of-month-leaves-day-of-week-alone"),
    pytest.param("0 0 */2 * 1", ["2026-01-05", "2026-01-19", "2026-02-09", "2026-02-23"],
                 id="star-step-day-of-month-odd-days-that-are-mondays"),
    pytest.param("0 0 1-7 * */2", ["2026-01-01", "2026-01-03", "2026-01-04", "2026-01-06",
                                   "2026-02-01"], id="star-step-day-of-week-both-must-match"),
]  # fmt: skip


@pytest.mark.parametrize(("cron", "expected"), DAY_FIELD_RULES)
def test_day_of_month_and_day_of_week_combine_as_in_vixie_cron(cron, expected):
    assert fire_dates(cron, YEAR_2026, len(expected)) == expected


@pytest.mark.parametrize(
    "cron",
    ["0 0 L * *", "0 0 LW * *", "0 0 1,L * *", "30 6 * * 5L", "0 0 * * 0L,3L", "0 0 * * 5#3",
     "0 0 * * 1#5", "0 0 * 2 2#5", "0 0 L * 5#3", "0 0 LW * 1#1", "0 0 L * */2", "0 0 * * 7#1"],
)  # fmt: skip
def test_l_lw_dl_and_hash_match_cronsim_over_years(cron):
    # cronsim (healthchecks' cron library) implements the same forms independently.
    after = at("2025-12-31T12:00:00Z")
    walker = CronSim(cron, after)
    # 60 times of "0 0 * 2 2#5" (a leap February starting on a Tuesday) span 1 700 years.
    expected = [next(walker) for _ in range(60)]

    times = next_fire_times(CronSchedule(cron, "UTC"), after, 60)

    assert [t.utc for t in times] == expected


def nearest_weekday_reference(year: int, month: int, day: int) -> int | None:
    """Quartz's nW spelled out differently: the Monday-to-Friday day of the month closest to
    `day` (None if the month has no such day number)."""
    days = monthrange(year, month)[1]
    if day > days:
        return None
    weekdays = [d for d in range(1, days + 1) if date(year, month, d).weekday() < 5]
    return min(weekdays, key=lambda d: abs(d - day))


@pytest.mark.parametrize("day", [1, 2, 14, 15, 16, 28, 29, 30, 31])
def test_nearest_weekday_matches_a_reference_over_28_years(day):
    expected = []
    for year in range(2026, 2054):
        for month in range(1, 13):
            found = nearest_weekday_reference(year, month, day)
            if found is not None:
                expected.append(date(year, month, found).isoformat())

    assert fire_dates(f"0 0 {day}W * *", YEAR_2026, len(expected)) == expected


def test_last_weekday_is_the_nearest_weekday_to_the_last_day_over_28_years():
    expected = [
        date(
            year, month, nearest_weekday_reference(year, month, monthrange(year, month)[1])
        ).isoformat()
        for year in range(2026, 2054)
        for month in range(1, 13)
    ]

    assert fire_dates("0 0 LW * *", YEAR_2026, len(expected)) == expected


@pytest.mark.parametrize(
    ("cron", "field", "says"),
    [
        ("L * * * *", "minute", "'L' is not allowed here"),
        ("0 L * * *", "hour", "'L' is not allowed here"),
        ("0 0 * L *", "month", "'L' is not allowed here"),
        ("0 0 * 1#2 *", "month", "'1#2' is not allowed here"),
        ("15W * * * *", "minute", "'15W' is not allowed here"),
        ("0 0 * * LW", "day-of-week", "belong in day-of-month"),
        ("0 0 * * 15W", "day-of-week", "belong in day-of-month"),
        ("0 0 * * L", "day-of-week", "'L' alone is ambiguous"),
        ("0 0 * * 5#6", "day-of-week", "from 1 to 5"),
        ("0 0 * * 5#0", "day-of-week", "from 1 to 5"),
        ("0 0 * * 5#", "day-of-week", "from 1 to 5"),
        ("0 0 * * #3", "day-of-week", "needs a weekday before #"),
        ("0 0 * * 8#1", "day-of-week", "8 is out of range 0-7"),
        ("0 0 * * 8L", "day-of-week", "8 is out of range 0-7"),
        ("0 0 * * XYZ#1", "day-of-week", "'XYZ' is not a number or a day name"),
        ("0 0 * * 5L-6", "day-of-week", "not part of a range, a step"),
        ("0 0 * * 5#3/2", "day-of-week", "not part of a range, a step"),
        ("0 0 32W * *", "day-of-month", "32 in '32W' is out of range 1-31"),
        ("0 0 0W * *", "day-of-month", "0 in '0W' is out of range 1-31"),
        ("0 0 W * *", "day-of-month", "needs a day number before W"),
        ("0 0 LL * *", "day-of-month", "'LL' is not allowed here"),
        ("0 0 5L * *", "day-of-month", "belongs in day-of-week"),
        ("0 0 5#3 * *", "day-of-month", "belongs in day-of-week"),
        ("0 0 L-3 * *", "day-of-month", "not part of a range, a step"),
        ("0 0 1-L * *", "day-of-month", "not part of a range, a step"),
        ("0 0 L/2 * *", "day-of-month", "not part of a range, a step"),
        ("0 0 1-15W * *", "day-of-month", "not part of a range, a step"),
        ("0 0 ? * 1", "day-of-month", "'?' is not supported"),
    ],
)
def test_a_misplaced_l_w_or_hash_is_refused_naming_the_field(cron, field, says):
    with pytest.raises(ScheduleError) as caught:
        parse_schedule({"cron": cron})

    assert list(caught.value.errors) == ["schedule.cron"]
    reason = caught.value.errors["schedule.cron"]
    assert reason.startswith(f"{field} field: ") and says in reason, reason


def test_every_bad_day_item_is_reported_at_once():
    with pytest.raises(ScheduleError) as caught:
        parse_schedule({"cron": "L 0 32W * 5#6"})

    reason = caught.value.errors["schedule.cron"]
    assert "minute field" in reason and "day-of-month field" in reason
    assert "day-of-week field" in reason


@pytest.mark.parametrize(
    ("cron", "reason"),
    [
        ("0 0 30W 2 *", "never fires: day 30 does not occur in February"),
        ("0 0 31W 4,6 *", "never fires: day 31 does not occur in April or June"),
        ("0 0 30W 2 */2", "never fires: day 30 does not occur in February"),
    ],
)
def test_a_day_rule_that_never_fires_is_refused(cron, reason):
    with pytest.raises(ScheduleError) as caught:
        parse_schedule({"cron": cron})

    assert caught.value.errors["schedule.cron"] == reason


@pytest.mark.parametrize(
    "cron", ["0 0 L 2 *", "0 0 LW 2 *", "0 0 29W 2 *", "0 0 * 2 5#5", "0 0 30W 2 5#5"]
)
def test_a_rare_day_rule_is_accepted(cron):
    assert parse_schedule({"cron": cron}).cron == cron
