"""Schedule maths: parse, validate and render schedules, and compute cron fire times.

Pure Python on purpose (no ORM, no settings): the API, the dashboard and the scheduler all call
these functions, and the tests hit them without a database.

Daylight-saving rules (DESIGN.md, "Schedules"); this module is the only place that applies them:

- Cron fields are matched against the wall clock of the schedule's time zone.
- A cron whose hour field names hours (``30 2 * * *``, ``0 1,13 * * *``) means "once at this
  local time": a local time skipped by spring-forward runs at the next valid local time, and a
  local time repeated by fall-back runs once, at its first occurrence.
- A cron whose hour field is a wildcard or a step (``0 * * * *``, ``*/15 * * * *``) follows the
  wall clock: a skipped slot does not run and a repeated slot runs in both passes.

Syntax rules (README, "Cron syntax"): day of week 0 and 7 are Sunday and SUN is 0, except that a
range from a later day to the name SUN ends on 7 (``MON-SUN``, ``SAT-SUN``); ranges never wrap
around (``SAT-MON`` is refused with the split to write); a step is 1 to the field's maximum; an
expression is at most ``MAX_CRON_LENGTH`` characters; a ``TZ=`` or other variable prefix is refused
(the zone belongs in ``timeZone``).
"""

from __future__ import annotations

import hashlib
from bisect import bisect_left
from calendar import monthrange
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta
from functools import lru_cache
from itertools import pairwise
from zoneinfo import ZoneInfo

DEFAULT_TIME_ZONE = "UTC"
DEFAULT_JITTER_SECONDS = 60
DEFAULT_MISSED_RUN_POLICY = "run_once"
MISSED_RUN_POLICIES = ("run_once", "run_all", "skip")
DEFAULT_SHARD_COUNT = 16
# A delay this long is certainly a unit mistake, and it keeps every due time inside datetime's range.
MAX_DELAY_SECONDS = 10 * 366 * 24 * 3600
# Every minute of the hour listed one by one (0,1,…,59 * * * *) is 177 characters; a longer
# expression is a mistake or an attack. Checked before anything else, so no number in it is ever
# long enough for int() to refuse (4 300 digits).
MAX_CRON_LENGTH = 200

CRON_KEYS = frozenset({"cron", "timeZone", "jitterSeconds", "missedRunPolicy"})
ONE_OFF_KEYS = frozenset({"runAt"})
DELAYED_KEYS = frozenset({"delaySeconds"})

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
# A wall-clock run reports the slots a spring-forward gap dropped only if the gap is this recent,
# which covers the next slot after any gap for every cron whose hour field steps.
DROP_LOOKBACK = timedelta(hours=48)
ONE_SECOND = timedelta(seconds=1)
ONE_MINUTE = timedelta(minutes=1)


class ScheduleError(ValueError):
    """A schedule failed validation; ``errors`` maps each bad field's path to the reason."""

    def __init__(self, errors: dict[str, str]):
        self.errors = dict(errors)
        super().__init__("; ".join(f"{path}: {reason}" for path, reason in self.errors.items()))


@dataclass(frozen=True)
class CronSchedule:
    """Run at each time a 5-field cron expression matches, on the wall clock of ``time_zone``."""

    cron: str
    time_zone: str = DEFAULT_TIME_ZONE
    jitter_seconds: int = DEFAULT_JITTER_SECONDS
    missed_run_policy: str = DEFAULT_MISSED_RUN_POLICY


@dataclass(frozen=True)
class OneOffSchedule:
    """Run once at ``run_at`` (aware, UTC)."""

    run_at: datetime


@dataclass(frozen=True)
class DelayedSchedule:
    """Run once, ``delay_seconds`` after the definition is created."""

    delay_seconds: int


@dataclass(frozen=True)
class NoSchedule:
    """Run only when triggered through the API or the dashboard."""


Schedule = CronSchedule | OneOffSchedule | DelayedSchedule | NoSchedule


@dataclass(frozen=True)
class FireTime:
    """A cron fire time: nominal local time, the same instant in UTC, and a DST note or ""."""

    local: datetime
    utc: datetime
    note: str


# --- cron expressions -----------------------------------------------------------------------


