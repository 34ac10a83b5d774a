"""The fault suite's shared set-up: one API server and one reaper for the whole package, a
harness per test (its workers and schedulers, a lease sampler, the invariants at the end).

The API (`uvicorn scheduler_site.asgi:application`) and the reaper (`manage.py reaper
--interval 0.2`) are real processes on the test database, started once, since each costs a few
seconds of start-up on a loaded machine; every scenario starts its own workers and schedulers.
Their connections are named (`faults:web`, `faults:reaper`, `faults:sched:<node>`), so a test
finds them in pg_stat_activity.
"""

from __future__ import annotations

import signal
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest

from apps.jobs.models import JobDefinition
from apps.runs import shards
from apps.runs.shards import CONTROL
from apps.runs.store import NewRun, insert_runs
from apps.teams.models import Team
from tests.conftest import child_database_url, child_shard_env, db_now, make_definition
from tests.faults.helpers import (
    Db,
    LeaseSampler,
    Proc,
    check_invariants,
    free_port,
    freeze,
    frozen,
    install_peak_recorder,
    manage_argv,
    process_env,
    read_ledger,
    remove_peak_recorder,
    uvicorn_argv,
    wait_for,
    wait_http_ok,
    worker_argv,
)

WEB = "faults:web"
REAPER = "faults:reaper"
REAPER_INTERVAL = "0.2"
# Scheduler processes: a tick every 0.2 s, shard leases of 2 s (database clock).
FAST_SCHEDULER = {"SCHEDULER_TICK_SECONDS": "0.2", "SCHEDULER_SHARD_LEASE_SECONDS": "2"}


class Services:
    """The API server and the reaper every scenario shares."""

    def __init__(self, url: str, root: Path, shard_env: dict[str, str]) -> None:
        self.database_url = url
        self.shard_env = shard_env
        self.root = root
        self.data_dir = root / "data"
        self.data_dir.mkdir()
        # With shards on servers of their own, the probes see every shard database too.
        others = [child_database_url(alias) for alias in shards.databases() if alias != CONTROL]
        self.db = Db(url, others=others)
        self.port = free_port()
        self.api_url = f"http://127.0.0.1:{self.port}"
        self.api: Proc | None = None
        self.reaper: Proc | None = None
        self._generation = 0
        self._spawned: list[Proc] = []  # every API server started, stopped at the end

    def env(self, **extra: str) -> dict[str, str]:
        return process_env(self.database_url, self.data_dir, **self.shard_env, **extra)

    def start(self) -> None:
        # Both start at once: Django's start-up is most of the wait.
        self.reaper = Proc(
            "reaper",
            manage_argv("reaper", "--interval", REAPER_INTERVAL),
            self.env(SCHEDULER_APPLICATION_NAME=REAPER),
            self.root,
        )
        self.start_api()
        wait_for(lambda: self.db.backends(REAPER), 90, "the reaper to connect")

    def start_api(self) -> None:
        self.api = self.spawn_api(self.port)
        wait_http_ok(f"{self.api_url}/readyz", self.api)

    def spawn_api(self, port: int) -> Proc:
        self._generation += 1
        proc = Proc(
            f"web-{self._generation}",
            uvicorn_argv(port),
            self.env(SCHEDULER_APPLICATION_NAME=WEB),
            self.root,
        )
        self._spawned.append(proc)
        return proc

    def replace_api(self) -> Callable[[], None]:
        """Start a new API server on a new port now; the returned function waits until it
        answers, stops the old one (SIGTERM) and makes the new one the API from then on."""
        port = free_port()
        new = self.spawn_api(port)

        def switch() -> None:
            assert self.api is not None
            wait_http_ok(f"http://127.0.0.1:{port}/readyz", new)
            self.api.stop()
            self.api, self.port, self.api_url = new, port, f"http://127.0.0.1:{port}"

        return switch

    def reaper_paused(self) -> AbstractContextManager[None]:
        """Freeze the reaper while its connection is idle, so a test can stage a race with a
        reaper of its own without this one taking the expired leases first."""
        assert self.reaper is not None
        return frozen(self.reaper, self.db, REAPER)

    def quiesce(self) -> None:
        """Freeze the API server and the reaper while their connections are idle.

        Between tests the database is flushed (TRUNCATE of every table, one lock after the
        other); a claim or a reap running then would lock the same tables in another order and
        deadlock with it. Frozen processes hold no lock; `resume()` wakes them for the next test
        (a long poll left over from a killed worker resumes too, for a team that is gone).
        """
        for proc, name in ((self.api, WEB), (self.reaper, REAPER)):
            if proc is not None and proc.alive():
                freeze(proc, self.db, name)

    def resume(self) -> None:
        for proc in (self.api, self.reaper):
            if proc is not None:
                proc.signal(signal.SIGCONT)

    def check_alive(self) -> None:
        for proc in (self.api, self.reaper):
            assert proc is not None and proc.alive(), (
                f"{proc.name if proc else '?'} died:\n{proc.output()[-4000:] if proc else ''}"
            )

    def stop(self) -> None:
        for proc in (*self._spawned, self.reaper):
            if proc is not None:
                proc.stop()  # SIGCONT, then SIGTERM


