"""Django's PostgreSQL backend, with pooled connections checked out without a stall.

Django has psycopg's pool check each connection it hands out (`CONN_HEALTH_CHECKS`), and the
pool, when a check fails, waits before it tries the next one: 1 s, then 2, 4, 8… After a
PostgreSQL restart or failover every idle connection of the pool is dead, so a request could
wait seconds through them one by one (a long poll after its server's connections were cut took
8 s to see a run: tests/faults/test_connections.py). Here the first dead connection found makes
the pool test every idle one at once, and the request takes a live or new one straight away.
"""

from __future__ import annotations

import logging
from typing import Any

import psycopg
from django.db.backends.postgresql import base
from psycopg_pool import ConnectionPool

logger = logging.getLogger(__name__)

# A connection taken after the pool has tested every idle one is live or new; the bound only
# keeps a server that drops connections as fast as they are made from looping here.
CHECKOUTS = 3


class DatabaseWrapper(base.DatabaseWrapper):
    def get_new_connection(self, conn_params: dict[str, Any]) -> Any:
        connection = super().get_new_connection(conn_params)
        pool = self.pool
        if pool is None:
            return connection
        for _ in range(CHECKOUTS - 1):
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
