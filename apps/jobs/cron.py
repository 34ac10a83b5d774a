"""Cron expressions: parse and compile the 5-field syntax, and match it to wall-clock minutes.

Pure Python, no time zones: a compiled cron matches naive local times; ``firetimes`` puts them on
a zone's clock.

Syntax rules (README, "Cron syntax"): day of week 0 and 7 are Sunday and SUN is 0, except that a
range from a later day to the name SUN ends on 7 (``MON-SUN``, ``SAT-SUN``); ranges never wrap
around (``SAT-MON`` is refused with the split to write); a step is 1 to the field's maximum; an
expression is at most ``MAX_CRON_LENGTH`` characters; a ``TZ=`` or other variable prefix is refused
(the zone belongs in ``timeZone``).

Day fields follow Vixie cron for how they combine: when both are restricted a day matching
either runs; a field starting with ``*`` is unrestricted, so the other one alone decides. The
extensions follow Quartz's meaning (Vixie cron has none of them):

- day of month: ``L`` the last day, ``LW`` the last weekday (Monday to Friday), ``nW`` the
  weekday nearest day n without leaving the month (1W on a Saturday is Monday the 3rd, 31W on a
  Sunday is Friday the 29th); a month without day n has no ``nW``, as it has no plain ``n``;
- day of week: ``dL`` the last weekday d of the month (``5L``, ``FRIL``: the last Friday), and
  ``d#n`` its n-th one, n from 1 to 5 (``5#3``, ``FRI#3``); a month without a 5th is skipped.

Unlike Quartz, day of week keeps cron's numbering (0 and 7 are Sunday, so ``0#2`` is the second
Sunday), ``?`` is refused, and these items may share a list with plain ones (``1,15,L``), since
each item reads the same alone. They take no range or step (Quartz's ``L-3`` is refused).
"""

from __future__ import annotations

from bisect import bisect_left
from calendar import monthrange
from collections.abc import Callable
from dataclasses import dataclass
from datetime import date, datetime
from functools import lru_cache
from itertools import pairwise
from typing import Any

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
DAY_OF_MONTH = "day-of-month"
DAY_OF_WEEK = "day-of-week"
DAY_FIELDS = (DAY_OF_MONTH, DAY_OF_WEEK)
DAY_RULES = "L and W belong in day-of-month (L, LW, 15W) and L and # in day-of-week (5L, 5#3)"
# d#n: a month has at most 5 of any weekday.
MAX_NTH = 5

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
    # Day of month: L, LW, and the n of each nW.
    last_day: bool = False
    last_weekday: bool = False
    nearest_weekday_to: frozenset[int] = frozenset()
    # Day of week: the d of each dL, and (d, n) for each d#n (d: 0 = Sunday).
    last_of_weekday: frozenset[int] = frozenset()
    nth_weekday: frozenset[tuple[int, int]] = frozenset()
    # Any of the five above: a day's match depends on its month's shape, not only its numbers.
    # A field set at construction, not a cached property: one written later would unshare the
    # instance's attribute dict and slow every lookup of the search loop (measured: 25 %).
    has_month_rules: bool = False

    def month_picks(
        self, first_weekday: int, month_days: int
    ) -> tuple[frozenset[int], frozenset[int]]:
        """Return the days of a month that the L/W rules of day of month pick, and those that
        the L/# rules of day of week pick; ``first_weekday`` is the 1st's (0 = Sunday)."""
        by_day: set[int] = set()
        if self.last_day:
            by_day.add(month_days)
        if self.last_weekday:
            by_day.add(_nearest_weekday(month_days, first_weekday, month_days))
        for day in self.nearest_weekday_to:
            if day <= month_days:
                by_day.add(_nearest_weekday(day, first_weekday, month_days))
        by_weekday: set[int] = set()
        last_weekday = (first_weekday + month_days - 1) % 7
        for weekday in self.last_of_weekday:
            by_weekday.add(month_days - (last_weekday - weekday) % 7)
        for weekday, nth in self.nth_weekday:
            day = 1 + (weekday - first_weekday) % 7 + 7 * (nth - 1)
            if day <= month_days:
                by_weekday.add(day)
        return frozenset(by_day), frozenset(by_weekday)

    def day_matches(self, day: int, weekday: int) -> bool:
        if self.days_and:
            return day in self.days and weekday in self.weekdays
        return day in self.days or weekday in self.weekdays

    def _first_day_by_rules(self, day: int, first_weekday: int, month_days: int) -> int:
        """Return the first matching day from ``day`` on in a month with L, W or # rules
        (``month_days + 1`` if none)."""
        by_day, by_weekday = self.month_picks(first_weekday, month_days)
        while day <= month_days:
            in_days = day in self.days or day in by_day
            in_weekdays = (first_weekday + day - 1) % 7 in self.weekdays or day in by_weekday
            if (in_days and in_weekdays) if self.days_and else (in_days or in_weekdays):
                return day
            day += 1
        return day

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
            if self.has_month_rules:
                day = self._first_day_by_rules(day, first_weekday, month_days)
            else:
                while day <= month_days and not self.day_matches(
                    day, (first_weekday + day - 1) % 7
                ):
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