@pytest.fixture(scope="package")
def services(django_db_setup, tmp_path_factory) -> Iterator[Services]:
    services = Services(child_database_url(), tmp_path_factory.mktemp("faults"), child_shard_env())
    install_peak_recorder(services.db)
    try:
        services.start()
        yield services
    finally:
        services.stop()
        for proc in (services.api, services.reaper):
            if proc is not None:
                print(f"--- {proc.name} (last lines)\n{proc.output()[-3000:]}")
        remove_peak_recorder(services.db)
        services.db.close()


class Harness:
    """One scenario: its team and token, the processes it starts, the sampler, the checks."""

    def __init__(self, services: Services, team: Team, token: str, tmp_path: Path) -> None:
        self.services = services
        self.db = services.db
        self.team = team
        self.token = token
        self.tmp = tmp_path
        self.ledger = tmp_path / "ledger.sqlite3"
        self.procs: list[Proc] = []
        self.last_available: datetime | None = None
        services.resume()
        self.db.execute_everywhere("TRUNCATE faults_lease_peak")
        self.sampler = LeaseSampler(self.db.urls).start()

    # -- data ------------------------------------------------------------------------------

    def definition(self, name: str, queue: str, **fields: Any) -> JobDefinition:
        fields.setdefault("retry_base_seconds", 0)
        fields.setdefault("retry_max_seconds", 0)
        return make_definition(self.team, name, queue=queue, **fields)

    def add_runs(
        self, definition: JobDefinition, payloads: list[dict[str, Any]], prefix: str = "r"
    ) -> list[int]:
        """Insert one run per payload, claimable now, in this order (oldest first), after
        every run an earlier call added: two calls a few microseconds apart must not
        interleave their runs' times."""
        start = db_now() - timedelta(seconds=1)
        if self.last_available is not None:
            start = max(start, self.last_available + timedelta(milliseconds=1))
        self.last_available = start + timedelta(milliseconds=len(payloads) - 1)
        runs = [
            NewRun(
                definition.pk,
                "api",
                start + timedelta(milliseconds=i),
                start + timedelta(milliseconds=i),
                f"{definition.name}@{prefix}-{i}",
                payload,
            )
            for i, payload in enumerate(payloads)
        ]
        with shards.using(shards.alias_of_shard(definition.shard)):
            return insert_runs(runs)

    def database_of(self, definition: JobDefinition) -> str:
        """The URL of the database that holds this definition and its runs."""
        return child_database_url(shards.alias_of_shard(definition.shard))

    # -- processes -------------------------------------------------------------------------

    def start(
        self, name: str, argv: list[str], *, base_env: dict[str, str] | None = None, **env: str
    ) -> Proc:
        """Start a process (killed at the end of the test) with the services' environment, or
        `base_env`, plus `env`."""
        proc = Proc(name, argv, {**(base_env or self.services.env()), **env}, self.tmp)
        self.procs.append(proc)
        return proc

    def worker(
        self,
        name: str,
        queue: str,
        *,
        concurrency: int = 2,
        lease: int = 2,
        grace: float = 5,
        wait: int = 1,
        url: str | None = None,
        token: str | None = None,
        **env: str,
    ) -> Proc:
        """Start `python -m cronlease_client run tests.faults.handlers` with worker id `name`."""
        argv = worker_argv(
            url or self.services.api_url,
            token or self.token,
            queue,
            name,
            "--concurrency",
            str(concurrency),
            "--lease-seconds",
            str(lease),
            "--grace-seconds",
            str(grace),
            "--wait-seconds",
            str(wait),
            "--log-level",
            "DEBUG",
        )
        return self.start(name, argv, PLAIN_WORKER_DB=str(self.ledger), **env)

    def scheduler(self, node_id: str, **env: str) -> Proc:
        return self.start(
            node_id,
            manage_argv("scheduler", "--node-id", node_id),
            SCHEDULER_APPLICATION_NAME=f"faults:sched:{node_id}",
            **{**FAST_SCHEDULER, **env},
        )

    def http(self, token: str | None = None, url: str | None = None) -> httpx.Client:
        return httpx.Client(
            base_url=url or self.services.api_url,
            headers={"Authorization": f"Bearer {token or self.token}"},
            timeout=30,
        )

    # -- checks ----------------------------------------------------------------------------

    def effects(self) -> dict[str, dict[str, Any]]:
        return read_ledger(self.ledger)

    def check(self) -> dict[int, int]:
        """Assert the invariants (see helpers.INVARIANTS) and every concurrency limit; return
        the sampled peaks of leased runs by definition id."""
        self.sampler.stop()
        self.services.check_alive()
        return check_invariants(self.db, self.sampler)

    def close(self) -> None:
        self.sampler.stop()
        for proc in self.procs:
            proc.kill()
        for proc in self.procs:
            # Shown by pytest only when the test failed.
            print(f"--- {proc.name} (exit {proc.popen.returncode})\n{proc.output()[-4000:]}")
        self.services.quiesce()


@pytest.fixture
def harness(services, team_a, token_a, tmp_path) -> Iterator[Harness]:
    services.check_alive()
    harness = Harness(services, team_a, token_a, tmp_path)
    try:
        yield harness
    finally:
        harness.close()
