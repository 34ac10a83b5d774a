"""Django's PostgreSQL backend, with a commit the database refused said as such
(`CommitRefused`), and pooled connections checked out without a round trip and
without a stall, and a database that is down refused at once.

Django has psycopg's pool check each connection it hands out (`CONN_HEALTH_CHECKS`): an empty
query, one round trip per checkout, that is per request and database. And the pool, when a
check fails, waits before it tries the next connection: 1 s, then 2, 4, 8… After a PostgreSQL
restart or failover every idle connection of the pool is dead, so a request could wait seconds
through them one by one (a long poll after its server's connections were cut took 8.7 s to see
a run: tests/faults/test_connections.py).

Here a connection is asked only when its socket has something to read. A pooled connection is
idle, so the server has nothing to send it unless it is ending it (a restart, a terminated
backend, an idle timeout: a FATAL notice, then the end of the stream); a healthy one costs a
`poll()` instead of a round trip. The first dead connection found makes the pool test every
idle one at once, and the request takes a live or new one straight away. A server that
vanished without closing its sockets (its host lost) is found by the first statement, as
without any check: the request fails and the pool discards the connection.

A server that is down is another matter: the pool makes every request wait its whole timeout
(10 s) for a connection that cannot come, a request that reads two databases waits twice, and
the pool's own attempts back off (1, 2, 4 … 64 s), so it came back a minute after its server
did. So each pooled database has a `Breaker`. When a request finds a dropped connection, or the
pool gave it none in time, it tries the server with a connection of its own; a server that does
not answer opens the breaker. While it is open every request for that database fails at once
(Django's OperationalError, which the shard layer answers as unavailable shards); after
`OPEN_SECONDS` one request tries again, and a server that answers gets a new pool, free of the
old one's back-off. A backend terminated on a server that is up (57P01), or a pool whose
connections are all in use, opens nothing: the server answers the try.
"""

from __future__ import annotations

import logging
import math
import select
import threading
import time
from typing import Any

import psycopg
from django.db import DatabaseError, InterfaceError, OperationalError
from django.db.backends.postgresql import base
from psycopg_pool import ConnectionPool

from scheduler_site.database import CommitRefused
from scheduler_site.postgresql import stalls

logger = logging.getLogger(__name__)

# A connection taken after the pool has tested every idle one is live or new; the bound only
# keeps a server that drops connections as fast as they are made from looping here.
CHECKOUTS = 3

# How long a database found down is refused without trying it again.
OPEN_SECONDS = 1.0
# The wait for the server's answer when it is tried (a host that is lost answers nothing).
TRY_TIMEOUT_SECONDS = 2


def has_input(connection: psycopg.Connection) -> bool:
    """Whether the server has sent anything on this (idle) connection."""
    poller = select.poll()  # not select(): a web process may hold descriptors past 1 024
    poller.register(connection.fileno(), select.POLLIN)
    return bool(poller.poll(0))


class Unreachable(psycopg.OperationalError):
    """A database whose breaker is open: refused without trying it."""


class Breaker:
    """Whether one database is taken to be down, and until when (monotonic clock)."""

    def __init__(self, alias: str) -> None:
        self.alias = alias
        self.open_until = -math.inf
        self.failure = ""
        self._trying = threading.Lock()  # one request tries a database found down
        self.proven = False  # the server has answered once: the pool's first request tries it

    def is_open(self) -> bool:
        return self.failure != ""

    def admit(self) -> bool:
        """Let a request through, refusing it while the breaker is open; True when this
        request is the one to try the server again (it must `close` or `open` the breaker,
        then `done`)."""
        if not self.is_open():
            return False
        if time.monotonic() < self.open_until or not self._trying.acquire(blocking=False):
            raise Unreachable(f"database {self.alias} is unreachable: {self.failure}")
        return True

    def open(self, failure: BaseException) -> None:
        if not self.is_open():
            logger.warning("database %s is unreachable; refusing it for %.0f s at a time: %s",
                           self.alias, OPEN_SECONDS, failure)  # fmt: skip
        self.failure = str(failure).strip().splitlines()[0] if str(failure).strip() else "down"
        self.open_until = time.monotonic() + OPEN_SECONDS

    def close(self) -> None:
        if self.is_open():
            logger.warning("database %s answers again", self.alias)
        self.failure = ""

    def done(self) -> None:
        self._trying.release()


