"""The embedded PostgreSQL used when no DATABASE_URL is configured.

The server comes from the `pgserver` package and keeps its data under `<data dir>/pg` (`.data/pg`). It is started
once and left running, so every process of the project on this machine (web, scheduler, workers,
tests) shares it; pgserver serialises concurrent start-ups with an inter-process lock.

`manage.py dev --shard-databases N` starts N more the same way, in `<data dir>/pg-shard-1` … `-N`
(`shard_server`), for shards on servers of their own on one machine; `stop_all` stops them all.
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


MAIN = "pg"
SHARD_SERVER_PREFIX = "pg-shard-"


def shard_server(number: int) -> str:
    """The folder name of the `number`-th (from 1) extra server of `manage.py dev`."""
    return f"{SHARD_SERVER_PREFIX}{number}"


def pg_dir(data_dir: Path, name: str = MAIN) -> Path:
    return data_dir / name


def ensure_running(data_dir: Path, name: str = MAIN) -> str:
    """Start the embedded server in `data_dir/name` if it is not running and return its
    connection URL."""
    # pgserver logs every handle it opens and closes, and platformdirs warns about a missing
    # XDG_RUNTIME_DIR on servers: neither is news to the person running the project.
    logging.getLogger("pgserver").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message=".*XDG_RUNTIME_DIR.*")
    import pgserver  # imported lazily: only the embedded mode needs it

    pgdata = pg_dir(data_dir, name)
    pgdata.parent.mkdir(parents=True, exist_ok=True)
    server = pgserver.get_server(pgdata, cleanup_mode=None)
    return server.get_uri()


def stop(data_dir: Path, timeout: float = 30.0, name: str = MAIN) -> bool:
    """Stop the embedded server in `data_dir/name` if one runs; return whether one was stopped."""
    pgdata = pg_dir(data_dir, name).resolve()  # the server was started with the absolute path
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


def stop_all(data_dir: Path, timeout: float = 30.0) -> list[str]:
    """Stop the main embedded server and every extra one of `manage.py dev`; return the names of
    those that were running."""
    extra = sorted(path.name for path in data_dir.glob(f"{SHARD_SERVER_PREFIX}*"))
    return [name for name in [MAIN, *extra] if stop(data_dir, timeout, name)]
