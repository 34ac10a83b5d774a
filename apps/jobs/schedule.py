"""Schedules in their JSON form: parse, validate and render them, preview their runs, and derive
each job's jitter, shard and run keys.

Pure Python on purpose (no ORM, no settings): the API, the dashboard and the scheduler all call
these functions, and the tests hit them without a database. Cron syntax lives in ``cron``, fire
times and the DST rules in ``firetimes``.
"""

from __future__ import annotations

import hashlib
import unicodedata
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING

from apps.jobs.cron import (
    FIELD_LAYOUT,
    Cron,
    CronSyntaxError,
    compile_cron,
    never_fires_reason,
    shortest_gap,
)
from apps.jobs.firetimes import iter_fire_times, load_zone, schedule_fire_times
from apps.runs.clock import format_utc
from apps.runs.limits import LATEST_RUN_TIME

if TYPE_CHECKING:
    from apps.jobs.models import JobDefinition

DEFAULT_TIME_ZONE = "UTC"
DEFAULT_JITTER_SECONDS = 60
DEFAULT_MISSED_RUN_POLICY = "run_once"
MISSED_RUN_POLICIES = ("run_once", "run_all", "skip")
DEFAULT_OVERLAP_POLICY = "allow_all"
# What a cron fire time does while runs of the definition are not finished (the materialiser
# applies it: apps/scheduler/materialiser.py). In words for people: the job page and form.
OVERLAP_POLICIES = {
    "allow_all": "a new run at every fire time, whatever is waiting or running",
    "skip": "no new run while one is waiting or running",
    "buffer_one": "no new run while one is waiting; one may wait behind a running one",
    "cancel_other": "a new run cancels the waiting ones and asks the running ones to stop",
}
DEFAULT_SHARD_COUNT = 16
# A delay this long is certainly a unit mistake, and it keeps every due time inside datetime's range.
MAX_DELAY_SECONDS = 10 * 366 * 24 * 3600

CRON_KEYS = frozenset(
    {"cron", "timeZone", "jitterSeconds", "missedRunPolicy", "startAt", "endAt", "overlapPolicy"}
)
BOUND_KEYS = frozenset({"startAt", "endAt"})
ONE_OFF_KEYS = frozenset({"runAt"})
DELAYED_KEYS = frozenset({"delaySeconds"})


class ScheduleError(ValueError):
    """A schedule failed validation; ``errors`` maps each bad field's path to the reason."""

    def __init__(self, errors: dict[str, str]):
        self.errors = dict(errors)
        super().__init__("; ".join(f"{path}: {reason}" for path, reason in self.errors.items()))


@dataclass(frozen=True)
class CronSchedule:
    """Run at each time a 5-field cron expression matches, on the wall clock of ``time_zone``.

    ``start_at`` and ``end_at`` (aware, UTC, or None) bound the nominal fire times, both ends
    inclusive: none before ``start_at``, none after ``end_at``. Jitter may start the last run up
    to ``jitter_seconds`` after ``end_at``; its due time is inside.

    ``overlap_policy`` (one of OVERLAP_POLICIES) says what a fire time does while runs of the
    definition are waiting or leased; the materialiser applies it.
    """

    cron: str
    time_zone: str = DEFAULT_TIME_ZONE
    jitter_seconds: int = DEFAULT_JITTER_SECONDS
    missed_run_policy: str = DEFAULT_MISSED_RUN_POLICY
    start_at: datetime | None = None
    end_at: datetime | None = None
    overlap_policy: str = DEFAULT_OVERLAP_POLICY


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
                "expected cron (with timeZone, jitterSeconds, missedRunPolicy, startAt, "
                "endAt, overlapPolicy), runAt, or delaySeconds"
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
    bounded = sorted(keys & BOUND_KEYS)
    if "cron" not in keys and len(kinds) > 1 and (bounded or "overlapPolicy" in keys):
        errors = {
            f"schedule.{key}": "bounds only a cron schedule; a one-off or delayed schedule "
            "runs once, at its own time"
            for key in bounded
        }
        if "overlapPolicy" in keys:
            errors["schedule.overlapPolicy"] = (
                "applies only to a cron schedule; a one-off or delayed schedule has one run, "
                "which nothing can overlap"
            )
        raise ScheduleError(errors)
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


