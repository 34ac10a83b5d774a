"""Extra PostgreSQL servers for the tests of physical shards, started by the suite itself.

Each is the embedded server the project runs without `DATABASE_URL` (the `pgserver` package),
in a folder of its own, so a fresh machine and CI need nothing more than `make test`.
"""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import psutil

from scheduler_site import embedded_db


@dataclass
class Server:
    folder: Path
    url: str = ""

    def start(self) -> str:
        """Start the server (again, after `kill`)."""
        from pgserver.postgres_server import PostgresServer

        # pgserver keeps a handle per folder and would take the killed server for running.
        PostgresServer._instances.pop(embedded_db.pg_dir(self.folder).resolve(), None)
        self.url = embedded_db.ensure_running(self.folder)
        return self.url

    def kill(self) -> None:
        """SIGKILL the postmaster, as a crashed server would go, and wait for its backends to
        notice and exit (the next start needs their shared memory)."""
        pid = int((embedded_db.pg_dir(self.folder) / "postmaster.pid").read_text().split()[0])
        backends = psutil.Process(pid).children()
        os.kill(pid, signal.SIGKILL)
        psutil.wait_procs([psutil.Process(pid), *backends], timeout=30)


@contextmanager
def postgres_servers(count: int) -> Iterator[list[Server]]:
    """Start `count` servers; stop and remove them afterwards."""
    servers = [Server(Path(tempfile.mkdtemp(prefix="cronlease-shard-"))) for _ in range(count)]
    try:
        for server in servers:
            server.start()
        yield servers
    finally:
        for server in servers:
            embedded_db.stop(server.folder)
            shutil.rmtree(server.folder, ignore_errors=True)
