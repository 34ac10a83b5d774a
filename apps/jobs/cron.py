"""Cron expressions: parse and compile the 5-field syntax, and match it to wall-clock minutes.

Pure Python, no time zones: a compiled cron matches naive local times; ``firetimes`` puts them on
a zone's clock.

Syntax rules (README, "Cron syntax"): day of week 0 and 7 are Sunday and SUN is 0, except that a
range from a later day to the name SUN ends on 7 (``MON-SUN``, ``SAT-SUN``); ranges never wrap
around (``SAT-MON`` is refused with the split to write); a step is 1 to the field's maximum; an
expression is at most ``MAX_CRON_LENGTH`` characters; a ``TZ=`` or other variable prefix is refused
(the zone belongs in ``timeZone``).
"""

from __future__ import annotations

from bisect import bisect_left
from calendar import monthrange
from dataclasses import dataclass
from datetime import date, datetime
from functools import lru_cache
from itertools import pairwise

# Every minute of the hour listed one by one (0,1,…,59 * * * *) is 177 characters; a longer
# expression is a mistake or an attack. Checked before anything else, so no number in it is ever
# long enough for int() to refuse (4 300 digits).
MAX_CRON_LENGTH = 200

MACROS = {
    "@yearly": "0 0 1 1 *",
    "@annually": "0 0 1 1 *",
    "@monthly": "0 0 1 * *",
    "@weekly": "0 0 * * 0",
    "@daily": "0 0 * * *",
    "@midnight": "0 0 * * *",
    "@hourly": "0 * * * *",
}
MONTH_NAMES = ("JAN", "FEB", "MAR", "APR", "MAY", "JUN", "JUL", "AUG", "SEP", "OCT", "NOV", "DEC")
DAY_NAMES = ("SUN", "MON", "TUE", "WED", "THU", "FRI", "SAT")
FIELD_LAYOUT = "minute hour day-of-month month day-of-week"

# Every cron matches again within one 400-year Gregorian cycle (weekdays and leap years repeat),
# so a search that finds nothing in 401 years will never find anything.
SEARCH_YEARS = 401
# The gap sample for the jitter bound starts at a fixed date so that the same definition never
# flips between valid and invalid as the calendar moves on.
GAP_SAMPLE_START = (2000, 1, 1, 0, 0)
GAP_SAMPLE_DAYS = 1000
GAP_SAMPLE_YEARS = 28
# Leap-year lengths: a day that fits no month even then never comes.
MONTH_LENGTHS = (31, 29, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31)
MONTH_TITLES = (
    "January", "February", "March", "April", "May", "June",
    "July", "August", "September", "October", "November", "December",
)  # fmt: skip


class CronSyntaxError(ValueError):
    """A cron expression failed to parse; the message says why, ready for the field's error."""


# A naive local wall-clock minute as (year, month, day, hour, minute): cheaper than a datetime.
Slot = tuple[int, int, int, int, int]


@dataclass(frozen=True)
class Cron:
    """A parsed 5-field cron expression, matched against naive local wall-clock times."""

    minutes: tuple[int, ...]
    hours: tuple[int, ...]
    days: frozenset[int]
    months: tuple[int, ...]
    weekdays: frozenset[int]  # 0 = Sunday
    # Vixie cron: if either day field starts with "*", a day must match both fields, else either.
    days_and: bool
    # The hour field is a wildcard or a step: follow the wall clock instead of "once at HH:MM".
    wall_clock: bool

    def day_matches(self, day: int, weekday: int) -> bool:
        if self.days_and:
            return day in self.days and weekday in self.weekdays
        return day in self.days or weekday in self.weekdays

    def first_at_or_after(self, y: int, mo: int, d: int, h: int, mi: int) -> Slot | None:
        """Return the first matching naive minute at or after the given fields, or None.

        Fields may overflow (minute 60, hour 24, day 32, month 13): each step carries into the
        next larger field, so callers can ask for "the minute after" by adding one.

        1. Move to the first allowed month (carrying into the next year).
        2. Move to the first matching day of that month (carrying into the next month).
        3. Move to the first allowed hour (carrying into the next day).
        4. Move to the first allowed minute (carrying into the next hour).
        Any carry resets the smaller fields and restarts from step 1.
        """
        months, hours, minutes = self.months, self.hours, self.minutes
        last_year = min(y + SEARCH_YEARS, 9999)
        while y <= last_year:
            i = bisect_left(months, mo)
            if i == len(months):
                y, mo, d, h, mi = y + 1, months[0], 1, 0, 0
                continue
            if months[i] != mo:
                mo, d, h, mi = months[i], 1, 0, 0
            first_weekday, month_days = _month_info(y, mo)
            day = d
            while day <= month_days and not self.day_matches(day, (first_weekday + day - 1) % 7):
                day += 1
            if day > month_days:
                mo, d, h, mi = mo + 1, 1, 0, 0
                continue
            if day != d:
                d, h, mi = day, 0, 0
            j = bisect_left(hours, h)
            if j == len(hours):
                d, h, mi = d + 1, 0, 0
                continue
            if hours[j] != h:
                h, mi = hours[j], 0
            k = bisect_left(minutes, mi)
            if k == len(minutes):
                h, mi = h + 1, 0
                continue
            return y, mo, d, h, minutes[k]
        return None

    def first_after(self, naive: datetime) -> datetime | None:
        """Return the first matching naive minute strictly after ``naive``."""
        slot = self.first_at_or_after(
            naive.year, naive.month, naive.day, naive.hour, naive.minute + 1
        )
        return None if slot is None else datetime(*slot)


