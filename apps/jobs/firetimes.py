"""Cron fire times: walk a cron's matches on a time zone's wall clock, as UTC instants.

Daylight-saving rules (README.md, "DST rules"); this module is the only place that applies them:

- Cron fields are matched against the wall clock of the schedule's time zone.
- A cron whose hour field names hours (``30 2 * * *``, ``0 1,13 * * *``) means "once at this
  local time": a local time skipped by spring-forward runs at the next valid local time, and a
  local time repeated by fall-back runs once, at its first occurrence.
- A cron whose hour field is a wildcard or a step (``0 * * * *``, ``*/15 * * * *``) follows the
  wall clock: a skipped slot does not run and a repeated slot runs in both passes.

A schedule's bounds (``startAt``, ``endAt``) are instants, applied to the fire times after the
DST rules: none before ``start_at``, none after ``end_at``; both ends are inclusive. A time that
a DST change moved counts where it lands (``30 2 * * *`` moved to 03:00 runs if 03:00 is inside).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from functools import lru_cache
from itertools import islice, takewhile
from typing import Protocol
from zoneinfo import ZoneInfo, available_timezones

from apps.jobs.cron import Cron, compile_cron

# A wall-clock run reports the slots a spring-forward gap dropped. A gap this recent is found
# by the offset alone; one further back only for a cron that skips days (`0 * * * 1-5` on
# Monday after a Friday the zone skipped), whose run looks back to its previous slot: the
# gap's last one, up to PREVIOUS_SLOT_HORIZON back (a leap day's hourly cron).
DROP_LOOKBACK = timedelta(hours=48)
PREVIOUS_SLOT_HORIZON = timedelta(days=4096)
ONE_SECOND = timedelta(seconds=1)
ONE_MINUTE = timedelta(minutes=1)
ONE_DAY = timedelta(days=1)
TINY = timedelta(microseconds=1)


@dataclass(frozen=True)
class FireTime:
    """A cron fire time: nominal local time, the same instant in UTC, and a DST note or ""."""

    local: datetime
    utc: datetime
    note: str


class ZonedCron(Protocol):
    """What fire-time iteration reads from a schedule: a cron expression, its time zone, and
    the instants it starts and ends at (None: unbounded)."""

    @property
    def cron(self) -> str: ...

    @property
    def time_zone(self) -> str: ...

    @property
    def start_at(self) -> datetime | None: ...

    @property
    def end_at(self) -> datetime | None: ...


# --- time zones -----------------------------------------------------------------------------


@lru_cache(maxsize=1024)
def load_zone(name: str) -> ZoneInfo:
    """Return the IANA zone, or raise ValueError naming it."""
    # Only IANA's names: the zoneinfo tree also holds host settings and helpers ("localtime",
    # "posixrules", "Factory") and, on some hosts, copies under "posix/" and "right/" (the
    # latter counting leap seconds), which another host may not have.
    if name not in iana_zones():
        raise ValueError(f"unknown time zone '{name}'")
    try:
        return ZoneInfo(name)
    # ZoneInfoNotFoundError is a KeyError; malformed keys and odd files raise the others.
    except (KeyError, ValueError, OSError) as exc:
        raise ValueError(f"unknown time zone '{name}'") from exc


@lru_cache(maxsize=1)
def iana_zones() -> frozenset[str]:
    """The IANA time zone names this Python knows (the system's tzdata, or the tzdata package)."""
    return frozenset(available_timezones()) - {"localtime", "posixrules", "Factory"}


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
    try:
        day_offsets = {_offset_at(midnight + timedelta(hours=h), zone) for h in day_hours}
        earlier_offsets = {_offset_at(midnight + timedelta(hours=h), zone) for h in lookback_hours}
    except OverflowError:  # the last days of year 9999: samples past datetime's range
        return None, True
    plain = next(iter(day_offsets)) if len(day_offsets) == 1 else None
    return plain, len(day_offsets | earlier_offsets) > 1


@lru_cache(maxsize=65536)
def compile_in_zone(expression: str, time_zone: str) -> tuple[Cron, ZoneInfo]:
    """Return the compiled cron and its zone; raise CronSyntaxError or ValueError."""
    return compile_cron(expression), load_zone(time_zone)


# --- fire times -----------------------------------------------------------------------------


def _hhmm(naive: datetime) -> str:
    return naive.strftime("%H:%M")


def _cause(zone: ZoneInfo, moment: datetime) -> str:
    """What moved the clocks at the UTC instant `moment`: daylight saving time, or a change of
    the zone's standard offset (Samoa skipped 30 December 2011 to cross the date line)."""
    before, after = (moment - ONE_SECOND).astimezone(zone), moment.astimezone(zone)
    return "DST" if before.dst() != after.dst() else "the zone's UTC offset changed"


def _skipped_note(slots: list[datetime], cause: str) -> str:
    if len(slots) == 1:
        return f"{_hhmm(slots[0])} does not exist on this day ({cause}); that run is skipped"
    if len(slots) <= 4:
        listed = ", ".join(_hhmm(s) for s in slots[:-1]) + f" and {_hhmm(slots[-1])}"
    else:
        listed = f"{_hhmm(slots[0])} to {_hhmm(slots[-1])} ({len(slots)} times)"
    return f"{listed} do not exist on this day ({cause}); those runs are skipped"


def _dropped_before(cron: Cron, zone: ZoneInfo, run: datetime, offset: timedelta) -> str:
    """Return a note if a spring-forward gap dropped wall-clock slots just before ``run``.

    ``run`` is the naive local slot and ``offset`` its UTC offset.
    Computed from the run alone (not from where iteration started) so that every caller gets the
    same note for the same run.

    1. An offset that rose within the lookback window: its gap (`_dropped_in`).
    2. Else, or when that gap dropped none of the cron's slots: the gap the cron's previous slot
       fell in, if it fell in one. The stretch back to that slot may hold other changes (a
       yearly cron's fall back and next spring forward): searched whole, it gave the wrong one.
    """
    utc = (run - offset).replace(tzinfo=UTC)
    earlier = utc - DROP_LOOKBACK
    if _offset_at(earlier, zone) < offset:
        note = _dropped_in(cron, zone, _transition(zone, earlier, utc), run)
        if note is not None:
            return note
    # A gap further back dropped slots that this run reports only if its previous slot (the
    # gap's last) is further back too; a gap moves the clock by a day at most.
    if cron.first_after(run - DROP_LOOKBACK + ONE_DAY) != run:
        return ""  # a slot within a day before this one
    previous = _previous_slot(cron, run)
    if previous is None:
        return ""
    first, second = _offsets(zone, previous)
    if first >= second:
        return ""  # the slot before this run exists: none was dropped in between
    # The two readings of `previous` bracket exactly the change that made its gap.
    moment = _transition(zone, *((previous - o).replace(tzinfo=UTC) for o in (second, first)))
    return _dropped_in(cron, zone, moment, run) or ""


def _dropped_in(cron: Cron, zone: ZoneInfo, moment: datetime, run: datetime) -> str | None:
    """The note ``run`` carries for the slots the gap made at UTC instant ``moment`` dropped:
    "" when another run is the first after the gap, None when it dropped none.

    The gap is the wall-clock interval [start, end) the change skipped; the note goes to the
    first slot at or after its end."""
    before, after = _offset_at(moment - ONE_SECOND, zone), _offset_at(moment, zone)
    if after <= before:
        return None
    gap_start = (moment + before).replace(tzinfo=None)
    gap_end = (moment + after).replace(tzinfo=None)
    slots: list[datetime] = []
    slot = cron.first_after(gap_start - ONE_MINUTE)
    while slot is not None and slot < gap_end:
        slots.append(slot)
        slot = cron.first_after(slot)
    if not slots:
        return None
    return _skipped_note(slots, _cause(zone, moment)) if slot == run else ""


def _previous_slot(cron: Cron, run: datetime) -> datetime | None:
    """The cron's last naive slot before ``run``, None past PREVIOUS_SLOT_HORIZON: the window
    back doubles until it holds one, then is halved down to the minute."""

    def before_run(naive: datetime) -> bool:
        slot = cron.first_after(naive)
        return slot is not None and slot < run

    span = DROP_LOOKBACK
    while not before_run(run - span):
        span *= 2
        if span > PREVIOUS_SLOT_HORIZON:
            return None
    # Holds a slot before the run after `low`, none after `high`.
    low, high = run - span, run - ONE_MINUTE
    while high - low > ONE_MINUTE:
        middle = low + ONE_MINUTE * (((high - low) // ONE_MINUTE) // 2)
        if before_run(middle):
            low = middle
        else:
            high = middle
    return cron.first_after(low)


@lru_cache(maxsize=4096)
def _fires_every_day(cron: Cron) -> bool:
    """Whether each day has fire times: a slot's previous one is then within a day, and the
    days before a run need a look only when the offset changed shortly before it."""
    return (
        len(cron.months) == 12
        and cron.days >= frozenset(range(1, 32))
        and len(cron.weekdays) == 7
        and not cron.has_month_rules
    )


def iter_fire_times(cron: Cron, zone: ZoneInfo, after: datetime) -> Iterator[FireTime]:
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
                if cron.wall_clock and (
                    changed_lately
                    # A day's first slot of a cron that skips days: its previous slot may be
                    # before a gap further back (a later one of the day follows one of its own).
                    or ((h, mi) == (cron.hours[0], cron.minutes[0]) and not _fires_every_day(cron))
                ):
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
                        f"{_hhmm(naive)} does not exist on this day ({_cause(zone, moment)}); "
                        "runs at the next valid time"
                    )
                    yield FireTime(moment.astimezone(zone), moment, note)
                    last = moment
        elif not cron.wall_clock:
            utc = (naive - first).replace(tzinfo=UTC)
            if utc > last:
                moment = _transition(zone, utc, (naive - second).replace(tzinfo=UTC))
                note = (
                    f"{_hhmm(naive)} occurs twice on this day ({_cause(zone, moment)}); "
                    "runs once, at the first occurrence"
                )
                yield FireTime(naive.replace(tzinfo=zone), utc, note)
                last = utc
        else:
            moment = _transition(
                zone, (naive - first).replace(tzinfo=UTC), (naive - second).replace(tzinfo=UTC)
            )
            repeat_end = (moment + first).replace(tzinfo=None)
            cause = _cause(zone, moment)
            repeated = [naive]
            following = cron.first_after(naive)
            while following is not None and following < repeat_end:
                repeated.append(following)
                following = cron.first_after(following)
            for candidate in repeated:
                utc = (candidate - first).replace(tzinfo=UTC)
                if utc > last:
                    note = (
                        f"{_hhmm(candidate)} occurs twice on this day ({cause}); "
                        "this is the first pass"
                    )
                    yield FireTime(candidate.replace(tzinfo=zone), utc, note)
                    last = utc
            for candidate in repeated:
                utc = (candidate - second).replace(tzinfo=UTC)
                if utc > last:
                    note = (
                        f"{_hhmm(candidate)} occurs twice on this day ({cause}); "
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


def schedule_fire_times(schedule: ZonedCron, after: datetime) -> Iterator[FireTime]:
    """Return the schedule's fire times strictly after ``after`` within its bounds, ascending.

    1. Start at ``start_at`` if that is later: "after the instant just before it" keeps a fire
       time exactly at ``start_at``.
    2. Stop at the first fire time after ``end_at``.
    The schedule and ``after`` are checked now, not on the first ``next()``.
    """
    cron, zone = compile_in_zone(schedule.cron, schedule.time_zone)
    if after.utcoffset() is None:
        raise ValueError("after must be an aware datetime")
    start, end = schedule.start_at, schedule.end_at
    if start is not None and start > after:
        after = start - TINY
    fires = iter_fire_times(cron, zone, after)
    return fires if end is None else takewhile(lambda fire: fire.utc <= end, fires)


def next_fire_times(schedule: ZonedCron, after: datetime, count: int) -> list[FireTime]:
    """Return the next ``count`` fire times strictly after ``after`` within the schedule's
    bounds, ascending; fewer once the schedule ends."""
    return list(islice(schedule_fire_times(schedule, after), max(count, 0)))


def fire_times_between(
    schedule: ZonedCron, after: datetime, until: datetime, limit: int
) -> list[FireTime]:
    """Return up to ``limit`` fire times in (after, until] within the schedule's bounds,
    ascending."""
    fires = schedule_fire_times(schedule, after)
    if limit <= 0 or until <= after:
        return []
    return list(islice(takewhile(lambda fire: fire.utc <= until, fires), limit))
