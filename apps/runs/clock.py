"""The database clock, the only clock the scheduler trusts (workers' and web hosts' clocks drift)."""

from __future__ import annotations

from datetime import datetime

from django.db import connection


def database_now() -> datetime:
    """Read the database's now(): the start of the current transaction, when there is one."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT now()")
        return cursor.fetchone()[0]