@lru_cache(maxsize=4096)
def _month_info(year: int, month: int) -> tuple[int, int]:
    """Return (cron weekday of the 1st, number of days) for a month."""
    weekday, days = monthrange(year, month)
    return (weekday + 1) % 7, days


def _parse_value(text: str, field: str, low: int, high: int, names: tuple[str, ...]) -> int:
    if text.isascii() and text.isdigit():
        value = int(text)
        if not low <= value <= high:
            raise CronSyntaxError(f"{field} field: {value} is out of range {low}-{high}")
        return value
    # ASCII only: "ſun" and "frı" upper-case to SUN and FRI.
    if names and text.isascii() and text.upper() in names:
        return names.index(text.upper()) + (1 if names is MONTH_NAMES else 0)
    if text == "":
        raise CronSyntaxError(f"{field} field: a value is missing")
    if text in {"?", "L", "W", "LW"} or "#" in text or text.endswith(("L", "W")):
        raise CronSyntaxError(
            f"{field} field: '{text}' is not supported (only numbers, names, *, ranges, "
            "steps and lists)"
        )
    kind = "a number or a month name" if names is MONTH_NAMES else "a number"
    if names is DAY_NAMES:
        kind = "a number or a day name"
    raise CronSyntaxError(f"{field} field: '{text}' is not {kind}")


def _parse_field(text: str, field: str, low: int, high: int, names: tuple[str, ...]) -> set[int]:
    values: set[int] = set()
    for part in text.split(","):
        if part == "":
            raise CronSyntaxError(f"{field} field: empty item in list '{text}'")
        base, has_step, step_text = part.partition("/")
        step = 1
        if has_step:
            # A step beyond the field's maximum selects the start alone: a mistake, not a schedule.
            if not (step_text.isascii() and step_text.isdigit() and 1 <= int(step_text) <= high):
                raise CronSyntaxError(
                    f"{field} field: step '{step_text}' in '{part}' must be a whole number "
                    f"from 1 to {high}"
                )
            step = int(step_text)
        if base == "*":
            start, end = low, high
        elif "-" in base:
            start_text, _, end_text = base.partition("-")
            start = _parse_value(start_text, field, low, high, names)
            end = _parse_value(end_text, field, low, high, names)
            # "MON-SUN" reads naturally: after another day, the name SUN closes the week (7).
            # SUN-SUN and 0-SUN stay Sunday alone.
            if names is DAY_NAMES and start > 0 and end == 0 and end_text.upper() == "SUN":
                end = 7
            if start > end:
                raise CronSyntaxError(
                    f"{field} field: range '{base}' runs backwards; ranges do not wrap around, "
                    f"write '{_unwrapped(start, end, low, high, names is DAY_NAMES)}'"
                )
        else:
            start = _parse_value(base, field, low, high, names)
            # "5/15" means from 5 to the end of the field in steps of 15, as in cronie.
            end = high if has_step else start
        values.update(range(start, end + 1, step))
    return values


def _unwrapped(start: int, end: int, low: int, high: int, weekdays: bool) -> str:
    """Return a backwards range as the list of ranges it was meant to be (22-2 is 22-23,0-2)."""
    head = f"{start}-{high}" if start < high else str(high)
    tail = f"{low}-{end}" if end > low else str(low)
    if weekdays and end == 0:
        return head  # Sunday is 7 too, which ends the head already
    if weekdays and start == 7:
        return tail  # and 0, which starts the tail
    return f"{head},{tail}"


def _assignment_reason(token: str) -> str:
    """Explain why a crontab variable (``TZ=…``, ``SHELL=…``) before the fields is refused."""
    name, _, value = token.partition("=")
    if name.upper() in {"TZ", "CRON_TZ"}:
        zone = f"'{value}'" if value else "its name"
        return (
            f"starts with '{token}': a time zone is not part of the cron expression; remove it "
            f"and set the schedule's timeZone field to {zone}"
        )
    return (
        f"starts with '{token}': crontab variable assignments are not part of a schedule; "
        f"give 5 fields ({FIELD_LAYOUT}) or a macro"
    )