def _nearest_weekday(day: int, first_weekday: int, month_days: int) -> int:
    """Return the Monday-to-Friday day nearest ``day`` in its month (Quartz's ``nW``).

    Saturday moves back to Friday and Sunday on to Monday, unless that leaves the month: a
    Saturday 1st moves on to Monday the 3rd, a Sunday last day back to Friday.
    """
    weekday = (first_weekday + day - 1) % 7
    if weekday == 6:
        return day - 1 if day > 1 else day + 2
    if weekday == 0:
        return day + 1 if day < month_days else day - 2
    return day


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
    if text == "?":
        raise CronSyntaxError(
            f"{field} field: '?' is not supported; write * (a field starting with * leaves "
            "the other day field alone to decide)"
        )
    marked = text.isascii() and ("#" in text or text.upper().endswith(("L", "W")))
    if marked and field not in DAY_FIELDS:
        raise CronSyntaxError(f"{field} field: '{text}' is not allowed here; {DAY_RULES}")
    kind = "a number or a month name" if names is MONTH_NAMES else "a number"
    if names is DAY_NAMES:
        kind = "a number or a day name"
    if marked:
        # Single items (L, 15W, 5L, 5#3) are parsed before this: one here is inside a range,
        # a step, or another L/W/# item.
        raise CronSyntaxError(
            f"{field} field: '{text}' is not {kind}; L, W and # mark a whole item "
            "(L, LW, 15W, 5L, 5#3), not part of a range, a step or another item"
        )
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


def _items(text: str, field: str) -> list[str]:
    items = text.split(",")
    if "" in items:
        raise CronSyntaxError(f"{field} field: empty item in list '{text}'")
    return items


def _is_marked(item: str) -> bool:
    """Whether a list item is one L, W or # rule (no range or step, which such items refuse)."""
    if not item.isascii() or "-" in item or "/" in item:
        return False
    return "#" in item or item.upper().endswith(("L", "W"))


@dataclass
class _DayOfMonth:
    days: set[int]
    last_day: bool
    last_weekday: bool
    nearest_weekday_to: set[int]


def _parse_day_of_month(text: str) -> _DayOfMonth:
    """Parse day of month: numbers, *, ranges, steps, and the items L, LW and nW."""
    name = DAY_OF_MONTH
    parsed = _DayOfMonth(set(), False, False, set())
    for item in _items(text, name):
        upper = item.upper()
        if not _is_marked(item):
            parsed.days |= _parse_field(item, name, 1, 31, ())
        elif upper == "L":
            parsed.last_day = True
        elif upper == "LW":
            parsed.last_weekday = True
        elif "#" in item:
            raise CronSyntaxError(
                f"{name} field: '{item}' is not allowed here; d#n (the n-th weekday d of the "
                "month, e.g. 5#3) belongs in day-of-week"
            )
        elif upper.endswith("L"):
            raise CronSyntaxError(
                f"{name} field: '{item}' is not allowed here; L is the last day of the month "
                "alone, and dL (the last weekday d, e.g. 5L) belongs in day-of-week"
            )
        else:
            number = upper[:-1]
            if not (number.isascii() and number.isdigit()):
                raise CronSyntaxError(
                    f"{name} field: '{item}' needs a day number before W, e.g. 15W "
                    "(the weekday nearest the 15th)"
                )
            day = int(number)
            if not 1 <= day <= 31:
                raise CronSyntaxError(f"{name} field: {day} in '{item}' is out of range 1-31")
            parsed.nearest_weekday_to.add(day)
    return parsed