class _CronSyntaxError(ValueError):
    pass


# A naive local wall-clock minute as (year, month, day, hour, minute): cheaper than a datetime.
Slot = tuple[int, int, int, int, int]


@dataclass(frozen=True)
class _Cron:
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
            raise _CronSyntaxError(f"{field} field: {value} is out of range {low}-{high}")
        return value
    # ASCII only: "ſun" and "frı" upper-case to SUN and FRI.
    if names and text.isascii() and text.upper() in names:
        return names.index(text.upper()) + (1 if names is MONTH_NAMES else 0)
    if text == "":
        raise _CronSyntaxError(f"{field} field: a value is missing")
    if text in {"?", "L", "W", "LW"} or "#" in text or text.endswith(("L", "W")):
        raise _CronSyntaxError(
            f"{field} field: '{text}' is not supported (only numbers, names, *, ranges, "
            "steps and lists)"
        )
    kind = "a number or a month name" if names is MONTH_NAMES else "a number"
    if names is DAY_NAMES:
        kind = "a number or a day name"
    raise _CronSyntaxError(f"{field} field: '{text}' is not {kind}")


def _parse_field(text: str, field: str, low: int, high: int, names: tuple[str, ...]) -> set[int]:
    values: set[int] = set()
    for part in text.split(","):
        if part == "":
            raise _CronSyntaxError(f"{field} field: empty item in list '{text}'")
        base, has_step, step_text = part.partition("/")
        step = 1
        if has_step:
            # A step beyond the field's maximum selects the start alone: a mistake, not a schedule.
            if not (step_text.isascii() and step_text.isdigit() and 1 <= int(step_text) <= high):
                raise _CronSyntaxError(
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
                raise _CronSyntaxError(
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
def _compile_cron(expression: str) -> _Cron:
    """Parse a cron expression once; raise _CronSyntaxError with the reason."""
    if len(expression) > MAX_CRON_LENGTH:
        raise _CronSyntaxError(
            f"is {len(expression)} characters long; a cron expression has at most "
            f"{MAX_CRON_LENGTH} characters"
        )
    text = expression.strip()
    first = text.split(maxsplit=1)[0] if text else ""
    # No cron field or macro contains "=".
    if "=" in first:
        raise _CronSyntaxError(_assignment_reason(first))
    if text.startswith("@"):
        macro = text.lower()
        if macro == "@reboot":
            raise _CronSyntaxError(
                "@reboot is not supported: the scheduler has no boot to hook; "
                "use a delayed or one-off schedule"
            )
        if macro not in MACROS:
            raise _CronSyntaxError(
                f"unknown macro '{text}'; use one of {', '.join(MACROS)} or 5 fields "
                f"({FIELD_LAYOUT})"
            )
        text = MACROS[macro]
    parts = text.split()
    if len(parts) in (6, 7):
        raise _CronSyntaxError(
            f"has {len(parts)} fields; seconds and year fields are not supported, "
            f"use 5 fields ({FIELD_LAYOUT})"
        )
    if len(parts) != 5:
        raise _CronSyntaxError(f"has {len(parts)} fields; expected 5 ({FIELD_LAYOUT})")
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
        except _CronSyntaxError as exc:
            problems.append(str(exc))
            parsed.append(set())
    if problems:
        raise _CronSyntaxError("; ".join(problems))
    minutes, hours, days, months, weekdays = parsed
    return _Cron(
        minutes=tuple(sorted(minutes)),
        hours=tuple(sorted(hours)),
        days=frozenset(days),
        months=tuple(sorted(months)),
        weekdays=frozenset(w % 7 for w in weekdays),
        days_and=dom.startswith("*") or dow.startswith("*"),
        wall_clock="*" in hour or "/" in hour,
    )


@lru_cache(maxsize=4096)
def _never_fires_reason(cron: _Cron) -> str | None:
    """Return why the cron never fires, or None if it fires at least once."""
    if cron.first_at_or_after(*GAP_SAMPLE_START) is not None:
        return None
    longest = max(MONTH_LENGTHS[m - 1] for m in cron.months)
    if min(cron.days) > longest and cron.days_and:
        month_list = " or ".join(MONTH_TITLES[m - 1] for m in cron.months)
        return f"never fires: day {min(cron.days)} does not occur in {month_list}"
    return "never fires: no date matches both its day-of-month and day-of-week fields"


@lru_cache(maxsize=4096)
def _shortest_gap(cron: _Cron) -> int:
    """Return the shortest gap in seconds between consecutive nominal fire times.

    Every firing day has the same hours and minutes, so the gap is the smaller of:
    1. the shortest gap between two times of one day;
    2. the overnight gap from the last time of a day to the first time of the next firing day,
       with the closest pair of firing days taken from a sample of upcoming days.
    """
    times = sorted(h * 60 + m for h in cron.hours for m in cron.minutes)
    shortest = min((b - a for a, b in pairwise(times)), default=None)
    day = cron.first_at_or_after(*GAP_SAMPLE_START)
    assert day is not None  # validated by _never_fires_reason first
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


# --- time zones -----------------------------------------------------------------------------


@lru_cache(maxsize=1024)
def _zone(name: str) -> ZoneInfo:
    """Return the IANA zone, or raise ValueError naming it."""
    # These files sit in the zoneinfo tree but are host settings or helpers, not IANA zones.
    if not name or name in {"localtime", "posixrules", "Factory"} or name.startswith(("/", ".")):
        raise ValueError(f"unknown time zone '{name}'")
    try:
        return ZoneInfo(name)
    # ZoneInfoNotFoundError is a KeyError; malformed keys and odd files raise the others.
    except (KeyError, ValueError, OSError) as exc:
        raise ValueError(f"unknown time zone '{name}'") from exc


def _offset_at(instant: datetime, zone: ZoneInfo) -> timedelta:
    offset = instant.astimezone(zone).utcoffset()
    assert offset is not None
    return offset


def _transition(zone: ZoneInfo, before: datetime, after: datetime) -> datetime:
    """Return the first UTC instant in (before, after] that has ``after``'s offset.

    Binary search to the second; callers bracket exactly one transition.
    """
    target = _offset_at(after, zone)
    while after - before > ONE_SECOND:
        middle = before + (after - before) // 2
        middle = middle.replace(microsecond=0)
        if middle <= before:
            middle = before + ONE_SECOND
        if _offset_at(middle, zone) == target:
            after = middle
        else:
            before = middle
    return after


@lru_cache(maxsize=65536)
def _plain_day(zone: ZoneInfo, year: int, month: int, day: int) -> tuple[timedelta | None, bool]:
    """Return (the day's only UTC offset or None, whether the offset changed shortly before).

    The offset is None when a transition may touch the local day; such days take the careful
    path. The flag also covers the 48 hours before the day, where a spring-forward gap could have
    dropped slots that a wall-clock run on this day reports.

    Offsets are sampled every 3 hours over a window wide enough for any zone's offset (-12 h to
    +14 h); real transitions are weeks apart, so none can hide between two samples.
    """
    midnight = datetime(year, month, day, tzinfo=UTC)
    # Local midnight at +14 h is 14 h before UTC midnight; 23:59 at -12 h is 36 h after it.
    day_hours = range(-16, 40, 3)
    lookback_hours = range(-16 - 48, -16, 3)
    day_offsets = {_offset_at(midnight + timedelta(hours=h), zone) for h in day_hours}
    earlier_offsets = {_offset_at(midnight + timedelta(hours=h), zone) for h in lookback_hours}
    plain = next(iter(day_offsets)) if len(day_offsets) == 1 else None
    return plain, len(day_offsets | earlier_offsets) > 1


@lru_cache(maxsize=65536)
def _compile(expression: str, time_zone: str) -> tuple[_Cron, ZoneInfo]:
    return _compile_cron(expression), _zone(time_zone)


# --- validation and JSON --------------------------------------------------------------------


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def parse_schedule(raw: object) -> Schedule:
    """Validate the JSON form of a schedule and return it with defaults filled in.

    Raise ScheduleError naming every bad field.
    """
    if not isinstance(raw, dict):
        raise ScheduleError({"schedule": "must be an object (use {} for no schedule)"})
    keys = set(raw)
    unknown = sorted(str(k) for k in keys - CRON_KEYS - ONE_OFF_KEYS - DELAYED_KEYS)
    if unknown:
        listed = ", ".join(f"'{k}'" for k in unknown)
        raise ScheduleError(
            {
                "schedule": f"unknown field{'s' if len(unknown) > 1 else ''} {listed}; "
                "expected cron (with timeZone, jitterSeconds, missedRunPolicy), runAt, "
                "or delaySeconds"
            }
        )
    kinds = [
        name
        for name, group in (
            ("cron", CRON_KEYS),
            ("runAt", ONE_OFF_KEYS),
            ("delaySeconds", DELAYED_KEYS),
        )
        if keys & group
    ]
    if len(kinds) > 1:
        raise ScheduleError(
            {
                "schedule": f"mixes schedule kinds ({', '.join(sorted(keys))}); give exactly one of "
                "cron, runAt or delaySeconds, or {} for no schedule"
            }
        )
    if not kinds:
        return NoSchedule()
    if kinds[0] == "runAt":
        return _parse_one_off(raw["runAt"])
    if kinds[0] == "delaySeconds":
        return _parse_delayed(raw["delaySeconds"])
    return _parse_cron(raw)


def _parse_one_off(value: object) -> OneOffSchedule:
    reason = "must be an ISO-8601 time with a UTC offset, e.g. 2026-12-01T10:00:00Z"
    if not isinstance(value, str):
        raise ScheduleError({"schedule.runAt": reason})
    try:
        run_at = datetime.fromisoformat(value.strip())
    except ValueError:
        raise ScheduleError({"schedule.runAt": f"'{value}' {reason}"}) from None
    if run_at.utcoffset() is None:
        raise ScheduleError(
            {"schedule.runAt": f"'{value}' has no UTC offset; add one, e.g. Z or +01:00"}
        )
    try:
        return OneOffSchedule(run_at=run_at.astimezone(UTC))
    except OverflowError:
        raise ScheduleError({"schedule.runAt": f"'{value}' is out of range in UTC"}) from None


def _parse_delayed(value: object) -> DelayedSchedule:
    if not _is_int(value):
        raise ScheduleError({"schedule.delaySeconds": "must be a whole number of seconds"})
    assert isinstance(value, int)
    if value < 0:
        raise ScheduleError({"schedule.delaySeconds": "must not be negative"})
    if value > MAX_DELAY_SECONDS:
        raise ScheduleError(
            {"schedule.delaySeconds": f"must be at most {MAX_DELAY_SECONDS} (10 years)"}
        )
    return DelayedSchedule(delay_seconds=value)


def _parse_cron(raw: dict) -> CronSchedule:
    errors: dict[str, str] = {}
    compiled: _Cron | None = None

    expression = raw.get("cron")
    if "cron" not in raw:
        errors["schedule.cron"] = "is required with timeZone, jitterSeconds or missedRunPolicy"
    elif not isinstance(expression, str) or not expression.strip():
        errors["schedule.cron"] = f"must be a cron expression: 5 fields ({FIELD_LAYOUT}) or a macro"
    else:
        expression = " ".join(expression.split())
        try:
            compiled = _compile_cron(expression)
        except _CronSyntaxError as exc:
            errors["schedule.cron"] = str(exc)
        else:
            never = _never_fires_reason(compiled)
            if never:
                errors["schedule.cron"] = never
                compiled = None

    time_zone = raw.get("timeZone", DEFAULT_TIME_ZONE)
    if not isinstance(time_zone, str):
        errors["schedule.timeZone"] = "must be an IANA time zone name, e.g. Europe/Berlin"
    else:
        try:
            _zone(time_zone)
        except ValueError as exc:
            errors["schedule.timeZone"] = str(exc)

    jitter = raw.get("jitterSeconds", DEFAULT_JITTER_SECONDS)
    if not _is_int(jitter):
        errors["schedule.jitterSeconds"] = "must be a whole number of seconds (0 turns jitter off)"
    elif jitter < 0:
        errors["schedule.jitterSeconds"] = "must not be negative"
    # Fire times are at least a minute apart, so a jitter of 60 or less always fits.
    elif compiled is not None and jitter > 60:
        gap = _shortest_gap(compiled)
        if jitter > gap:
            errors["schedule.jitterSeconds"] = (
                f"{jitter} is longer than the shortest gap between this cron's fire times "
                f"({gap} seconds); runs would start out of order"
            )

    policy = raw.get("missedRunPolicy", DEFAULT_MISSED_RUN_POLICY)
    if policy not in MISSED_RUN_POLICIES or not isinstance(policy, str):
        errors["schedule.missedRunPolicy"] = f"must be one of {', '.join(MISSED_RUN_POLICIES)}"

    if errors:
        raise ScheduleError(errors)
    assert isinstance(expression, str) and isinstance(time_zone, str) and isinstance(jitter, int)
    return CronSchedule(
        cron=expression, time_zone=time_zone, jitter_seconds=jitter, missed_run_policy=policy
    )


def _format_instant(dt: datetime) -> str:
    utc = dt.astimezone(UTC)
    return utc.isoformat(timespec="microseconds" if utc.microsecond else "seconds")[:-6] + "Z"


def schedule_to_json(schedule: Schedule) -> dict:
    """Return the canonical JSON form of a schedule, defaults included."""
    if isinstance(schedule, CronSchedule):
        return {
            "cron": schedule.cron,
            "timeZone": schedule.time_zone,
            "jitterSeconds": schedule.jitter_seconds,
            "missedRunPolicy": schedule.missed_run_policy,
        }
    if isinstance(schedule, OneOffSchedule):
        return {"runAt": _format_instant(schedule.run_at)}
    if isinstance(schedule, DelayedSchedule):
        return {"delaySeconds": schedule.delay_seconds}
    if isinstance(schedule, NoSchedule):
        return {}
    raise TypeError(f"not a schedule: {schedule!r}")


# --- jitter, shards, keys -------------------------------------------------------------------


def jitter_offset(name: str, jitter_seconds: int) -> int:
    """Return the job's stable start offset in seconds, in [0, jitter_seconds)."""
    if jitter_seconds <= 0:
        return 0
    digest = hashlib.sha256(name.encode()).digest()
    return int.from_bytes(digest[8:16], "big") % jitter_seconds


def shard_for(name: str, shard_count: int = DEFAULT_SHARD_COUNT) -> int:
    """Return the shard that owns the job, in [0, shard_count)."""
    if shard_count <= 0:
        raise ValueError("shard_count must be positive")
    digest = hashlib.sha256(name.encode()).digest()
    return int.from_bytes(digest[0:8], "big") % shard_count


def idempotency_key(name: str, local: datetime | str) -> str:
    """Return the run key for a cron fire time: the job name and the local time with offset.

    `local` may come already in ISO form (the materialiser formats a shared fire time once)."""
    return f"{name}@{local if isinstance(local, str) else local.isoformat()}"


def format_utc(dt: datetime) -> str:
    """Return an aware time as UTC ISO-8601 to the second, with a Z."""
    if dt.utcoffset() is None:
        raise ValueError("format_utc needs an aware datetime")
    return dt.astimezone(UTC).isoformat(timespec="seconds")[:-6] + "Z"


# --- fire times -----------------------------------------------------------------------------


def _hhmm(naive: datetime) -> str:
    return naive.strftime("%H:%M")


def _skipped_note(slots: list[datetime]) -> str:
    if len(slots) == 1:
        return f"{_hhmm(slots[0])} does not exist on this day (DST); that run is skipped"
    if len(slots) <= 4:
        listed = ", ".join(_hhmm(s) for s in slots[:-1]) + f" and {_hhmm(slots[-1])}"
    else:
        listed = f"{_hhmm(slots[0])} to {_hhmm(slots[-1])} ({len(slots)} times)"
    return f"{listed} do not exist on this day (DST); those runs are skipped"


def _dropped_before(cron: _Cron, zone: ZoneInfo, run: datetime, offset: timedelta) -> str:
    """Return a note if a spring-forward gap dropped wall-clock slots just before ``run``.

    ``run`` is the naive local slot and ``offset`` its UTC offset.
    Computed from the run alone (not from where iteration started) so that every caller gets the
    same note for the same run.

    1. Find an offset increase in the lookback window; none means nothing was dropped.
    2. Binary-search its instant and derive the skipped wall-clock interval [start, end).
    3. Collect the cron's slots in that interval.
    4. Attach them only if this run is the first slot at or after the interval's end.
    """
    utc = (run - offset).replace(tzinfo=UTC)
    earlier = utc - DROP_LOOKBACK
    if _offset_at(earlier, zone) >= offset:
        return ""
    moment = _transition(zone, earlier, utc)
    before, after = _offset_at(moment - ONE_SECOND, zone), _offset_at(moment, zone)
    if after <= before:
        return ""
    gap_start = (moment + before).replace(tzinfo=None)
    gap_end = (moment + after).replace(tzinfo=None)
    slots: list[datetime] = []
    slot = cron.first_after(gap_start - ONE_MINUTE)
    while slot is not None and slot < gap_end:
        slots.append(slot)
        slot = cron.first_after(slot)
    if not slots or slot != run:
        return ""
    return _skipped_note(slots)


def _iter_fire_times(cron: _Cron, zone: ZoneInfo, after: datetime) -> Iterator[FireTime]:
    """Yield fire times strictly after ``after``, ascending, with the DST rules applied.

    1. Walk the cron's naive wall-clock slots from the local time of ``after`` (from the start
       of a repeated hour if ``after`` falls inside one, since its second pass is still ahead).
    2. On a day with one UTC offset (nearly every day), a slot is an ordinary time.
    3. Otherwise compare the zone's offsets for fold 0 and fold 1: equal means an ordinary time,
       fold 0 smaller means the slot falls in a spring-forward gap, larger means it occurs twice.
    4. Ordinary: yield it (wall-clock crons note slots a gap just dropped).
       Gap: named hours run at the gap's end (the next valid time); wall-clock skips it.
       Repeated: named hours run at the first pass; wall-clock yields every slot of the
       repeated hour in the first pass, then all of them again in the second.
    5. Never yield an instant at or before the last one: moved slots can land on the same time.
    """
    if after.utcoffset() is None:
        raise ValueError("after must be an aware datetime")
    last = after.astimezone(UTC)
    here = last.astimezone(zone)
    slot = cron.first_at_or_after(here.year, here.month, here.day, here.hour, here.minute + 1)
    if _plain_day(zone, here.year, here.month, here.day)[0] is None:
        start = here.replace(tzinfo=None)
        early, late = _offsets(zone, start)
        if early > late:
            start -= early - late
            slot = cron.first_at_or_after(
                start.year, start.month, start.day, start.hour, start.minute + 1
            )
    while slot is not None:
        y, mo, d, h, mi = slot
        offset, changed_lately = _plain_day(zone, y, mo, d)
        if offset is not None:
            utc = datetime(y, mo, d, h, mi, 0, 0, UTC) - offset
            if utc > last:
                note = ""
                if changed_lately and cron.wall_clock:
                    note = _dropped_before(cron, zone, datetime(*slot), offset)
                yield FireTime(datetime(y, mo, d, h, mi, 0, 0, zone), utc, note)
                last = utc
            slot = cron.first_at_or_after(y, mo, d, h, mi + 1)
            continue

        naive = datetime(*slot)
        first, second = _offsets(zone, naive)
        if first == second:
            utc = (naive - first).replace(tzinfo=UTC)
            if utc > last:
                note = _dropped_before(cron, zone, naive, first) if cron.wall_clock else ""
                yield FireTime(naive.replace(tzinfo=zone), utc, note)
                last = utc
        elif first < second:
            if not cron.wall_clock:
                moment = _transition(
                    zone, (naive - second).replace(tzinfo=UTC), (naive - first).replace(tzinfo=UTC)
                )
                if moment > last:
                    note = (
                        f"{_hhmm(naive)} does not exist on this day (DST); "
                        "runs at the next valid time"
                    )
                    yield FireTime(moment.astimezone(zone), moment, note)
                    last = moment
        elif not cron.wall_clock:
            utc = (naive - first).replace(tzinfo=UTC)
            if utc > last:
                note = (
                    f"{_hhmm(naive)} occurs twice on this day (DST); "
                    "runs once, at the first occurrence"
                )
                yield FireTime(naive.replace(tzinfo=zone), utc, note)
                last = utc
        else:
            moment = _transition(
                zone, (naive - first).replace(tzinfo=UTC), (naive - second).replace(tzinfo=UTC)
            )
            repeat_end = (moment + first).replace(tzinfo=None)
            repeated = [naive]
            following = cron.first_after(naive)
            while following is not None and following < repeat_end:
                repeated.append(following)
                following = cron.first_after(following)
            for candidate in repeated:
                utc = (candidate - first).replace(tzinfo=UTC)
                if utc > last:
                    yield FireTime(candidate.replace(tzinfo=zone), utc, "")
                    last = utc
            for candidate in repeated:
                utc = (candidate - second).replace(tzinfo=UTC)
                if utc > last:
                    note = (
                        f"{_hhmm(candidate)} occurs twice on this day (DST); "
                        "this is the second pass"
                    )
                    yield FireTime(candidate.replace(tzinfo=zone, fold=1), utc, note)
                    last = utc
            naive = repeated[-1]
        slot = cron.first_at_or_after(
            naive.year, naive.month, naive.day, naive.hour, naive.minute + 1
        )


def _offsets(zone: ZoneInfo, naive: datetime) -> tuple[timedelta, timedelta]:
    """Return the zone's UTC offsets for a wall-clock time's first and second occurrence."""
    local = naive.replace(tzinfo=zone)
    first, second = local.utcoffset(), local.replace(fold=1).utcoffset()
    assert first is not None and second is not None
    return first, second


def next_fire_times(schedule: CronSchedule, after: datetime, count: int) -> list[FireTime]:
    """Return the next ``count`` fire times strictly after ``after``, ascending."""
    cron, zone = _compile(schedule.cron, schedule.time_zone)
    times: list[FireTime] = []
    if count <= 0:
        return times
    for fire in _iter_fire_times(cron, zone, after):
        times.append(fire)
        if len(times) >= count:
            break
    return times


def fire_times_between(
    schedule: CronSchedule, after: datetime, until: datetime, limit: int
) -> list[FireTime]:
    """Return up to ``limit`` fire times in (after, until], ascending."""
    cron, zone = _compile(schedule.cron, schedule.time_zone)
    times: list[FireTime] = []
    if limit <= 0 or until <= after:
        return times
    for fire in _iter_fire_times(cron, zone, after):
        if fire.utc > until or len(times) >= limit:
            break
        times.append(fire)
    return times


def _preview_item(local: datetime, utc: datetime, start: datetime, note: str) -> dict:
    return {
        "local": local.isoformat(timespec="seconds"),
        "utc": format_utc(utc),
        "start": format_utc(start),
        "note": note,
    }


def preview(
    name: str,
    schedule: Schedule,
    after: datetime,
    count: int,
    *,
    created_at: datetime | None = None,
) -> list[dict]:
    """Return the next ``count`` runs as the preview API renders them.

    Cron: local time with offset, UTC, start after the job's jitter, and the DST note.
    One-off: its time if still ahead of ``after``. Delayed: ``created_at`` (or ``after``) plus
    the delay. None: nothing.
    """
    if after.utcoffset() is None:
        raise ValueError("after must be an aware datetime")
    if count <= 0:
        return []
    items: list[dict] = []
    # Near the ends of datetime's range (years 1 and 9999) the next time, its local form or its
    # jitter cannot be written: the preview stops at the last time that can.
    try:
        if isinstance(schedule, CronSchedule):
            jitter = timedelta(seconds=jitter_offset(name, schedule.jitter_seconds))
            cron, zone = _compile(schedule.cron, schedule.time_zone)
            for fire in _iter_fire_times(cron, zone, after):
                items.append(_preview_item(fire.local, fire.utc, fire.utc + jitter, fire.note))
                if len(items) >= count:
                    break
        elif isinstance(schedule, OneOffSchedule):
            if schedule.run_at > after:
                run_at = schedule.run_at.astimezone(UTC)
                items.append(_preview_item(run_at, run_at, run_at, ""))
        elif isinstance(schedule, DelayedSchedule):
            start = created_at or after
            due = (start + timedelta(seconds=schedule.delay_seconds)).astimezone(UTC)
            items.append(_preview_item(due, due, due, ""))
    except OverflowError:
        pass
    return items
