"""Shared actors and helpers. Every test talks to a real PostgreSQL; API tests over real HTTP."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import quote

import httpx
import psycopg
import pytest
from django.conf import settings
from django.core.files.storage import FileSystemStorage
from django.db import connection, connections

from apps.jobs.models import JobDefinition
from apps.jobs.schedule import shard_for
from apps.runs import shards, store
from apps.runs.leasing import LeaseRequest, claim_or_wait
from apps.runs.models import PRIORITIES, Run
from apps.runs.store import Lease, NewRun, insert_runs
from apps.teams.models import ApiToken, Team
from scheduler_site import shardmap
from tests import flush, shard_layout
from tests.servers import Server

M = TypeVar("M")
REPO = Path(__file__).resolve().parents[1]

flush.install()


def unavailable(reason: str) -> None:
    """CI must run the tests that need a service (Redis); elsewhere a missing one skips them."""
    if os.environ.get("CI") == "true":
        pytest.fail(reason)
    pytest.skip(reason)


def redis_test_url(kind: int) -> str:
    """A Redis database of this test process's own (8 and 9, then two more per pytest-xdist
    worker): every test that uses one flushes it."""
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)
    return f"redis://127.0.0.1:6379/{8 + kind + 2 * worker}"


@contextmanager
def flushed_redis(url: str) -> Iterator[Any]:
    """A client of the Redis database at `url`, flushed before and after; unavailable() when
    Redis cannot be reached."""
    import redis

    client = redis.Redis.from_url(url, socket_connect_timeout=2, socket_timeout=5)
    try:
        client.ping()
    except redis.RedisError as exc:
        client.close()
        unavailable(f"Redis is unreachable at {url}: {exc}")
    client.flushdb()
    try:
        yield client
    finally:
        client.flushdb()
        client.close()


def child_database_url(alias: str = "default") -> str:
    """A URL of the database this test uses (the test database, not the configured one), for
    the processes a test starts; the embedded server listens on a socket directory."""
    db = connections[alias].settings_dict
    auth = quote(db["USER"] or "", safe="")
    if db["PASSWORD"]:
        auth += ":" + quote(db["PASSWORD"], safe="")
    host = db["HOST"] or "127.0.0.1"
    if host.startswith("/"):
        port = f"&port={db['PORT']}" if db["PORT"] else ""
        return f"postgresql://{auth}@/{quote(db['NAME'])}?host={quote(host, safe='/')}{port}"
    port = f":{db['PORT']}" if db["PORT"] else ""
    return f"postgresql://{auth}@{host}{port}/{quote(db['NAME'])}"


def child_shard_env() -> dict[str, str]:
    """The shard map of the test databases, for the processes a test starts (none with every
    shard on the control database)."""
    if not shards.physical():
        return {}
    urls = {alias: child_database_url(alias) for alias in shards.databases()}
    aliases = tuple(shards.alias_of_shard(n) for n in range(settings.SCHEDULER_SHARD_COUNT))
    return {"SCHEDULER_SHARD_DATABASES": shardmap.render(aliases, urls)}


def _manage_env(env: dict[str, str]) -> dict[str, str]:
    # The browser tests allow sync ORM calls in their event loop; a deployment must not.
    environment = {k: v for k, v in os.environ.items() if k != "DJANGO_ALLOW_ASYNC_UNSAFE"}
    environment.update(DATABASE_URL=child_database_url(), **child_shard_env())
    environment.update(env)
    return environment


def manage(*args: str, timeout: float = 60, **env: str) -> subprocess.CompletedProcess:
    """`manage.py` in a process of its own, as an operator runs it: on this test's databases
    (`env` sets more variables, or others), its output captured."""
    return subprocess.run(
        [sys.executable, "manage.py", *args],
        cwd=REPO,
        env=_manage_env(env),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def manage_started(*args: str, **env: str) -> subprocess.Popen:
    """`manage`, started: its output read line by line as it comes (stderr with stdout)."""
    return subprocess.Popen(
        [sys.executable, "manage.py", *args],
        cwd=REPO,
        env=_manage_env({"PYTHONUNBUFFERED": "1", **env}),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def other_session(**options) -> psycopg.Connection:
    """A session of its own on the test database, as another client's would be."""
    return psycopg.connect(child_database_url(), **options)


@pytest.fixture(scope="session")
def ready_listener(django_db_setup) -> Iterator[None]:
    """The long-poll listener holds a connection to the test database; close it before teardown."""
    yield
    from apps.runs.waiting import listener

    listener.stop()


