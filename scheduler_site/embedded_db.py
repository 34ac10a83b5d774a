"""The embedded PostgreSQL used when no DATABASE_URL is configured.

The server comes from the `pgserver` package and keeps its data under `<data dir>/pg` (`.data/pg`). It is started
once and left running, so every process of the project on this machine (web, scheduler, workers,
tests) shares it; pgserver serialises concurrent start-ups with an inter-process lock.
"""

from __future__ import annotations

import logging
import warnings
from pathlib import Path

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


def stop(data_dir: Path) -> bool:
    """Stop the embedded server if one runs for this checkout; return whether one was stopped."""
    import subprocess

    import pgserver

    pgdata = pg_dir(data_dir)
    if not (pgdata / "postmaster.pid").exists():
        return False
    pg_ctl = Path(pgserver.__file__).parent / "pginstall" / "bin" / "pg_ctl"
    subprocess.run([str(pg_ctl), "-D", str(pgdata), "-m", "fast", "stop"], check=False)
    return True
