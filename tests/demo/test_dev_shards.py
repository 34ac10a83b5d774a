"""`manage.py dev --shard-databases 2`: the sharded layout on one machine, started and stopped
as a person would, twice (the second start finds the servers and the demo of the first).

No DATABASE_URL, so the command starts its own control database and two shard servers in a
fresh data folder; /readyz must name both shard databases, the demo's definitions must be on
the server of their shard and none on the control database, SIGINT must stop every child, and
the servers outlive the command as the main embedded one does until `make stop-db` (stop_all).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import psycopg
import pytest
from django.core.management import CommandError, call_command

from apps.demo.data import DEMO_JOBS
from apps.jobs.schedule import shard_for
from scheduler_site import embedded_db, shardmap
from tests.demo.test_dev_command import ROOT, alive, children_of, free_port
from tests.waiting import wait_for

# What `spread` makes of 16 shards on two servers.
RANGES = {"pg-shard-1": range(0, 8), "pg-shard-2": range(8, 16)}


class Dev:
    """One `manage.py dev --shard-databases 2 --no-worker` process and what it printed."""

    def __init__(self, data: Path) -> None:
        self.port = free_port()
        env = {
            key: value
            for key, value in os.environ.items()
            if key not in {"DATABASE_URL", "TEST_DATABASE_NAME", "SCHEDULER_SHARD_DATABASES"}
        }
        env.update({"SCHEDULER_DATA_DIR": str(data), "PYTHONUNBUFFERED": "1"})
        self.process = subprocess.Popen(
            [sys.executable, "manage.py", "dev", "--shard-databases", "2", "--no-worker"]
            + ["--port", str(self.port)],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.output: list[str] = []
        self.reader = threading.Thread(
            target=lambda: self.output.extend(self.process.stdout), daemon=True
        )
        self.reader.start()

    def ready(self) -> dict:
        """Wait for the banner and for /readyz to answer with both shard databases reachable."""
        wait_for(lambda: self.running() and self.printed(r"Token:\s+(\S+)"), 180, "the banner")

        def answer() -> dict | None:
            try:
                return httpx.get(f"http://127.0.0.1:{self.port}/readyz", timeout=5).json()
            except (httpx.HTTPError, ValueError):
                return None

        return wait_for(
            lambda: (
                self.running()
                and (body := answer())
                and len(body.get("shardDatabases", ())) == 2
                and body
            ),
            60,
            "/readyz with two shard databases",
        )

    def running(self) -> bool:
        """True while the command runs; a command that has exited fails the test at once, with
        what it printed."""
        if self.process.poll() is None:
            return True
        self.reader.join(5)
        raise AssertionError(f"manage.py dev exited ({self.process.returncode}):\n{self.tail()}")

    def printed(self, pattern: str) -> str | None:
        return next((m.group(1) for line in self.output if (m := re.search(pattern, line))), None)

    def tail(self) -> str:
        return "".join(self.output[-40:])

    def interrupt(self) -> None:
        """SIGINT, as Ctrl-C; the command and every child it started must exit."""
        started = children_of(self.process.pid)
        assert len(started) >= 2, started  # web, scheduler
        self.process.send_signal(signal.SIGINT)
        assert self.process.wait(timeout=60) == 0, self.tail()
        wait_for(lambda: not any(alive(pid) for pid in started), 10, "the children to exit")


def postmaster(data: Path, name: str) -> int:
    return int((embedded_db.pg_dir(data, name) / "postmaster.pid").read_text().split()[0])


def definitions(url: str) -> list[str]:
    with psycopg.connect(url) as conn:
        return [name for (name,) in conn.execute("SELECT name FROM jobs_jobdefinition")]


def test_spread_gives_each_server_one_range_and_the_control_database_none():
    urls = [f"postgresql://db-{n}/sched" for n in range(3)]
    text = shardmap.spread(16, urls)
    assert text == f"0-4={urls[0]};5-9={urls[1]};10-15={urls[2]}"
    placed = shardmap.parse(text, 16, "postgresql://control/sched")
    assert "default" not in placed.aliases and len(placed.urls) == 3
    assert shardmap.parse(
        shardmap.spread(16, urls[:1]), 16, "postgresql://control/sched"
    ).aliases == (("shards_1",) * 16)


@pytest.mark.parametrize("count", [-1, 17])
def test_a_count_outside_the_shards_is_refused_before_any_server_starts(count, tmp_path, settings):
    settings.DATA_DIR = tmp_path
    with pytest.raises(CommandError, match="from 1 to 16"):
        call_command("dev", shard_databases=count)
    assert not list(tmp_path.iterdir())


def test_a_map_given_already_is_not_overridden(monkeypatch, tmp_path, settings):
    settings.DATA_DIR = tmp_path
    monkeypatch.setenv("SCHEDULER_SHARD_DATABASES", "0-15=postgresql://db/sched")
    with pytest.raises(CommandError, match="set already"):
        call_command("dev", shard_databases=2)
    assert not list(tmp_path.iterdir())


@pytest.mark.slow
def test_dev_runs_the_shards_on_servers_of_their_own_and_stops_cleanly(tmp_path):
    data = tmp_path / "data"
    started: list[Dev] = []
    try:
        for start in ("first", "again"):
            dev = Dev(data)
            started.append(dev)
            body = dev.ready()
            assert body["status"] == "ok", body
            assert [(d["shards"], d["reachable"]) for d in body["shardDatabases"]] == [
                ("0-7", True),
                ("8-15", True),
            ], body
            shard_map = dev.printed(r"SCHEDULER_SHARD_DATABASES='([^']+)'")
            assert shard_map is not None, dev.tail()
            # Each server holds the demo jobs of its range, once, even after a restart; the
            # control database holds none.
            urls = dict(re.findall(r"(\d+-\d+)=([^;]+)", shard_map))
            for (span, url), (folder, shards) in zip(urls.items(), RANGES.items(), strict=True):
                assert span == f"{shards[0]}-{shards[-1]}" and folder in url, shard_map
                expected = sorted(j.name for j in DEMO_JOBS if shard_for(j.name) in shards)
                assert sorted(definitions(url)) == expected, (start, folder)
            assert definitions(embedded_db.ensure_running(data)) == [], start

            dev.interrupt()
            # Like the main embedded server, the shard servers outlive the command.
            assert all(alive(postmaster(data, name)) for name in ["pg", *RANGES]), start

        postmasters = [postmaster(data, name) for name in ["pg", *RANGES]]
        assert embedded_db.stop_all(data) == ["pg", *RANGES]
        assert not any(alive(pid) for pid in postmasters)
    finally:
        for dev in started:
            for pid in children_of(dev.process.pid):
                os.kill(pid, signal.SIGKILL)
            if dev.process.poll() is None:
                dev.process.kill()
        embedded_db.stop_all(data)