@pytest.fixture(autouse=True)
def _close_listener_with_live_server(request) -> None:
    """Any test with a live server may long-poll: make sure the listener closes before teardown."""
    if "live_server" in request.fixturenames:
        request.getfixturevalue("ready_listener")


@pytest.fixture(autouse=True)
def _fresh_token_cache() -> Iterator[None]:
    """Tokens are cached per process for a few seconds; each test starts without that memory."""
    from apps.api.auth import forget_cached_tokens

    forget_cached_tokens()
    yield
    forget_cached_tokens()


@pytest.fixture(autouse=True)
def _fresh_control_state() -> None:
    """Claims keep the control database's teams, paused and rate-limited queues for a second
    (apps/runs/leasing.py `control_state`); each test starts without that memory, as a new
    process would, since tests write those rows straight through the ORM."""
    from apps.runs.leasing import control_state

    control_state.forget()


@pytest.fixture
def team_a(db) -> Team:
    return Team.objects.create(slug="team-a", name="Team A")


@pytest.fixture
def team_b(db) -> Team:
    return Team.objects.create(slug="team-b", name="Team B")


@pytest.fixture
def token_a(team_a) -> str:
    """Team A's token with both scopes."""
    return ApiToken.issue(team_a, ["worker", "manage"])[1]


@pytest.fixture
def worker_token_a(team_a) -> str:
    return ApiToken.issue(team_a, ["worker"])[1]


@pytest.fixture
def token_b(team_b) -> str:
    return ApiToken.issue(team_b, ["worker", "manage"])[1]


class Api:
    """A small HTTP client for the live server, bound to one bearer token."""

    def __init__(self, base_url: str, token: str | None) -> None:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.http = httpx.Client(base_url=base_url, headers=headers, timeout=30)

    def get(self, path: str, **kwargs) -> httpx.Response:
        return self.http.get(path, **kwargs)

    def post(self, path: str, json=None, **kwargs) -> httpx.Response:
        return self.http.post(path, json=json, **kwargs)

    def put(self, path: str, json=None, **kwargs) -> httpx.Response:
        return self.http.put(path, json=json, **kwargs)

    def patch(self, path: str, json=None, **kwargs) -> httpx.Response:
        return self.http.patch(path, json=json, **kwargs)

    def delete(self, path: str, **kwargs) -> httpx.Response:
        return self.http.delete(path, **kwargs)

    def lease(
        self, queues: list[str], max_runs: int = 10, worker: str = "test-worker", **extra
    ) -> list[dict]:
        response = self.post(
            "/api/v1/leases", {"queues": queues, "max": max_runs, "workerId": worker, **extra}
        )
        assert response.status_code == 200, response.text
        return response.json()["leases"]


@pytest.fixture
def api_a(live_server, token_a, ready_listener) -> Iterator[Api]:
    api = Api(live_server.url, token_a)
    yield api
    api.http.close()


@pytest.fixture
def api_b(live_server, token_b, ready_listener) -> Iterator[Api]:
    api = Api(live_server.url, token_b)
    yield api
    api.http.close()


def make_definition(team: Team, name: str, **fields) -> JobDefinition:
    """A definition with no schedule (runs come from the test), stored directly in its shard's
    database."""
    priority = fields.pop("priority", "default")
    with shards.using(shards.alias_of_shard(shard_for(name))):
        return JobDefinition.objects.create(
            team=team,
            name=name,
            schedule=fields.pop("schedule", {}),
            queue=fields.pop("queue", "default"),
            priority=PRIORITIES[priority],
            shard=shard_for(name),
            **fields,
        )


def claim(
    *,
    queues: list[str],
    max_runs: int,
    worker_id: str,
    lease_seconds: int = 60,
    team_ids: list[int] | None = None,
    jobs: list[str] | None = None,
    wait_seconds: int = 0,
) -> list[Lease]:
    """Claim as a lease request does: from every shard database (apps/runs/leasing.py)."""
    request = LeaseRequest(
        team_id=team_ids[0] if team_ids else 0,
        team_ids=team_ids,
        queues=queues,
        jobs=jobs,
        max_runs=max_runs,
        worker_id=worker_id,
        lease_seconds=lease_seconds,
        wait_seconds=wait_seconds,
    )
    return claim_or_wait(request, lambda leases: leases)


