"""The database clock, the only clock the scheduler trusts (workers' and web hosts' clocks drift),
the one way an instant is written out (ISO 8601 in UTC with a Z), and the one way one is read."""

from __future__ import annotations

import functools
import time
from datetime import UTC, datetime
from typing import overload

from django.db import connection
from django.utils.dateparse import parse_datetime


def database_now() -> datetime:
    """Read the database's now(): the start of the current transaction, when there is one."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT now()")
        return cursor.fetchone()[0]


@overload
def format_utc(value: datetime) -> str: ...
@overload
def format_utc(value: None) -> None: ...


def format_utc(value: datetime | None) -> str | None:
    """Write an aware instant in UTC with a Z, to the millisecond when it has a fraction
    (`2026-03-15T02:00:03Z`, `2026-03-15T02:00:03.250Z`); None stays None. Every answer, page,
    log line and audit entry writes times this way."""
    return None if value is None else _format(value)


@functools.lru_cache(maxsize=4096)
def _format(value: datetime) -> str:
    # Cached: the worker API writes two instants per run, and the leases of one claim share
    # their expiry (a hit costs a twentieth of formatting).
    if value.utcoffset() is None:
        raise ValueError("format_utc needs an aware datetime")
    value = value.astimezone(UTC)
    spec = "milliseconds" if value.microsecond else "seconds"
    return value.replace(tzinfo=None).isoformat(timespec=spec) + "Z"


# The last second `format_timestamp` wrote, and its text.
_second: tuple[int, str] = (-1, "")


def format_timestamp(seconds: float) -> str:
    """A Unix time (a log record's `created`) as `format_utc` writes an instant, always to the
    millisecond (`2026-12-03T10:55:41.837Z`). Per log line: the second's text is kept, so a
    line costs a rounding and an f-string (`format_utc` of a datetime made for it: ~7 µs)."""
    global _second
    whole = int(seconds)
    # To the microsecond first, as datetime.fromtimestamp rounds (…41.837 is …41.83699… as a float).
    micro = round((seconds - whole) * 1e6)
    if micro == 1_000_000:
        whole, micro = whole + 1, 0
    second = _second  # one read: other threads may replace it
    if second[0] != whole:
        second = (whole, time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(whole)))
        _second = second
    return f"{second[1]}.{micro // 1000:03d}Z"


def read_iso(raw: object, *, plus_as_space: bool = False) -> datetime | None:
    """An ISO 8601 time as sent (with its offset, or naive when it has none), or None when `raw`
    is not one. Taken as sent, as every string is: Django's pattern ends in `$`, which also
    matches before a final newline, so `…Z\n` discarded runs as if it were `…Z`. With
    `plus_as_space`, a space stands for the `+` that a form or a query string turned into one.
    ASCII digits only (Django's pattern takes any Unicode digit: "２０２７-01-01…" passed), and
    an offset in whole minutes, as ISO 8601 writes it (Python also reads "+05:30:15")."""
    if not isinstance(raw, str) or not raw or len(raw) > 64:
        return None
    if not (raw.isascii() and raw.isprintable()):
        return None
    if raw.endswith("z"):  # RFC 3339 allows "t" and "z" in lower case; the parser only "t"
        raw = raw[:-1] + "Z"
    try:
        value = parse_datetime(raw.replace(" ", "+") if plus_as_space else raw)
    except ValueError:  # well formed but not a time, e.g. 12:99
        return None
    offset = value.utcoffset() if value is not None else None
    if offset is not None and offset.total_seconds() % 60:
        return None
    return value
