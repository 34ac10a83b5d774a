"""Django's PostgreSQL backend, with pooled connections checked out without a round trip and
without a stall.

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
"""

from __future__ import annotations

import logging
import select
from typing import Any

import psycopg
from django.db.backends.postgresql import base
from psycopg_pool import ConnectionPool

logger = logging.getLogger(__name__)

# A connection taken after the pool has tested every idle one is live or new; the bound only
# keeps a server that drops connections as fast as they are made from looping here.
CHECKOUTS = 3


def has_input(connection: psycopg.Connection) -> bool:
    """Whether the server has sent anything on this (idle) connection."""
    poller = select.poll()  # not select(): a web process may hold descriptors past 1 024
    poller.register(connection.fileno(), select.POLLIN)
    return bool(poller.poll(0))


class DatabaseWrapper(base.DatabaseWrapper):
    def get_new_connection(self, conn_params: dict[str, Any]) -> Any:
        connection = super().get_new_connection(conn_params)
        pool = self.pool
        if pool is None:
            return connection
        for _ in range(CHECKOUTS - 1):
            if not has_input(connection):
                return connection
            try:
                ConnectionPool.check_connection(connection)
            except psycopg.Error:
                logger.warning("pooled connection to %s was dropped; testing the pool's others",
                               self.alias)  # fmt: skip
                pool.putconn(connection)  # broken: the pool discards it and makes another
                pool.check()
                connection = pool.getconn()
            else:
                return connection
        return connection
