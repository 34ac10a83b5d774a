"""Shared machinery: databases, processes, CPU/RSS sampling, PostgreSQL counters, results.

The parent process (`python -m bench …`) never imports Django: everything that runs the
product's code does so in a subprocess with its own `DATABASE_URL`, so one `bench all` can move
from one fresh database to the next.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse, urlunparse

import psutil
import psycopg
from psycopg import sql

REPO = Path(__file__).resolve().parents[1]
RESULTS_DIR = REPO / "bench" / "results"
PG_URL = os.environ.get("BENCH_PG_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
REDIS_URL = os.environ.get("BENCH_REDIS_URL", "redis://127.0.0.1:6379/15")
PYTHON = sys.executable
QUEUE = "bench"
JOB = "bench.noop"
SHARD_COUNT = 16  # the product's default SCHEDULER_SHARD_COUNT


def shard_for(name: str) -> int:
    """The product's shard of a job name (apps/jobs/schedule.py `shard_for`), without importing
    Django: the first 8 bytes of its SHA-256, modulo the shard count. bench/workers/setup_project.py
    checks that the two agree."""
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "big") % SHARD_COUNT


def job_names(per_shard: int) -> list[str]:
    """`per_shard` names of no-op jobs on each shard (`bench.noop.<i>`), so that a workload spread
    over them is spread evenly over every shard, and over every shard database."""
    names: list[str] = []
    taken = [0] * SHARD_COUNT
    i = 0
    while len(names) < per_shard * SHARD_COUNT:
        name = f"{JOB}.{i}"
        if taken[shard_for(name)] < per_shard:
            taken[shard_for(name)] += 1
            names.append(name)
        i += 1
    return names


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


# --------------------------------------------------------------------------------------------
# Databases


def connect(url: str, attempts: int = 60, **kwargs: Any) -> psycopg.Connection:
    """psycopg.connect, retried for a minute when the server is out of connection slots.

    The machine's PostgreSQL (max_connections 100) is shared with other test runs.
    """
    kwargs.setdefault("autocommit", True)
    for attempt in range(attempts):
        try:
            return psycopg.connect(url, **kwargs)
        except psycopg.OperationalError as exc:
            if "too many clients" not in str(exc) or attempt == attempts - 1:
                raise
            time.sleep(1.0)
    raise AssertionError("unreachable")


def db_url(name: str) -> str:
    return urlunparse(urlparse(PG_URL)._replace(path=f"/{name}"))


def recreate_database(name: str) -> str:
    with connect(PG_URL) as conn:
        conn.execute(
            sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
        )
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    return db_url(name)


def django_env(url: str, **extra: str) -> dict[str, str]:
    """The environment of a product process: its database, quiet logs, no per-run log lines.

    `LOG_RUNS_LEVEL=WARNING` is the setting the product's own comment recommends "at tens of
    thousands of runs a second" (apps/ops/logs.py); everything else is the default.
    """
    env = dict(os.environ)
    env.update(
        {
            "DATABASE_URL": url,
            "DJANGO_SETTINGS_MODULE": "scheduler_site.settings",
            "LOG_LEVEL": "WARNING",
            "LOG_RUNS_LEVEL": "WARNING",
            "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "client")]),
        }
    )
    env.update(extra)
    return env


def manage(url: str, *args: str) -> str:
    done = subprocess.run(
        [PYTHON, "manage.py", *args],
        cwd=REPO,
        env=django_env(url),
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode:
        raise RuntimeError(f"manage.py {' '.join(args)} failed:\n{done.stdout}\n{done.stderr}")
    return done.stdout


TEMPLATE = "bench_template"
_template_token: str | None = None


def fresh_project_database(name: str) -> tuple[str, str]:
    """A fresh `name`, migrated, with team `bench`, a worker+manage token and the job `bench.noop`.

    The first call of a `python -m bench` process drops and recreates `bench_template`, runs
    `manage.py migrate`, `manage.py createteam bench` and bench/workers/setup_project.py on it; every scenario's database is then
    `CREATE DATABASE … TEMPLATE bench_template` (a file copy, well under a second, where
    migrating takes 5–40 s on a busy 2-core machine). So each scenario starts from the
    current migrations and an empty schema, and the token works in all of them.
    """
    global _template_token
    if _template_token is None:
        url = recreate_database(TEMPLATE)
        manage(url, "migrate", "-v0")
        out = manage(url, "createteam", "bench", "--scopes", "worker,manage")
        _template_token = out.strip().splitlines()[-1]
        subprocess.run(
            [PYTHON, "-m", "bench.workers.setup_project"], cwd=REPO, env=django_env(url), check=True
        )
    with connect(PG_URL) as conn:
        conn.execute(
            sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
        )
        conn.execute(
            sql.SQL("CREATE DATABASE {} TEMPLATE {}").format(
                sql.Identifier(name), sql.Identifier(TEMPLATE)
            )
        )
    return db_url(name), _template_token


def clone_database(source: str, name: str) -> str:
    """`CREATE DATABASE name TEMPLATE source` (dropping `name` first); return its URL."""
    with connect(PG_URL) as conn:
        conn.execute(
            sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
        )
        conn.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s", [source]
        )
        conn.execute(
            sql.SQL("CREATE DATABASE {} TEMPLATE {}").format(
                sql.Identifier(name), sql.Identifier(source)
            )
        )
    return db_url(name)


def drop_database(name: str) -> None:
    with connect(PG_URL) as conn:
        conn.execute(
            sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
        )


def xact_commits(names: Iterable[str], server: str | None = None) -> int:
    """Committed transactions of these databases so far (pg_stat_database), read from `postgres`
    of `server` (default PG_URL).

    Read from another database so the reading does not count itself.
    """
    with connect(server or PG_URL) as conn:
        row = conn.execute(
            "SELECT coalesce(sum(xact_commit), 0) FROM pg_stat_database WHERE datname = ANY(%s)",
            [list(names)],
        ).fetchone()
    return int(row[0])


def flush_backends(names: Iterable[str], server: str | None = None) -> None:
    """End the sessions still open on these databases of `server` (default PG_URL), so their
    pending statistics are flushed.

    PostgreSQL 15 reports an idle session's counters up to 10 s late; a session that ends
    reports them at once. Long-lived sessions (the web processes') reconnect on next use.
    """
    with connect(server or PG_URL) as conn:
        conn.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
            " WHERE datname = ANY(%s) AND pid <> pg_backend_pid()",
            [list(names)],
        )
    time.sleep(0.3)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


PG_BIN = Path(os.environ.get("BENCH_PG_BIN", "/usr/lib/postgresql/15/bin"))


@contextlib.contextmanager
def private_server(options: str = "") -> Iterator[str]:
    """A PostgreSQL cluster of the bench's own, on a free port, with PostgreSQL's defaults
    (autovacuum on) and the machine server's shared_buffers and max_connections, plus `options`
    (`-c name=value …`); yields its URL.

    For `--server private`: the machine's shared server may be configured for test suites
    (this one has autovacuum off), which a soak of hours would measure instead of the product.
    Same binaries as the machine's server (BENCH_PG_BIN), run as the `postgres` user, data on
    disk (fsync on), removed afterwards."""
    root = Path(tempfile.mkdtemp(prefix="bench-pg-", dir="/var/tmp"))
    shutil.chown(root, "postgres", "postgres")
    data = root / "data"
    port = free_port()

    def as_postgres(*args: str) -> None:
        subprocess.run(
            [str(PG_BIN / args[0]), *args[1:]],
            user="postgres",
            cwd=root,
            check=True,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            timeout=120,
        )

    as_postgres("initdb", "-D", str(data), "-U", "postgres", "--auth=trust", "-E", "UTF8")
    options = (
        f"-p {port} -c listen_addresses=127.0.0.1 -k {root} -c shared_buffers=128MB"
        f" -c max_connections=100 {options}"
    )
    as_postgres("pg_ctl", "-D", str(data), "-o", options, "-l", str(root / "log"), "-w", "start")
    try:
        yield f"postgresql://postgres@127.0.0.1:{port}/postgres"
    finally:
        with contextlib.suppress(subprocess.SubprocessError):
            as_postgres("pg_ctl", "-D", str(data), "-m", "fast", "-w", "stop")
        shutil.rmtree(root, ignore_errors=True)


@contextlib.contextmanager
def on_server(url: str) -> Iterator[str]:
    """The database helpers above (template, fresh databases, clones, commits) against the server
    of `url` for the block, with a template of its own; yields `url`."""
    global PG_URL, _template_token
    saved = PG_URL, _template_token
    PG_URL, _template_token = url, None
    try:
        yield url
    finally:
        PG_URL, _template_token = saved


def copy_database(source: str, target: str) -> str:
    """Copy the database at URL `source` to a new database at URL `target`, on another server
    (`CREATE DATABASE … TEMPLATE` copies within one): pg_dump into psql, a second or two for a
    migrated template, where migrating takes 5–40 s. Returns `target`."""
    server = urlunparse(urlparse(target)._replace(path="/postgres"))
    name = urlparse(target).path.lstrip("/")
    with connect(server) as conn:
        conn.execute(
            sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
        )
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    dump = subprocess.Popen(
        [str(PG_BIN / "pg_dump"), "--no-owner", "--dbname", source], stdout=subprocess.PIPE
    )
    restore = subprocess.run(
        [str(PG_BIN / "psql"), "-q", "-v", "ON_ERROR_STOP=1", "--dbname", target],
        stdin=dump.stdout,
        stdout=subprocess.DEVNULL,
        check=False,
    )
    dump.stdout.close()
    if dump.wait() or restore.returncode:
        raise RuntimeError(f"copying {source} to {target} failed")
    return target


def server_facts() -> dict[str, Any]:
    with connect(PG_URL) as conn:
        version = conn.execute("SHOW server_version").fetchone()[0]
        settings = dict(
            conn.execute(
                "SELECT name, current_setting(name) FROM pg_settings WHERE name = ANY(%s)",
                [
                    [
                        "shared_buffers",
                        "synchronous_commit",
                        "max_connections",
                        "fsync",
                        "wal_level",
                        "autovacuum",
                    ]
                ],
            ).fetchall()
        )
    return {
        "nproc": os.cpu_count(),
        "memory_gb": round(psutil.virtual_memory().total / 2**30, 1),
        "postgresql": version,
        "pg_settings": settings,
        "python": sys.version.split()[0],
    }


# --------------------------------------------------------------------------------------------
# Processes


class Procs:
    """Subprocesses of one system, stopped together (SIGTERM, then SIGKILL)."""

    def __init__(self) -> None:
        self.items: list[tuple[str, subprocess.Popen]] = []

    def start(
        self, role: str, args: Sequence[str], env: dict[str, str], log_path: Path | None = None
    ) -> subprocess.Popen:
        out = open(log_path, "ab") if log_path else subprocess.DEVNULL  # noqa: SIM115
        proc = subprocess.Popen(
            list(args),
            cwd=REPO,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        if log_path:
            out.close()
        self.items.append((role, proc))
        return proc

    def pids(self) -> dict[int, str]:
        """Every process of the group and its descendants, with its role."""
        found: dict[int, str] = {}
        for role, proc in self.items:
            if proc.poll() is not None:
                continue
            found[proc.pid] = role
            try:
                for child in psutil.Process(proc.pid).children(recursive=True):
                    found[child.pid] = role
            except psutil.Error:
                pass
        return found

    def dead(self) -> list[tuple[str, int]]:
        return [(role, proc.returncode) for role, proc in self.items if proc.poll() is not None]

    def stop(self, roles: Iterable[str] | None = None, grace: float = 3.0) -> None:
        wanted = set(roles) if roles is not None else None
        chosen = [(r, p) for r, p in self.items if wanted is None or r in wanted]
        for _, proc in chosen:
            # The whole group, even when its leader has gone: a leader that exited on its own
            # (py-spy, signalled by bench profile) left its children running, and a uvicorn
            # worker spinning after `bench profile` took CPU from every later measurement.
            try:
                # grace 0: the figures are already read; no need to wait for a clean exit.
                os.killpg(proc.pid, signal.SIGTERM if grace else signal.SIGKILL)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace
        for _, proc in chosen:
            try:
                proc.wait(max(0.05, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # whatever of the group is left
            except ProcessLookupError:
                pass
            proc.wait(5)
        self.items = [(r, p) for r, p in self.items if (r, p) not in chosen]


def wait_ready(run_dir: Path, count: int, procs: Procs, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while len(list(run_dir.glob("ready-*"))) < count:
        if procs.dead():
            raise RuntimeError(f"a worker process exited early: {procs.dead()} (see {run_dir})")
        if time.monotonic() > deadline:
            raise RuntimeError(f"workers not ready after {timeout}s (see {run_dir})")
        time.sleep(0.05)


class Sampler:
    """CPU seconds and peak RSS of a system's processes and of its PostgreSQL backends.

    Polls every 0.2 s: the tracked subprocesses (and their children) and every PostgreSQL
    process whose title names one of `databases` (its backends and autovacuum workers), plus
    any `extra` pids (the Redis server). CPU counts from the first sample (processes that were
    already running contribute only what they spend from then on; new ones everything).
    """

    def __init__(
        self,
        procs: Procs | None,
        databases: Sequence[str] = (),
        extra: dict[int, str] | None = None,
    ) -> None:
        self.procs = procs
        self.databases = [f" {name} " for name in databases]
        self.extra = extra or {}
        self.base: dict[int, float] = {}
        self.last: dict[int, float] = {}
        self.role: dict[int, str] = {}
        self.rss: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._first = True
        self._pg_pids: dict[int, str] = {}
        self._pg_scanned = 0.0

    def _pg(self) -> dict[int, str]:
        now = time.monotonic()
        if self.databases and now - self._pg_scanned > 0.5:
            self._pg_scanned = now
            found = {}
            for proc in psutil.process_iter(["name", "cmdline"]):
                try:
                    title = " ".join(proc.info["cmdline"] or []) + " "
                except psutil.Error:
                    continue
                if title.startswith("postgres:") and any(db in title for db in self.databases):
                    found[proc.pid] = "postgres"
            self._pg_pids = found
        return self._pg_pids

    def sample(self) -> None:
        pids = dict(self.procs.pids()) if self.procs else {}
        pids.update(self._pg())
        pids.update(self.extra)
        for pid, role in pids.items():
            try:
                proc = psutil.Process(pid)
                with proc.oneshot():
                    times = proc.cpu_times()
                    rss = proc.memory_info().rss
            except psutil.Error:
                continue
            cpu = times.user + times.system
            if pid not in self.base:
                self.base[pid] = cpu if self._first else 0.0
            self.last[pid] = cpu
            self.role[pid] = role
            self.rss[role] = max(self.rss.get(role, 0.0), rss / 2**20)
        self._first = False

    def start(self) -> Sampler:
        self.sample()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.wait(0.2):
            self.sample()

    def stop(self) -> dict[str, Any]:
        self._stop.set()
        if self._thread:
            self._thread.join()
        self.sample()
        by_role: dict[str, float] = {}
        for pid, cpu in self.last.items():
            role = self.role[pid]
            by_role[role] = by_role.get(role, 0.0) + max(0.0, cpu - self.base.get(pid, 0.0))
        return {
            "cpu_s": round(sum(by_role.values()), 2),
            "cpu_s_by_role": {k: round(v, 2) for k, v in sorted(by_role.items())},
            "rss_mb": {k: round(v, 1) for k, v in sorted(self.rss.items())},
        }


def redis_server_pid() -> dict[int, str]:
    for proc in psutil.process_iter(["name"]):
        if proc.info["name"] == "redis-server":
            return {proc.pid: "redis"}
    return {}


# --------------------------------------------------------------------------------------------
# Figures


def percentile(sorted_values: Sequence[float], p: float) -> float | None:
    if not sorted_values:
        return None
    k = (len(sorted_values) - 1) * p
    lo, hi = math.floor(k), math.ceil(k)
    if math.isinf(sorted_values[hi]):
        return sorted_values[hi]
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (k - lo)


def latency_summary(values: Iterable[float]) -> dict[str, float | None]:
    ordered = sorted(v for v in values if not math.isnan(v))
    return {
        "p50": percentile(ordered, 0.5),
        "p99": percentile(ordered, 0.99),
        "max": ordered[-1] if ordered else None,
    }


def load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


@dataclass
class Row:
    """One measurement: one system, one configuration of one scenario."""

    scenario: str
    system: str
    config: str
    runs: int = 0
    seconds: float = 0.0
    p50: float | None = None
    p99: float | None = None
    max: float | None = None
    cpu_s: float | None = None
    commits: int | None = None
    rss_mb: dict[str, float] = field(default_factory=dict)
    load: list[float] = field(default_factory=list)
    note: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def rate(self) -> float | None:
        return self.runs / self.seconds if self.seconds > 0 and self.runs else None

    def as_dict(self) -> dict[str, Any]:
        out = dict(self.__dict__)
        out["runs_per_s"] = round(self.rate, 1) if self.rate else None
        out["cpu_s_per_1k"] = (
            round(1000 * self.cpu_s / self.runs, 3) if self.cpu_s and self.runs else None
        )
        out["commits_per_1k"] = (
            round(1000 * self.commits / self.runs, 1)
            if self.commits is not None and self.runs
            else None
        )
        return out


class RunDir:
    """A scratch directory for one measurement: recorder files, go file, logs."""

    def __init__(self, label: str) -> None:
        self.path = Path(
            tempfile.mkdtemp(
                prefix=f"bench-{label}-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None
            )
        )
        self.go = self.path / "GO"

    def logs(self, name: str) -> Path:
        return self.path / f"{name}.log"

    def cleanup(self, keep: bool = False) -> None:
        if not keep:
            shutil.rmtree(self.path, ignore_errors=True)


def save_results(name: str, payload: dict[str, Any]) -> Path:
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path = RESULTS_DIR / f"{name}-{stamp}.json"
    path.write_text(json.dumps(payload, indent=2, default=str))
    (RESULTS_DIR / f"{name}-latest.json").write_text(json.dumps(payload, indent=2, default=str))
    return path