def names_on_one_database(prefix: str, count: int) -> list[str]:
    """`count` job names (`prefix.N`) whose shards share a database, whatever the layout."""
    by_database: dict[str, list[str]] = {}
    for n in range(10_000):
        name = f"{prefix}.{n}"
        group = by_database.setdefault(shards.alias_of_shard(shard_for(name)), [])
        group.append(name)
        if len(group) == count:
            return group
    raise AssertionError("no database holds enough of these names")


def stored(model: type[M], **filters) -> list[M]:
    """The rows of a sharded model (runs, attempts, definitions) matching `filters`, from every
    shard database, by primary key."""
    found: list[M] = []
    for alias in shards.databases():
        found += model.objects.using(alias).filter(**filters)
    return sorted(found, key=lambda row: row.pk)


def stored_one(model: type[M], **filters) -> M:
    """The one row of a sharded model matching `filters`, from whichever database holds it."""
    (row,) = stored(model, **filters)
    return row


def stored_run(pk: int | None = None) -> Run:
    """The one run (or the run `pk`), from whichever database holds it."""
    return stored_one(Run, **({} if pk is None else {"pk": pk}))


def everywhere(sql: str, params: list | None = None) -> None:
    """Run a statement on every shard database (a test's change to runs wherever they are)."""
    for alias in shards.databases():
        with connections[alias].cursor() as cursor:
            cursor.execute(sql, params)


def db_now() -> datetime:
    with connection.cursor() as cursor:
        cursor.execute("SELECT now()")
        return cursor.fetchone()[0]


def add_ready_runs(
    definition: JobDefinition, count: int, *, prefix: str = "r", age_seconds: float = 1
) -> list[int]:
    """Insert `count` runs of the definition that are claimable now, oldest first."""
    now = db_now()
    runs = [
        NewRun(
            definition.pk,
            "api",
            now - timedelta(seconds=age_seconds) + timedelta(microseconds=i),
            now - timedelta(seconds=age_seconds) + timedelta(microseconds=i),
            f"{prefix}-{i}",
        )
        for i in range(count)
    ]
    ids: list[int] = []
    with shards.using(shards.alias_of_shard(definition.shard)):
        for start in range(0, len(runs), 5000):
            ids.extend(insert_runs(runs[start : start + 5000]))
    return ids


def expire_lease(run_pk: int) -> None:
    """Move a lease's expiry into the past, as if its worker stopped heartbeating."""
    with connections[shards.alias_of_run(run_pk)].cursor() as cursor:
        cursor.execute(
            "UPDATE runs_run SET lease_expires_at = now() - interval '1 second' WHERE id = %s",
            [run_pk],
        )


# --- shards on servers of their own (tests marked `physical`) ---------------------------------