# One per database alias, for the life of the process (as Django's pools are).
_breakers: dict[str, Breaker] = {}
_breakers_lock = threading.Lock()


def breaker(alias: str) -> Breaker:
    found = _breakers.get(alias)  # every checkout asks: no lock, no new object, once made
    if found is None:
        with _breakers_lock:
            found = _breakers.setdefault(alias, Breaker(alias))
    return found


def _watched(execute: Any, sql: str, params: Any, many: bool, context: dict[str, Any]) -> Any:
    """Django's execute wrapper: the statement is noted while it waits (stalls.py)."""
    wrapper = context["connection"]
    key = stalls.begin(wrapper.alias, wrapper.connection)
    try:
        return execute(sql, params, many, context)
    finally:
        stalls.end(key)


# A server found stopped by a stalled statement is refused at once, as one found down.
stalls.when_stopped(lambda alias, failure: breaker(alias).open(failure))


class DatabaseWrapper(base.DatabaseWrapper):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.execute_wrappers.append(_watched)

    def is_usable(self) -> bool:
        # Django's health check (the daemons' persistent connections) runs its SELECT 1 on the
        # psycopg connection itself, past the execute wrappers: noted here, or a scheduler
        # waited on a stopped server for as long as it stayed stopped.
        if self.connection is None:
            return False
        key = stalls.begin(self.alias, self.connection)
        try:
            return super().is_usable()
        finally:
            stalls.end(key)

    def _rollback(self) -> None:
        key = stalls.begin(self.alias, self.connection)
        try:
            super()._rollback()
        finally:
            stalls.end(key)

    def _commit(self) -> None:
        key = stalls.begin(self.alias, self.connection)
        try:
            super()._commit()
        except DatabaseError as exc:
            # A deferred constraint or trigger raised (IntegrityError, ProgrammingError…): the
            # server answered, so the transaction is rolled back, not in doubt as when the
            # connection is lost on the way (OperationalError, raised as it is).
            if isinstance(exc, OperationalError | InterfaceError):
                raise
            raise CommitRefused(exc) from exc
        finally:
            stalls.end(key)

    def get_new_connection(self, conn_params: dict[str, Any]) -> Any:
        stalls.know(self.alias, conn_params)
        if self.settings_dict["OPTIONS"].get("pool") is None:
            return super().get_new_connection(conn_params)
        state = breaker(self.alias)
        if not state.proven:
            # The process's first connection to it: a server down from the start held that
            # request (and a probe's) for the pool's whole timeout (10 s) before the breaker
            # learnt of it. Down, the breaker opens here at once.
            self._try_server(conn_params, state)
            state.proven = True
        if state.admit():
            try:
                self._try_server(conn_params, state)
                # The old pool may be backing off for a minute: a new one connects now.
                self.close_pool()
                state.close()
            finally:
                state.done()
        try:
            connection = super().get_new_connection(conn_params)
        except psycopg.Error:
            # No connection within the pool's timeout: every one in use, or the server down.
            self._try_server(conn_params, state)
            raise
        return self._checked(connection, conn_params, state)

    def _try_server(self, conn_params: dict[str, Any], state: Breaker) -> None:
        """Connect outside the pool; a server that does not answer opens the breaker."""
        try:
            psycopg.connect(**{**conn_params, "connect_timeout": TRY_TIMEOUT_SECONDS}).close()
        except psycopg.Error as exc:
            state.open(exc)
            raise

    def _checked(self, connection: Any, conn_params: dict[str, Any], state: Breaker) -> Any:
        pool = self.pool
        for _ in range(CHECKOUTS - 1):
            if not has_input(connection):
                return connection
            try:
                ConnectionPool.check_connection(connection)
            except psycopg.Error:
                logger.warning("pooled connection to %s was dropped; testing the pool's others",
                               self.alias)  # fmt: skip
                pool.putconn(connection)  # broken: the pool discards it and makes another
                # A server that went down would keep the pool's next request waiting.
                self._try_server(conn_params, state)
                pool.check()
                connection = pool.getconn()
            else:
                return connection
        return connection
