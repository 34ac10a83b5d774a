"""Statements waiting on a server that has stopped answering, cut short.

A server that stops without closing its sockets is not seen by the client: its host's kernel
still acknowledges what is sent (a postmaster and its backends stopped, or stuck on a disk that
hangs), so the TCP connection looks healthy, and the server's own bounds (`lock_timeout`,
`statement_timeout`) never fire, since the server is what enforces them. A statement sent there
waits for as long as the server is stopped. With shards on servers of their own that was every
request and every scheduler: a lease request claims on each database in turn, so one stopped
server held every worker's leases from every other database, `/readyz` and `/metrics`, and the
schedulers' loops, whose shard leases then lapsed on every shard.

So every statement, commit and rollback is noted while it waits (`begin`, `end`). A thread looks
twice a second: when a statement has waited `STALL_SECONDS` on a database, it tries that server
with a connection of its own (at most every `STALL_SECONDS` a database). A server that answers,
even with an error (too many connections), is working (a long statement, a lock wait: each has
its own bound), and nothing is done. One that does not answer within `TRY_TIMEOUT_SECONDS` (or
refuses the connection) is taken as stopped: every statement waiting on it
has its socket shut down, so it fails at once as if the connection had been lost (an
OperationalError: a 503 naming its shards, the scheduler's tick for those shards failed), and
the server's `Breaker` (web processes) refuses it at once until it answers again.

A connection that cannot be made is not this module's: `connect_timeout` bounds it
(scheduler_site/database.py). Django's health check of a daemon's connection (`is_usable`),
which runs its statement past the execute wrappers, is noted too (base.py).
"""

from __future__ import annotations

import logging
import os
import re
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import psycopg

logger = logging.getLogger(__name__)

# How long a statement waits before its server is asked whether it still answers, and the
# least time between two such tries of one server.
STALL_SECONDS = 3.0
# The try's wait for the server's answer (libpq's least connect_timeout).
TRY_TIMEOUT_SECONDS = 2
LOOK_EVERY_SECONDS = 0.5
# The severities of the messages a server sends, as libpq writes them into a connection error.
SERVER_SAID = re.compile(r"\b(FATAL|PANIC|ERROR):")


class _Waiting:
    __slots__ = ("alias", "connection", "since")

    def __init__(self, alias: str, connection: Any) -> None:
        self.alias = alias
        self.connection = connection
        self.since = time.monotonic()


# The statements waiting now, by an id of their own. Written by the threads that wait (one
# insertion and one deletion, atomic in CPython), read by the watching thread from a copy.
_waiting: dict[int, _Waiting] = {}
_params: dict[str, dict[str, Any]] = {}  # how to reach each database, for the try
_tried: dict[str, float] = {}  # when each database was last tried
_on_stopped: list[Callable[[str, BaseException], None]] = []
_start_lock = threading.Lock()
_watcher: threading.Thread | None = None


def know(alias: str, params: dict[str, Any]) -> None:
    """How to reach database `alias` (its connection parameters), for the watcher's try."""
    _params[alias] = params


def when_stopped(call: Callable[[str, BaseException], None]) -> None:
    """Call `call(alias, failure)` when a database is found stopped (the breaker opens)."""
    _on_stopped.append(call)


def begin(alias: str, connection: Any) -> int:
    """Note a statement (or commit) of `connection` to `alias` waiting from now; `end` it with
    the number returned. Two calls instead of a context manager: every statement pays them
    (0.6 µs against 2.5 µs, measured here; the whole execute wrapper about 1 µs a statement,
    some 7 µs of a lease request's 2 ms)."""
    if _watcher is None:
        _start()
    waiting = _Waiting(alias, connection)
    key = id(waiting)
    _waiting[key] = waiting
    return key


def end(key: int) -> None:
    del _waiting[key]


def _start() -> None:
    global _watcher
    with _start_lock:
        if _watcher is None or not _watcher.is_alive():
            _watcher = threading.Thread(target=_watch, name="stalled-statements", daemon=True)
            _watcher.start()


def _watch() -> None:
    while True:
        time.sleep(LOOK_EVERY_SECONDS)
        try:
            look()
        except Exception:  # noqa: BLE001 - the watcher must outlive any one look
            logger.exception("looking for statements stalled on a stopped server failed")


def look(now: float | None = None) -> list[str]:
    """Try the servers a statement has waited on past STALL_SECONDS; cut the statements of
    those that do not answer. Return their aliases."""
    now = time.monotonic() if now is None else now
    stalled = {
        waiting.alias for waiting in list(_waiting.values()) if now - waiting.since >= STALL_SECONDS
    }
    stopped = []
    for alias in sorted(stalled):
        if now - _tried.get(alias, -STALL_SECONDS) < STALL_SECONDS or alias not in _params:
            continue
        _tried[alias] = now
        failure = _try(alias)
        if failure is None:
            continue
        stopped.append(alias)
        cut = _cut(alias)
        logger.warning(
            "database %s does not answer (%s): %d statements waiting on it cut",
            alias, failure, cut,
        )  # fmt: skip
        for call in _on_stopped:
            call(alias, failure)
    return stopped


def _try(alias: str) -> BaseException | None:
    """None when the server answers a new connection, else why not. An error the server sent
    (too many connections, starting up, a refused password) is an answer: a server at its
    connection limit is busy, not stopped, and its statements are not cut. libpq gives a
    connection's errors no SQLSTATE; the server's carry their severity (`FATAL:`), its own
    (refused, timed out) none."""
    try:
        psycopg.connect(**{**_params[alias], "connect_timeout": TRY_TIMEOUT_SECONDS}).close()
    except psycopg.Error as exc:
        return None if SERVER_SAID.search(str(exc)) else exc
    return None


def _cut(alias: str) -> int:
    """Shut down the sockets of the statements waiting on `alias`; return how many. The
    waiting thread then reads the end of the stream: psycopg raises OperationalError, and the
    connection is discarded (pooled) or replaced at its next use."""
    cut = 0
    for key, waiting in list(_waiting.items()):
        if waiting.alias != alias or waiting.connection is None:
            continue
        try:
            descriptor = os.dup(waiting.connection.pgconn.socket)
        except (OSError, AttributeError, psycopg.Error):  # closed meanwhile: nothing to cut
            continue
        with socket.socket(fileno=descriptor) as sock:
            # Still waiting after the copy, its connection cannot have been closed (its thread
            # is in the wait), so the descriptor copied is its socket, not a number reused.
            if key not in _waiting:
                continue
            try:
                sock.shutdown(socket.SHUT_RDWR)
                cut += 1
            except OSError:
                pass
    return cut
