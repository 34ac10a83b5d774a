"""Builders and process helpers shared by the scheduler tests."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from datetime import datetime
from pathlib import Path
from typing import Any

from django.conf import settings
from django.db import connection

from apps.jobs import schedule as sched
from apps.jobs.models import JobDefinition
from apps.teams.models import Team
from tests.conftest import child_database_url
from tests.waiting import wait_for  # noqa: F401 - shared by this package's tests

REPO = Path(__file__).resolve().parents[2]


def db_now() -> datetime:
    with connection.cursor() as cursor:
        cursor.execute("SELECT now()")
        return cursor.fetchone()[0]


def floor_minute(moment: datetime) -> datetime:
    return moment.replace(second=0, microsecond=0)


def a_team(slug: str = "sched") -> Team:
    return Team.objects.get_or_create(slug=slug, defaults={"name": slug.title()})[0]


def names_in_shard(shard: int, count: int, prefix: str = "test.job") -> list[str]:
    """Return `count` job names that hash to `shard`."""
    names: list[str] = []
    i = 0
    while len(names) < count:
        name = f"{prefix}-{i}"
        if sched.shard_for(name, settings.SCHEDULER_SHARD_COUNT) == shard:
            names.append(name)
        i += 1
    return names


def a_definition(
    name: str, schedule: dict[str, Any], next_due_at: datetime | None, **fields: Any
) -> JobDefinition:
    return JobDefinition.objects.create(
        name=name,
        team=fields.pop("team", None) or a_team(),
        schedule=schedule,
        next_due_at=next_due_at,
        shard=sched.shard_for(name, settings.SCHEDULER_SHARD_COUNT),
        **fields,
    )


def leases_by_owner() -> dict[str, list[int]]:
    """Return the live shard leases (expires_at > now()) grouped by owner."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT owner, shard FROM scheduler_shardlease WHERE owner <> '' AND expires_at > now()"
            " ORDER BY shard"
        )
        owners: dict[str, list[int]] = {}
        for owner, shard in cursor.fetchall():
            owners.setdefault(owner, []).append(shard)
        return owners


class SchedulerProcess:
    """A `manage.py scheduler` subprocess on the test database, logging to a file."""

    def __init__(self, node_id: str, log_dir: Path, *args: str, **env: str) -> None:
        self.node_id = node_id
        self.log_path = log_dir / f"{node_id}.log"
        full_env = {
            **os.environ,
            "DATABASE_URL": child_database_url(),
            "PYTHONUNBUFFERED": "1",
            "SCHEDULER_APPLICATION_NAME": f"scheduler:test:{node_id}",
            **env,
        }
        self._log = self.log_path.open("wb")
        self.proc = subprocess.Popen(
            [sys.executable, "manage.py", "scheduler", "--node-id", node_id, *args],
            cwd=REPO,
            env=full_env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )

    def signal(self, signum: int) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signum)

    def wait(self, timeout: float) -> int:
        return self.proc.wait(timeout=timeout)

    def stop(self) -> None:
        """Make sure the process is gone (SIGKILL if it does not go on SIGTERM)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)
        self._log.close()

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")
