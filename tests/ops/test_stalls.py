"""The watcher of statements stalled on a server that stopped answering
(scheduler_site/postgresql/stalls.py): what counts as an answer when it tries the server."""

from __future__ import annotations

import os
import socket
from contextlib import closing

import pytest
from django.db import connection

from scheduler_site.postgresql import stalls

pytestmark = pytest.mark.django_db(transaction=True)


def test_a_server_that_answers_with_an_error_is_busy_not_stopped():
    """A server at its connection limit answered the try with an error: it was taken for
    stopped, and every statement waiting on it (a long one, a lock wait) was cut."""
    role = f"stall_busy_{os.getpid()}"
    with connection.cursor() as cursor:
        cursor.execute(f"CREATE ROLE {role} LOGIN CONNECTION LIMIT 0")
    try:
        params = {**connection.get_connection_params(), "user": role}
        stalls.know("busy", params)
        assert stalls._try("busy") is None
        with closing(socket.socket()) as probe:  # a port nothing listens on: no answer
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        stalls.know("gone", {**params, "host": "127.0.0.1", "port": port})
        assert stalls._try("gone") is not None
    finally:
        with connection.cursor() as cursor:
            cursor.execute(f"DROP ROLE {role}")