@dataclass
class Layout:
    """The session's shard databases (tests/shard_layout.py): `aliases[i]` on `servers[i]`."""

    servers: list[Server]
    aliases: list[str]

    @contextmanager
    def down(self, index: int) -> Iterator[None]:
        """Server `index` killed for the block, started again after it (its rows kept), and
        this thread's session to it renewed."""
        self.servers[index].kill()
        try:
            yield
        finally:
            self.servers[index].start()
            connections[self.aliases[index]].close()

    def job_on(self, alias: str, team, prefix: str) -> JobDefinition:
        """A definition whose name hashes to a shard of `alias`, stored there."""
        name = next(
            f"{prefix}.{n}" for n in range(1000)
            if shards.alias_of_shard(shard_for(f"{prefix}.{n}")) == alias
        )  # fmt: skip
        with shards.using(alias):
            return JobDefinition.objects.create(
                team=team, name=name, queue="q", shard=shard_for(name), timeout_seconds=600
            )

    def due_every_minute(self, jobs: Iterable[JobDefinition]) -> None:
        """Give each job an every-minute cron whose fire time this minute is due now."""
        for job in jobs:
            with shards.using(shards.alias_of_shard(job.shard)):
                JobDefinition.objects.filter(pk=job.pk).update(
                    schedule={"cron": "* * * * *", "jitterSeconds": 0},
                    next_due_at=db_now().replace(second=0, microsecond=0),
                )

    def new_runs(self, definition: JobDefinition, count: int, tag: str) -> list[int]:
        """Runs of `definition`, claimable now, inserted by the store on its database."""
        with shards.using(shards.alias_of_shard(definition.shard)):
            now = db_now()
            return store.insert_runs(
                [store.NewRun(definition.pk, "api", now, now, f"{tag}{n}") for n in range(count)]
            )

    def dead_runs(
        self, definition: JobDefinition, count: int, tag: str, message: str = "boom"
    ) -> list[Run]:
        """Runs of `definition` made dead in place (as a last failed attempt leaves them)."""
        ids = self.new_runs(definition, count, tag)
        alias = shards.alias_of_shard(definition.shard)
        with connections[alias].cursor() as cursor:
            cursor.execute(
                "UPDATE runs_run SET state = 'dead', attempt = 1, finished_at = now(),"
                " last_error = jsonb_build_object('type', 'RuntimeError', 'message', %s::text)"
                " WHERE id = ANY(%s)",
                [message, ids],
            )
        return list(Run.objects.using(alias).filter(pk__in=ids).order_by("pk"))

    def leased_runs(self, definition: JobDefinition, count: int) -> list[Run]:
        """Runs of `definition` inserted by the store and leased (as a claim would)."""
        alias = shards.alias_of_shard(definition.shard)
        with shards.using(alias):
            ids = store.insert_runs(
                [
                    store.NewRun(definition.pk, "api", definition.created_at,
                                 definition.created_at, f"k{n}")
                    for n in range(count)
                ]
            )  # fmt: skip
            with connections[alias].cursor() as cursor:
                cursor.execute(
                    "UPDATE runs_run SET state = 'leased', attempt = 1, worker_id = 'w',"
                    " fencing_token = nextval('runs_fencing_token'), started_at = now(),"
                    " timeout_at = now() + interval '10 minutes',"
                    " lease_expires_at = now() + interval '1 minute' WHERE id = ANY(%s)",
                    [ids],
                )
                cursor.execute(
                    "INSERT INTO runs_attempt (run_id, number, fencing_token, worker_id,"
                    " leased_at, outcome, error_message, error_type)"
                    " SELECT id, 1, fencing_token, 'w', now(), '', '', '' FROM runs_run"
                    " WHERE id = ANY(%s)",
                    [ids],
                )
            return list(Run.objects.filter(pk__in=ids).order_by("pk"))


@pytest.fixture
def layout() -> Iterator[Layout]:
    servers = list(shard_layout.SERVERS)
    aliases = [f"shards_{n + 1}" for n in range(len(servers))]
    assert shards.physical() and set(aliases) <= set(shards.databases())
    yield Layout(servers, aliases)


class Drain:
    """Worker threads on sessions of their own that claim as lease requests do (from every
    shard database) and complete what they claim, until stopped; `succeeded` counts each run's
    completions answered 200, `failures` what ended a thread. With `reaper`, a thread reaps
    expired leases meanwhile."""

    def __init__(
        self, team: Team, workers: int, *, lease_seconds: int, reaper: bool = False
    ) -> None:
        self.team = team
        self.lease_seconds = lease_seconds
        self.succeeded: dict[int, int] = {}
        self.failures: list[BaseException] = []
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self.threads = [threading.Thread(target=self._work, args=(n,)) for n in range(workers)]
        if reaper:
            self.threads.append(threading.Thread(target=self._reap))

    def __enter__(self) -> Drain:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stopping.set()
        for thread in self.threads:
            thread.join(30)

    def done(self, ids: list[int]) -> int:
        """How many of these runs succeeded so far."""
        with self.lock:
            return sum(1 for pk in ids if pk in self.succeeded)

    def drain_rest(self) -> None:
        """Claim and complete in this thread until nothing is claimable."""
        while leases := claim(
            queues=["q"], max_runs=500, worker_id="rest", team_ids=[self.team.pk]
        ):
            self._complete(leases)

    def _complete(self, leases: list[Lease]) -> None:
        outcomes = store.complete(
            [(lease.id, lease.fencing_token, None) for lease in leases], team_ids=[self.team.pk]
        )
        with self.lock:
            for outcome in outcomes:
                if outcome.status == 200:
                    self.succeeded[outcome.id] = self.succeeded.get(outcome.id, 0) + 1

    def _work(self, index: int) -> None:
        try:
            while not self.stopping.is_set():
                leases = claim(
                    queues=["q"],
                    max_runs=10,
                    worker_id=f"w-{index}",
                    lease_seconds=self.lease_seconds,
                    team_ids=[self.team.pk],
                )
                if leases:
                    self._complete(leases)
                else:
                    time.sleep(0.02)
        except BaseException as exc:  # noqa: BLE001 - the test asserts on `failures`
            self.failures.append(exc)
        finally:
            connections.close_all()  # this thread's session on every database

    def _reap(self) -> None:
        try:
            while not self.stopping.is_set():
                store.reap()
                time.sleep(0.2)
        except BaseException as exc:  # noqa: BLE001 - the test asserts on `failures`
            self.failures.append(exc)
        finally:
            connections.close_all()