def _parse_instant(value: object) -> datetime:
    """Parse an ISO-8601 instant with a UTC offset (runAt, startAt, endAt) to an aware UTC time.

    Raise ValueError with the reason.
    """
    reason = "must be an ISO-8601 time with a UTC offset, e.g. 2026-12-01T10:00:00Z"
    if not isinstance(value, str):
        raise ValueError(reason)
    try:
        # Taken as sent, never trimmed, as every string is ("…Z\n" is not a time).
        if not value.isprintable() or value != value.strip():
            raise ValueError(reason)
        instant = datetime.fromisoformat(value)
    except ValueError:
        raise ValueError(f"'{value}' {reason}") from None
    if instant.utcoffset() is None:
        raise ValueError(f"'{value}' has no UTC offset; add one, e.g. Z or +01:00")
    # Kept to the millisecond, the precision times are written in: the definition's JSON form
    # then reads back as the same definition.
    instant = instant.replace(microsecond=instant.microsecond // 1000 * 1000)
    try:
        return instant.astimezone(UTC)
    except OverflowError:
        raise ValueError(f"'{value}' is out of range in UTC") from None


def _parse_one_off(value: object) -> OneOffSchedule:
    try:
        return OneOffSchedule(run_at=_parse_instant(value))
    except ValueError as exc:
        raise ScheduleError({"schedule.runAt": str(exc)}) from None


def _odd_space(expression: str) -> str | None:
    """The first white space in `expression` other than a plain space, named, or None. Taken
    for a separator, a tab or a no-break space was silently rewritten to a space."""
    for char in expression:
        if char != " " and (char.isspace() or unicodedata.category(char) in {"Cf", "Zs"}):
            name = unicodedata.name(char, "").lower()
            return f"U+{ord(char):04X}" + (f" ({name})" if name else "")
    return None


def _fires_between(cron: Cron, time_zone: str, start_at: datetime, end_at: datetime) -> bool:
    """Whether `cron` has a fire time from `start_at` to `end_at`, both inclusive."""
    after = start_at - timedelta(microseconds=1)
    first = next(iter_fire_times(cron, load_zone(time_zone), after), None)
    return first is not None and first.utc <= end_at


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
    compiled: Cron | None = None

    expression = raw.get("cron")
    if "cron" not in raw:
        errors["schedule.cron"] = (
            "is required with timeZone, jitterSeconds, missedRunPolicy, startAt, endAt or "
            "overlapPolicy"
        )
    elif not isinstance(expression, str) or not expression.strip():
        errors["schedule.cron"] = f"must be a cron expression: 5 fields ({FIELD_LAYOUT}) or a macro"
    else:
        odd = _odd_space(expression)
        expression = " ".join(expression.split())
        try:
            compiled = compile_cron(expression)
        except CronSyntaxError as exc:
            errors["schedule.cron"] = str(exc)
        else:
            # Checked once the expression reads as cron: a real mistake is named first.
            wrong = f"separate the fields with spaces, not {odd}" if odd else None
            wrong = wrong or never_fires_reason(compiled)
            if wrong:
                errors["schedule.cron"] = wrong
                compiled = None

    time_zone = raw.get("timeZone", DEFAULT_TIME_ZONE)
    if not isinstance(time_zone, str):
        errors["schedule.timeZone"] = "must be an IANA time zone name, e.g. Europe/Berlin"
    else:
        try:
            load_zone(time_zone)
        except ValueError as exc:
            errors["schedule.timeZone"] = str(exc)

    jitter = raw.get("jitterSeconds", DEFAULT_JITTER_SECONDS)
    if not _is_int(jitter):
        errors["schedule.jitterSeconds"] = "must be a whole number of seconds (0 turns jitter off)"
    elif jitter < 0:
        errors["schedule.jitterSeconds"] = "must not be negative"
    # Fire times are at least a minute apart, so a jitter of 60 or less always fits.
    elif compiled is not None and jitter > 60:
        gap = shortest_gap(compiled)
        if jitter > gap:
            errors["schedule.jitterSeconds"] = (
                f"{jitter} is longer than the shortest gap between this cron's fire times "
                f"({gap} seconds); runs would start out of order"
            )

    policy = raw.get("missedRunPolicy", DEFAULT_MISSED_RUN_POLICY)
    if policy not in MISSED_RUN_POLICIES or not isinstance(policy, str):
        errors["schedule.missedRunPolicy"] = f"must be one of {', '.join(MISSED_RUN_POLICIES)}"

    # As missedRunPolicy: null is no policy, not the default one.
    overlap = raw.get("overlapPolicy", DEFAULT_OVERLAP_POLICY)
    if not isinstance(overlap, str) or overlap not in OVERLAP_POLICIES:
        errors["schedule.overlapPolicy"] = f"must be one of {', '.join(OVERLAP_POLICIES)}"

    bounds: dict[str, datetime | None] = {"startAt": None, "endAt": None}
    for key in bounds:
        # null reads as absent: a client may send every field, unset ones as null.
        if raw.get(key) is not None:
            try:
                bounds[key] = _parse_instant(raw[key])
            except ValueError as exc:
                errors[f"schedule.{key}"] = str(exc)
    for key, bound in bounds.items():
        # Fire times are computed from the bounds: past this one a zone's local time of them
        # may not fit in a datetime.
        if bound is not None and bound > LATEST_RUN_TIME:
            errors[f"schedule.{key}"] = f"is later than {format_utc(LATEST_RUN_TIME)}"
    start_at, end_at = bounds["startAt"], bounds["endAt"]
    if start_at is not None and end_at is not None and end_at <= start_at:
        errors["schedule.endAt"] = (
            f"must be after startAt ({format_utc(start_at)}); the schedule would never run"
        )
    elif start_at is not None and end_at is not None and compiled is not None:
        if "schedule.timeZone" not in errors and not _fires_between(
            compiled, time_zone, start_at, end_at
        ):
            errors["schedule.endAt"] = (
                f"the cron has no fire time from startAt ({format_utc(start_at)}) to endAt; "
                "the schedule would never run"
            )

    if errors:
        raise ScheduleError(errors)
    assert isinstance(expression, str) and isinstance(time_zone, str) and isinstance(jitter, int)
    return CronSchedule(
        cron=expression,
        time_zone=time_zone,
        jitter_seconds=jitter,
        missed_run_policy=policy,
        start_at=start_at,
        end_at=end_at,
        overlap_policy=overlap,
    )


def schedule_to_json(schedule: Schedule) -> dict:
    """Return the canonical JSON form of a schedule, defaults included."""
    if isinstance(schedule, CronSchedule):
        canonical = {
            "cron": schedule.cron,
            "timeZone": schedule.time_zone,
            "jitterSeconds": schedule.jitter_seconds,
            "missedRunPolicy": schedule.missed_run_policy,
            "overlapPolicy": schedule.overlap_policy,
        }
        # Only when set, so an unbounded schedule keeps the form it had before bounds existed.
        if schedule.start_at is not None:
            canonical["startAt"] = format_utc(schedule.start_at)
        if schedule.end_at is not None:
            canonical["endAt"] = format_utc(schedule.end_at)
        return canonical
    if isinstance(schedule, OneOffSchedule):
        return {"runAt": format_utc(schedule.run_at)}
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


def is_schedule_key(name: str, key: str) -> bool:
    """Whether `key` has the form of the job's fire-time keys (`idempotency_key`): a run made
    with it through the API would hold that time's key, and the cron run, catch-up or backfill
    of the time would then be skipped as already made."""
    prefix = f"{name}@"
    if not key.startswith(prefix):
        return False
    try:
        return datetime.fromisoformat(key[len(prefix) :]).tzinfo is not None
    except ValueError:
        return False


# --- preview --------------------------------------------------------------------------------


def _preview_item(
    local: datetime, utc: datetime, start: datetime, dst_note: str, bound_note: str = ""
) -> dict:
    return {
        # To the millisecond when it has a fraction, as `utc` is written (format_utc).
        "local": local.isoformat(timespec="milliseconds" if local.microsecond else "seconds"),
        "utc": format_utc(utc),
        "start": format_utc(start),
        # The API has one note per time: a bound's note follows the DST one.
        "note": "; ".join(note for note in (dst_note, bound_note) if note),
        "dst": bool(dst_note),
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

    Cron: local time with offset, UTC, start after the job's jitter, the DST note, and whether
    a DST change moved or repeated it; only times within startAt and endAt, the first one after
    a startAt still ahead of ``after`` and the last one before endAt saying so in their notes.
    One-off: its time if still ahead of ``after``. Delayed: ``created_at`` plus the delay if
    still ahead of ``after`` (without ``created_at``, a schedule not saved yet: ``after`` plus
    the delay). None: nothing.
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
            _cron_preview(name, schedule, after, count, items)
        elif isinstance(schedule, OneOffSchedule):
            if schedule.run_at > after:
                run_at = schedule.run_at.astimezone(UTC)
                items.append(_preview_item(run_at, run_at, run_at, ""))
        elif isinstance(schedule, DelayedSchedule):
            start = created_at or after
            due = (start + timedelta(seconds=schedule.delay_seconds)).astimezone(UTC)
            if created_at is None or due > after:
                items.append(_preview_item(due, due, due, ""))
    except OverflowError:
        pass
    return items


def saved_preview(
    definition: JobDefinition, schedule: Schedule, after: datetime, count: int
) -> list[dict]:
    """A saved definition's preview: a delayed job's one time is the one it was given when
    saved (its next fire time, to the microsecond), and none once its run has been made."""
    created_at = definition.created_at
    if isinstance(schedule, DelayedSchedule):
        if definition.next_due_at is None:
            return []
        created_at = definition.next_due_at - timedelta(seconds=schedule.delay_seconds)
    return preview(definition.name, schedule, after, count, created_at=created_at)


def _cron_preview(
    name: str, schedule: CronSchedule, after: datetime, count: int, items: list[dict]
) -> None:
    """Append the cron preview's items to ``items`` (kept if a later time overflows)."""
    jitter = timedelta(seconds=jitter_offset(name, schedule.jitter_seconds))
    starts_later = schedule.start_at is not None and schedule.start_at > after
    fires = schedule_fire_times(schedule, after)
    fire = next(fires, None)
    while fire is not None and len(items) < count:
        # The time after the one shown tells whether the one shown is the schedule's last.
        try:
            following = next(fires, None)
            last = following is None
        except OverflowError:
            following, last = None, False
        notes = []
        if starts_later and not items:
            notes.append(
                f"first run: the schedule starts at {format_utc(schedule.start_at)} (startAt)"
            )
        if last and schedule.end_at is not None:
            notes.append(f"last run: the schedule ends at {format_utc(schedule.end_at)} (endAt)")
        items.append(
            _preview_item(fire.local, fire.utc, fire.utc + jitter, fire.note, "; ".join(notes))
        )
        fire = following