@dataclass
class _DayOfWeek:
    weekdays: set[int]
    last_of_weekday: set[int]
    nth_weekday: set[tuple[int, int]]


def _parse_day_of_week(text: str) -> _DayOfWeek:
    """Parse day of week: numbers, names, *, ranges, steps, and the items dL and d#n."""
    name = DAY_OF_WEEK
    parsed = _DayOfWeek(set(), set(), set())
    for item in _items(text, name):
        upper = item.upper()
        if not _is_marked(item):
            parsed.weekdays |= _parse_field(item, name, 0, 7, DAY_NAMES)
        elif "#" in item:
            day_text, _, nth_text = item.partition("#")
            if day_text == "":
                raise CronSyntaxError(
                    f"{name} field: '{item}' needs a weekday before #, e.g. 5#3 "
                    "(the third Friday of the month)"
                )
            weekday = _parse_value(day_text, name, 0, 7, DAY_NAMES) % 7
            if not (nth_text.isascii() and nth_text.isdigit() and 1 <= int(nth_text) <= MAX_NTH):
                raise CronSyntaxError(
                    f"{name} field: '{item}' asks for occurrence '{nth_text}'; the n of d#n is "
                    f"a whole number from 1 to {MAX_NTH} (no month has more of a weekday)"
                )
            parsed.nth_weekday.add((weekday, int(nth_text)))
        elif upper.endswith("W"):
            raise CronSyntaxError(
                f"{name} field: '{item}' is not allowed here; LW (the last weekday of the month) "
                "and nW (the weekday nearest day n) belong in day-of-month"
            )
        elif upper == "L":
            raise CronSyntaxError(
                f"{name} field: 'L' alone is ambiguous (Quartz reads it as Saturday); write 6 "
                "for Saturday, dL for the last weekday d of the month (5L: the last Friday), "
                "or L in day-of-month for the last day"
            )
        else:
            parsed.last_of_weekday.add(_parse_value(item[:-1], name, 0, 7, DAY_NAMES) % 7)
    return parsed


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

    def attempt(parse: Callable[..., Any], *args: Any) -> Any:
        # Each field is parsed even after one fails, so every bad field is named at once.
        try:
            return parse(*args)
        except CronSyntaxError as exc:
            problems.append(str(exc))
            return None

    minutes = attempt(_parse_field, minute, "minute", 0, 59, ())
    hours = attempt(_parse_field, hour, "hour", 0, 23, ())
    days = attempt(_parse_day_of_month, dom)
    months = attempt(_parse_field, month, "month", 1, 12, MONTH_NAMES)
    weekdays = attempt(_parse_day_of_week, dow)
    if problems:
        raise CronSyntaxError("; ".join(problems))
    return Cron(
        minutes=tuple(sorted(minutes)),
        hours=tuple(sorted(hours)),
        days=frozenset(days.days),
        months=tuple(sorted(months)),
        weekdays=frozenset(w % 7 for w in weekdays.weekdays),
        days_and=dom.startswith("*") or dow.startswith("*"),
        wall_clock="*" in hour or "/" in hour,
        last_day=days.last_day,
        last_weekday=days.last_weekday,
        nearest_weekday_to=frozenset(days.nearest_weekday_to),
        last_of_weekday=frozenset(weekdays.last_of_weekday),
        nth_weekday=frozenset(weekdays.nth_weekday),
        has_month_rules=bool(
            days.last_day
            or days.last_weekday
            or days.nearest_weekday_to
            or weekdays.last_of_weekday
            or weekdays.nth_weekday
        ),
    )


@lru_cache(maxsize=4096)
def never_fires_reason(cron: Cron) -> str | None:
    """Return why the cron never fires, or None if it fires at least once."""
    if cron.first_at_or_after(*GAP_SAMPLE_START) is not None:
        return None
    longest = max(MONTH_LENGTHS[m - 1] for m in cron.months)
    # Only numbered days can be missing from a month: L and LW fall in every one.
    numbered = cron.days | cron.nearest_weekday_to
    if cron.days_and and numbered and not (cron.last_day or cron.last_weekday):
        if min(numbered) > longest:
            month_list = " or ".join(MONTH_TITLES[m - 1] for m in cron.months)
            return f"never fires: day {min(numbered)} does not occur in {month_list}"
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
