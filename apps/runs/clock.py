"""The database clock, the only clock the scheduler trusts (workers' and web hosts' clocks drift),
and the one way an instant is written out: ISO 8601 in UTC with a Z."""

from __future__ import annotations

import functools
from datetime import UTC, datetime
from typing import overload

from django.db import connection


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
