"""Extra PostgreSQL servers for the tests of physical shards, started by the suite itself.

Each is the embedded server the project runs without `DATABASE_URL` (the `pgserver` package),
in a folder of its own, so a fresh machine and CI need nothing more than `make test`.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
import time
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
        """SIGKILL the server's processes, as a machine that died would take them, and wait
        until they have exited (the next start needs their shared memory).

        Exited, not reaped: adopted by the machine's first process, they stay zombies until it
        reaps them, which took up to 30 s in the suite. A zombie's pid still answers, so the lock
        files naming the postmaster go too: the next start would take it for a server running."""
        folder = embedded_db.pg_dir(self.folder)
        postmaster = psutil.Process(int((folder / "postmaster.pid").read_text().split()[0]))
        processes = [postmaster, *postmaster.children()]
        for process in processes:
            with contextlib.suppress(psutil.NoSuchProcess):
                process.kill()
        deadline = time.monotonic() + 30
        while any(map(_running, processes)) and time.monotonic() < deadline:
            time.sleep(0.02)
        for lock in [folder / "postmaster.pid", *folder.glob(".s.PGSQL.*.lock")]:
            lock.unlink(missing_ok=True)

    @contextmanager
    def frozen(self) -> Iterator[None]:
        """The server's processes stopped (SIGSTOP) for the block, then continued: its host's
        kernel still takes what is sent to it, but nothing answers, as a server stuck on a disk
        that hangs."""
        folder = embedded_db.pg_dir(self.folder)
        postmaster = psutil.Process(int((folder / "postmaster.pid").read_text().split()[0]))
        processes = [postmaster, *postmaster.children()]
        for process in processes:
            process.suspend()
        try:
            yield
        finally:
            for process in processes:
                with contextlib.suppress(psutil.NoSuchProcess):
                    process.resume()


def _running(process: psutil.Process) -> bool:
    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


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
