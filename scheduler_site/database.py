"""Turn a DATABASE_URL into Django's DATABASES entry."""

from __future__ import annotations

import logging
import os
from typing import Any
from urllib.parse import parse_qs, unquote, urlparse

from django.core.exceptions import ImproperlyConfigured
from django.db import OperationalError

# How long a new connection waits for its server (a `connect_timeout` in the URL replaces it).
CONNECT_TIMEOUT_SECONDS = 5


def config_from_url(
    url: str,
    *,
    application_name: str,
    pool_size: int | None = None,
    lock_timeout: float = 0,
    statement_timeout: int = 0,
) -> dict[str, Any]:
    """Django's DATABASES entry; with `pool_size`, connections come from a psycopg pool.
    `lock_timeout` and `statement_timeout` (seconds, 0 for none) bound each statement's wait
    for a lock and its whole run.

    The web process runs under ASGI, where Django's per-thread persistent connections are never
    reused (each request runs in a thread context of its own), so without a pool every request
    would open a connection. Daemons keep one persistent connection per thread instead.
    """
    parsed = urlparse(url)
    if parsed.scheme not in {"postgres", "postgresql"}:
        raise ImproperlyConfigured(
            "DATABASE_URL must be a postgresql:// URL (SQLite is not supported); it begins "
            f"{parsed.scheme + ':' if parsed.scheme else 'with no scheme'}"
        )
    try:
        port = parsed.port
    except ValueError:  # not a number, or past 65535
        raise ImproperlyConfigured(
            "DATABASE_URL has a port that is not a number from 0 to 65535."
        ) from None
    query = {key: values[-1] for key, values in parse_qs(parsed.query).items()}
    host = query.pop("host", None) or parsed.hostname or ""
    # Django turns psycopg's statement preparation off; its own cursors bind on the client and
    # never prepare anyway, but the claim path's server-binding cursors (apps/runs/store.py) do,
    # after a statement's fifth execution on a connection. Those statements are planned once
    # (generic plans): left to choose, PostgreSQL re-planned the claim on every call, and
    # planning cost twice what executing it did. Only prepared statements are affected.
    # No JIT: once the backlog passed about 50 000 runs the claim's estimated cost crossed
    # jit_above_cost and every claim spent 34 ms compiling for 1 ms of execution.
    settings = "-c plan_cache_mode=force_generic_plan -c jit=off"
    if lock_timeout:
        settings += f" -c lock_timeout={round(lock_timeout * 1000)}ms"
    if statement_timeout:
        settings += f" -c statement_timeout={statement_timeout}s"
    options: dict[str, Any] = {
        "application_name": application_name,
        "prepare_threshold": 5,
        "options": settings,
        # libpq waits for a connection without limit by default: a daemon reconnecting to a
        # server whose processes had stopped waited as long as they stayed stopped.
        "connect_timeout": CONNECT_TIMEOUT_SECONDS,
    }
    if "options" in query:
        query["options"] = f"{options['options']} {query['options']}"
    options.update(query)
    if pool_size:
        # min_size is kept open; a request waits up to `timeout` for a connection beyond it.
        options["pool"] = {"min_size": min(2, pool_size), "max_size": pool_size, "timeout": 10}
    return {
        # Django's backend, with a refused commit said as such, and pooled connections checked
        # by the backend rather than by the pool (scheduler_site/postgresql/base.py).
        "ENGINE": "scheduler_site.postgresql",
        "NAME": unquote(parsed.path.lstrip("/")) or "postgres",
        "USER": unquote(parsed.username or ""),
        "PASSWORD": unquote(parsed.password or ""),
        "HOST": host,
        "PORT": str(port or ""),
        # A pooled connection goes back to the pool at the end of each request (age 0).
        "CONN_MAX_AGE": 0 if pool_size else 60,
        # Checked before use: a connection PostgreSQL has dropped is replaced, not handed out
        # (pooled ones by the backend itself, not by the pool: see its module).
        "CONN_HEALTH_CHECKS": not pool_size,
        "OPTIONS": options,
        # Parallel test sessions on one server each name their own test database.
        "TEST": {"NAME": os.environ.get("TEST_DATABASE_NAME") or None},
    }


class CommitRefused(OperationalError):
    """The database answered a COMMIT with an error (a deferred constraint or trigger): the
    transaction was rolled back and nothing of it was written. An OperationalError, as a lock
    wait past its bound is: whatever answers a transaction that failed ("nothing was changed;
    try again") answers this one. The database's own error is its cause."""

    def __init__(self, error: BaseException) -> None:
        self.sqlstate = _sqlstate(error)
        self.kind = type(getattr(error, "__cause__", None) or error).__name__
        super().__init__(f"the database refused the commit: {error}")


# lock_not_available, query_canceled: the bounds the web process sets on its statements.
TIMED_OUT = frozenset({"55P03", "57014"})


def log_failure(exc: BaseException, logger: logging.Logger) -> None:
    """Log a database error that ended a request: a statement past the web process's bounds as
    a warning (the README's documented answer, no fault here), anything else with its trace."""
    if _sqlstate(exc) in TIMED_OUT:
        logger.warning("database wait answered 503: %s", failure_words(exc))
    else:
        logger.error("database failure answered 503", exc_info=exc)


def _sqlstate(exc: BaseException) -> str | None:
    return getattr(exc.__cause__, "sqlstate", None) or getattr(exc, "sqlstate", None)


# What a 503 for a database that failed or cannot be reached tells a client to wait before trying
# again (the API's and the dashboard's): a lock wait or a dropped connection is usually over by
# then, and the page's own reload or the SDK's backoff takes it from there.
RETRY_AFTER_SECONDS = 1


def failure_detail(exc: BaseException) -> str:
    """`failure_words` as an API problem's detail says them (a sentence, and what to do)."""
    words = failure_words(exc)
    return f"{words[:1].upper()}{words[1:]}; try again."


def failure_words(exc: BaseException) -> str:
    """What a database error that ended a request (its transaction rolled back) means to
    whoever sent it: the API's problem detail and the dashboard's page say it."""
    from django.conf import settings

    state = _sqlstate(exc)
    if state == "55P03":  # lock_not_available
        return (
            "another session held a lock this request needs for over "
            f"{settings.DB_LOCK_TIMEOUT} s (SCHEDULER_DB_LOCK_TIMEOUT); nothing was changed"
        )
    if state == "57014":  # query_canceled: the statement timeout, or an operator's cancel
        return (
            f"the database statement ran past {settings.DB_STATEMENT_TIMEOUT} s "
            "(SCHEDULER_DB_STATEMENT_TIMEOUT) or was cancelled; nothing was changed"
        )
    if isinstance(exc, CommitRefused):
        return (
            f"the database refused this change at its commit ({exc.kind}, SQLSTATE "
            f"{exc.sqlstate}); nothing was changed"
        )
    return f"the database failed this request ({type(exc).__name__})"