@lru_cache(maxsize=65536)
def compile_cron(expression: str) -> Cron:
    """Parse a cron expression once; raise CronSyntaxError with the reason."""
    if len(expression) > MAX_CRON_LENGTH:
        raise CronSyntaxError(
            f"is {len(expression)} characters long; a cron expression has at most "
            f"{MAX_CRON_LENGTH} characters"
        )
    text = expression.strip()
    first = text.split(maxsplit=1)[0] if text else ""
    # No cron field or macro contains "=".
    if "=" in first:
        raise CronSyntaxError(_assignment_reason(first))
    if text.startswith("@"):
        macro = text.lower()
        if macro == "@reboot":
            raise CronSyntaxError(
                "@reboot is not supported: the scheduler has no boot to hook; "
                "use a delayed or one-off schedule"
            )
        if macro not in MACROS:
            raise CronSyntaxError(
                f"unknown macro '{text}'; use one of {', '.join(MACROS)} or 5 fields "
                f"({FIELD_LAYOUT})"
            )
        text = MACROS[macro]
    parts = text.split()
    if len(parts) in (6, 7):
        raise CronSyntaxError(
            f"has {len(parts)} fields; seconds and year fields are not supported, "
            f"use 5 fields ({FIELD_LAYOUT})"
        )
    if len(parts) != 5:
        raise CronSyntaxError(f"has {len(parts)} fields; expected 5 ({FIELD_LAYOUT})")
    minute, hour, dom, month, dow = parts
    problems: list[str] = []
    parsed: list[set[int]] = []
    for part, spec in zip(
        parts,
        (
            ("minute", 0, 59, ()),
            ("hour", 0, 23, ()),
            ("day-of-month", 1, 31, ()),
            ("month", 1, 12, MONTH_NAMES),
            ("day-of-week", 0, 7, DAY_NAMES),
        ),
        strict=True,
    ):
        try:
            parsed.append(_parse_field(part, *spec))
        except CronSyntaxError as exc:
            problems.append(str(exc))
            parsed.append(set())
    if problems:
        raise CronSyntaxError("; ".join(problems))
    minutes, hours, days, months, weekdays = parsed
    return Cron(
        minutes=tuple(sorted(minutes)),
        hours=tuple(sorted(hours)),
        days=frozenset(days),
        months=tuple(sorted(months)),
        weekdays=frozenset(w % 7 for w in weekdays),
        days_and=dom.startswith("*") or dow.startswith("*"),
        wall_clock="*" in hour or "/" in hour,
    )


@lru_cache(maxsize=4096)
def never_fires_reason(cron: Cron) -> str | None:
    """Return why the cron never fires, or None if it fires at least once."""
    if cron.first_at_or_after(*GAP_SAMPLE_START) is not None:
        return None
    longest = max(MONTH_LENGTHS[m - 1] for m in cron.months)
    if min(cron.days) > longest and cron.days_and:
        month_list = " or ".join(MONTH_TITLES[m - 1] for m in cron.months)
        return f"never fires: day {min(cron.days)} does not occur in {month_list}"
    return "never fires: no date matches both its day-of-month and day-of-week fields"


@lru_cache(maxsize=4096)
def shortest_gap(cron: Cron) -> int:
    """Return the shortest gap in seconds between consecutive nominal fire times.

    Every firing day has the same hours and minutes, so the gap is the smaller of:
    1. the shortest gap between two times of one day;
    2. the overnight gap from the last time of a day to the first time of the next firing day,
       with the closest pair of firing days taken from a sample of upcoming days.
    """
    times = sorted(h * 60 + m for h in cron.hours for m in cron.minutes)
    shortest = min((b - a for a, b in pairwise(times)), default=None)
    day = cron.first_at_or_after(*GAP_SAMPLE_START)
    assert day is not None  # validated by never_fires_reason first
    closest_days: int | None = None
    last_year = day[0] + GAP_SAMPLE_YEARS
    for _ in range(GAP_SAMPLE_DAYS):
        following = cron.first_at_or_after(day[0], day[1], day[2] + 1, 0, 0)
        if following is None or following[0] > last_year:
            break
        apart = _ordinal(following) - _ordinal(day)
        closest_days = apart if closest_days is None else min(closest_days, apart)
        if closest_days == 1:
            break
        day = following
    if closest_days is not None:
        overnight = closest_days * 1440 - (times[-1] - times[0])
        shortest = overnight if shortest is None else min(shortest, overnight)
    # A cron that fired once in the whole sample has no neighbour a jitter could overtake.
    return shortest * 60 if shortest is not None else 2**62


def _ordinal(slot: Slot) -> int:
    return date(slot[0], slot[1], slot[2]).toordinal()