def assert_invariants_everywhere() -> None:
    """The fault suite's invariants (tests/faults/helpers.py) on every shard database."""
    from tests.faults.helpers import INVARIANTS

    for alias in shards.databases():
        with connections[alias].cursor() as cursor:
            for rule, sql in INVARIANTS.items():
                cursor.execute(sql)
                assert cursor.fetchall() == [], f"{alias}: {rule}"


# --- a live ASGI server ----------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class LiveServer:
    url: str
    process: subprocess.Popen


@pytest.fixture(scope="session")
def asgi_server(django_db_setup, django_db_blocker) -> Iterator[LiveServer]:
    """uvicorn serving scheduler_site.asgi (HTTP and WebSocket) on the test database."""
    with django_db_blocker.unblock():
        database_url = child_database_url()
    port = _free_port()
    env = {
        **os.environ,
        "DATABASE_URL": database_url,
        "DASHBOARD_LIVE_INTERVAL": "0.3",
        # Notification channels of the browser tests post to receivers on this machine.
        "SCHEDULER_NOTIFY_ALLOW_PRIVATE_TARGETS": "true",
        "SCHEDULER_APPLICATION_NAME": "scheduler:test-dashboard-web",
        "LOG_LEVEL": "WARNING",
        "PYTHONPATH": str(REPO),
    }
    env.pop("DJANGO_ALLOW_ASYNC_UNSAFE", None)
    log = (REPO / "test-artifacts").resolve()
    log.mkdir(exist_ok=True)
    with open(log / "dashboard-server.log", "wb") as out:
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "uvicorn",
                "scheduler_site.asgi:application",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--lifespan",
                "off",
                "--log-level",
                "warning",
            ],
            cwd=REPO,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:
        try:
            if httpx.get(url + "/healthz", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise RuntimeError(f"uvicorn did not start; see {log / 'dashboard-server.log'}")
        time.sleep(0.1)
    yield LiveServer(url, process)
    process.terminate()
    try:
        process.wait(10)
    except subprocess.TimeoutExpired:
        process.kill()


@pytest.fixture
def payload_folder(settings, tmp_path):
    """Payloads kept in storage go to `tmp_path`."""
    yield from _payload_storage(settings, tmp_path, "django.core.files.storage.FileSystemStorage")


class DeletesFailingStorage(FileSystemStorage):
    """A file system storage whose deletes fail while `failing` is set, as a bucket that stops
    answering does (its reads and writes are not the point)."""

    failing = True

    def delete(self, name: str) -> None:
        if DeletesFailingStorage.failing:
            raise OSError("the storage does not answer")
        super().delete(name)


@pytest.fixture
def payload_deletes_failing(settings, tmp_path):
    """Payloads kept in `tmp_path`, whose deletes fail until the test sets
    `DeletesFailingStorage.failing` false."""
    DeletesFailingStorage.failing = True
    yield from _payload_storage(settings, tmp_path, "tests.conftest.DeletesFailingStorage")


def _payload_storage(settings, folder, backend: str):
    from django.core.files.storage import storages

    storages._storages.pop("payloads", None)
    settings.STORAGES = {
        **settings.STORAGES,
        "payloads": {"BACKEND": backend, "OPTIONS": {"location": str(folder)}},
    }
    yield folder
    storages._storages.pop("payloads", None)


def sent_behind_a_change(pk: int, change: str, send: Callable[[], Any]) -> Any:
    """`send()`'s answer, sent while another session holds a row with `change` (a statement on
    the row whose id is its parameter) made and not yet committed, which commits once the call
    waits on the row."""
    from tests.waiting import wait_for

    answers = []
    call = threading.Thread(target=lambda: answers.append(send()))
    with other_session() as changing, other_session(autocommit=True) as watching:
        changing.execute(change, [pk])
        holder = changing.info.backend_pid
        call.start()
        wait_for(
            lambda: watching.execute(
                "SELECT 1 FROM pg_stat_activity WHERE %s = ANY(pg_blocking_pids(pid))", [holder]
            ).fetchone(),
            what="the call to wait for the row",
        )
        changing.commit()
    call.join(10)
    (answer,) = answers
    return answer
