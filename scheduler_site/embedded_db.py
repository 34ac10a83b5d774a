"""The embedded PostgreSQL used when no DATABASE_URL is configured.

The server comes from the `pgserver` package and keeps its data under `.data/pg`. It is started
once and left running, so every process of the project on this machine (web, scheduler, workers,
tests) shares it; pgserver serialises concurrent start-ups with an inter-process lock.
"""

from __future__ import annotations

import logging
import warnings
from pathlib import Path
from urllib.parse import parse_qs, urlparse

logger = logging.getLogger(__name__)


def data_dir(base_dir: Path) -> Path:
    return base_dir / ".data" / "pg"


def ensure_running(base_dir: Path) -> str:
    """Start the embedded server if it is not running and return its connection URL."""
    # pgserver logs every handle it opens and closes, and platformdirs warns about a missing
    # XDG_RUNTIME_DIR on servers: neither is news to the person running the project.
    logging.getLogger("pgserver").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message=".*XDG_RUNTIME_DIR.*")
    import pgserver  # imported lazily: only the embedded mode needs it

    pgdata = data_dir(base_dir)
    pgdata.parent.mkdir(parents=True, exist_ok=True)
    server = pgserver.get_server(pgdata, cleanup_mode=None)
    return server.get_uri()


def stop(base_dir: Path) -> bool:
    """Stop the embedded server if one runs for this checkout; return whether one was stopped."""
    import subprocess

    import pgserver

    pgdata = data_dir(base_dir)
    if not (pgdata / "postmaster.pid").exists():
        return False
    pg_ctl = Path(pgserver.__file__).parent / "pginstall" / "bin" / "pg_ctl"
    subprocess.run([str(pg_ctl), "-D", str(pgdata), "-m", "fast", "stop"], check=False)
    return True


def socket_host(url: str) -> str | None:
    """Return the socket directory of a pgserver URL (`postgresql://postgres:@/db?host=/dir`)."""
    query = parse_qs(urlparse(url).query)
    hosts = query.get("host")
    return hosts[0] if hosts else None
