"""Extra PostgreSQL servers for the tests of physical shards, started by the suite itself.

Each is the embedded server the project runs without `DATABASE_URL` (the `pgserver` package),
in a folder of its own, so a fresh machine and CI need nothing more than `make test`.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from scheduler_site import embedded_db


@contextmanager
def postgres_servers(count: int) -> Iterator[list[str]]:
    """Start `count` servers; yield their URLs; stop and remove them afterwards."""
    folders = [Path(tempfile.mkdtemp(prefix="cronlease-shard-")) for _ in range(count)]
    try:
        yield [embedded_db.ensure_running(folder) for folder in folders]
    finally:
        for folder in folders:
            embedded_db.stop(folder)
            shutil.rmtree(folder, ignore_errors=True)
