"""The embedded PostgreSQL used when no DATABASE_URL is configured.

The server comes from the `pgserver` package and keeps its data under `<data dir>/pg` (`.data/pg`). It is started
once and left running, so every process of the project on this machine (web, scheduler, workers,
tests) shares it; pgserver serialises concurrent start-ups with an inter-process lock.
"""

from __future__ import annotations

import logging
import os
import signal
import time
import warnings
from pathlib import Path

import psutil

logger = logging.getLogger(__name__)


def pg_dir(data_dir: Path) -> Path:
    return data_dir / "pg"


def ensure_running(data_dir: Path) -> str:
    """Start the embedded server if it is not running and return its connection URL."""
    # pgserver logs every handle it opens and closes, and platformdirs warns about a missing
    # XDG_RUNTIME_DIR on servers: neither is news to the person running the project.
    logging.getLogger("pgserver").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message=".*XDG_RUNTIME_DIR.*")
    import pgserver  # imported lazily: only the embedded mode needs it

    pgdata = pg_dir(data_dir)
    pgdata.parent.mkdir(parents=True, exist_ok=True)
    server = pgserver.get_server(pgdata, cleanup_mode=None)
    return server.get_uri()


def stop(data_dir: Path, timeout: float = 30.0) -> bool:
    """Stop the embedded server if one runs for this checkout; return whether one was stopped."""
    pgdata = pg_dir(data_dir).resolve()  # the server was started with the absolute path
    try:
        pid = int((pgdata / "postmaster.pid").read_text().split()[0])
        # A file left by a crash may name a pid that now belongs to another process.
        process = psutil.Process(pid)
        if process.name() != "postgres" or str(pgdata) not in process.cmdline():
            return False
        # SIGINT is PostgreSQL's fast shutdown, what `pg_ctl stop -m fast` sends. Sent directly:
        # pg_ctl refuses to run as root, and as root pgserver runs the server as its own user.
        os.kill(pid, signal.SIGINT)
    except (OSError, ValueError, IndexError, psutil.Error):
        return False  # no server, or the file outlived it
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    raise TimeoutError(f"The embedded PostgreSQL (pid {pid}) did not stop within {timeout:.0f} s.")
