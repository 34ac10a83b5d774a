"""Processes, database probes and the invariants every fault scenario ends by asserting.

Everything here reads the database through its own psycopg connection (not Django's), so the
same probes serve the test database and the PostgreSQL server a scenario starts for itself.
"""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import closing, contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql as pg_sql

from tests.waiting import wait_for  # noqa: F401 - shared by this package's tests

ROOT = Path(__file__).resolve().parents[2]
CLIENT_DIR = ROOT / "client"
HANDLERS = "tests.faults.handlers"


def free_port() -> int:
    with closing(socket.socket()) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# --- the database, seen from outside Django ----------------------------------------------------


class Db:
    """Autocommit psycopg connections for probes and assertions: to the control database
    (`url`), and with shards on servers of their own to each shard database too (`others`).

    Every table's rows live in one of them (the others hold the same tables, empty), so a
    probe's rows are those of every database together, and a count is their sum."""

    def __init__(
        self, url: str, application_name: str = "faults:probe", *, others: Sequence[str] = ()
    ) -> None:
        self.url = url
        self.urls = [url, *others]
        self.application_name = application_name
        self.reconnect()

    def reconnect(self) -> None:
        """New connections to every database (after a test restarted one of their servers)."""
        for conn in getattr(self, "conns", []):
            conn.close()
        self.conns = [
            psycopg.connect(url, autocommit=True, application_name=self.application_name)
            for url in self.urls
        ]
        self.conn = self.conns[0]

    def rows(self, sql: str, params: Sequence[Any] | dict[str, Any] | None = None) -> list[tuple]:
        return [row for conn in self.conns for row in conn.execute(sql, params).fetchall()]

    def one(self, sql: str, params: Sequence[Any] | dict[str, Any] | None = None) -> tuple | None:
        found = self.rows(sql, params)
        return found[0] if found else None

    def scalar(self, sql: str, params: Sequence[Any] | dict[str, Any] | None = None) -> Any:
        values = [row[0] for row in self.rows(sql, params)]
        if len(self.conns) > 1 and "count(" in sql.lower():
            return sum(values)  # one count per database
        return next((value for value in values if value is not None), None)

    def execute_everywhere(self, sql: str) -> None:
        for conn in self.conns:
            conn.execute(sql)

    @contextmanager
    def holding(
        self,
        sql: str,
        params: Sequence[Any] | dict[str, Any] | None = None,
        *,
        url: str | None = None,
    ) -> Iterator[psycopg.Connection]:
        """Run `sql` in a transaction on a second connection (to `url`, by default the control
        database) and keep it open (its locks held) until the block ends, then roll it back."""
        with psycopg.connect(url or self.url, application_name="faults:holder") as holder:
            holder.execute(sql, params)
            try:
                yield holder
            finally:
                holder.rollback()

    def backends(self, application_name: str, *, waiting_on_lock: bool = False) -> list[int]:
        """Pids of this database's backends with that application_name (optionally: those
        waiting for a lock, i.e. inside a statement that another transaction blocks)."""
        return [
            row[0]
            for row in self.rows(
                "SELECT pid FROM pg_stat_activity WHERE datname = current_database()"
                " AND application_name = %s AND (NOT %s OR wait_event_type = 'Lock')",
                [application_name, waiting_on_lock],
            )
        ]

    def busy_backends(self, application_name: str) -> int:
        """How many of these backends are inside a statement or a transaction right now."""
        return self.scalar(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
            " AND application_name = %s AND state <> 'idle'",
            [application_name],
        )

    def terminate(self, pids: Sequence[int]) -> None:
        """Terminate these backends, on whichever server each is (the servers share this
        machine, so a pid names one backend of one of them)."""
        for conn in self.conns:
            conn.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE pid = ANY(%s)",
                [list(pids)],
            )

    @contextmanager
    def terminating_first_waiter(
        self, application_name: str, *, url: str | None = None, timeout: float = 15
    ) -> Iterator[None]:
        """Within the block, terminate the first backend of `application_name` on the database
        at `url` (the control database by default) that waits for a lock, the moment it does;
        at the end, assert that one was terminated.

        The watch runs in the server (a loop polling pg_stat_activity every 2 ms) rather than
        from here: a claim on a shard database of its own waits at most 200 ms for a lock
        (store.CLAIM_LOCK_WAIT) before it gives up, too short a window to hit from a poll
        across a busy machine."""
        watch = pg_sql.SQL(WATCH_AND_TERMINATE).format(
            name=pg_sql.Literal(application_name), seconds=pg_sql.Literal(timeout)
        )
        failure: list[BaseException] = []

        def run() -> None:
            try:
                with psycopg.connect(url or self.url, autocommit=True) as conn:
                    conn.execute(watch)
            except BaseException as exc:  # noqa: BLE001 - re-raised by the block
                failure.append(exc)

        watcher = threading.Thread(target=run, daemon=True)
        watcher.start()
        yield
        watcher.join(timeout + 5)
        assert not watcher.is_alive() and not failure, failure or "the watch did not end"

    def close(self) -> None:
        for conn in self.conns:
            conn.close()


# A DO block (its parameters are written in): pg_stat_clear_snapshot makes each pass read
# pg_stat_activity afresh rather than the transaction's first snapshot.
WATCH_AND_TERMINATE = """
DO $$
DECLARE
    deadline timestamptz := clock_timestamp() + make_interval(secs => {seconds});
BEGIN
    LOOP
        PERFORM pg_stat_clear_snapshot();
        PERFORM pg_terminate_backend(pid) FROM pg_stat_activity
        WHERE datname = current_database() AND application_name = {name}
          AND wait_event_type = 'Lock';
        EXIT WHEN FOUND;
        IF clock_timestamp() > deadline THEN
            RAISE EXCEPTION 'no backend of % waited for a lock', {name};
        END IF;
        PERFORM pg_sleep(0.002);
    END LOOP;
END
$$
"""


# The exact check behind "every concurrency limit held at every instant": a deferred trigger
# counts, at the commit of every transaction that leases runs of a limited definition, how many
# of its runs are leased, and keeps the peak. Claims of a limited definition hold a lock on it
# until they commit, so the count seen at each commit is exact. Test databases only.
PEAK_RECORDER = """
CREATE TABLE IF NOT EXISTS faults_lease_peak (definition_id bigint PRIMARY KEY, peak int NOT NULL);
CREATE OR REPLACE FUNCTION faults_record_lease_peak() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    leased int;
BEGIN
    IF (SELECT concurrency FROM jobs_jobdefinition WHERE id = NEW.definition_id) IS NULL THEN
        RETURN NULL;
    END IF;
    SELECT count(*) INTO leased FROM runs_run
    WHERE definition_id = NEW.definition_id AND state = 'leased';
    INSERT INTO faults_lease_peak VALUES (NEW.definition_id, leased)
    ON CONFLICT (definition_id) DO UPDATE SET peak = greatest(faults_lease_peak.peak, EXCLUDED.peak);
    RETURN NULL;
END
$$;
DROP TRIGGER IF EXISTS faults_record_lease_peak ON runs_run;
CREATE CONSTRAINT TRIGGER faults_record_lease_peak AFTER INSERT OR UPDATE OF state ON runs_run
DEFERRABLE INITIALLY DEFERRED FOR EACH ROW WHEN (NEW.state = 'leased')
EXECUTE FUNCTION faults_record_lease_peak();
"""

REMOVE_PEAK_RECORDER = """
DROP TRIGGER IF EXISTS faults_record_lease_peak ON runs_run;
DROP FUNCTION IF EXISTS faults_record_lease_peak();
DROP TABLE IF EXISTS faults_lease_peak;
"""


def install_peak_recorder(db: Db) -> None:
    db.execute_everywhere(PEAK_RECORDER)


def remove_peak_recorder(db: Db) -> None:
    db.execute_everywhere(REMOVE_PEAK_RECORDER)


class LeaseSampler:
    """Count the leased runs of every definition every few milliseconds; keep each peak.

    Runs in a background thread on its own connection for the whole scenario; survives a
    database restart (a failed sample is counted and the connection made again).
    """

    QUERY = "SELECT definition_id, count(*) FROM runs_run WHERE state = 'leased' GROUP BY 1"

    def __init__(self, urls: str | Sequence[str], interval: float = 0.02) -> None:
        self.urls = [urls] if isinstance(urls, str) else list(urls)
        self.interval = interval
        self.peaks: dict[int, int] = {}
        self.samples = 0
        self.failures = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="faults-lease-sampler", daemon=True)

    def start(self) -> LeaseSampler:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        conns: dict[str, psycopg.Connection] = {}
        while not self._stop.is_set():
            try:
                counts: dict[int, int] = {}
                for url in self.urls:
                    if url not in conns:
                        conns[url] = psycopg.connect(
                            url, autocommit=True, connect_timeout=2,
                            application_name="faults:sampler",
                        )  # fmt: skip
                    for definition_id, count in conns[url].execute(self.QUERY).fetchall():
                        counts[definition_id] = counts.get(definition_id, 0) + count
                for definition_id, count in counts.items():
                    if count > self.peaks.get(definition_id, 0):
                        self.peaks[definition_id] = count
                self.samples += 1
            except psycopg.Error:
                # The database is restarting (or the table is being flushed): sample again.
                self.failures += 1
                for conn in conns.values():
                    conn.close()
                conns = {}
            self._stop.wait(self.interval)
        for conn in conns.values():
            conn.close()


# --- what must hold after any fault ------------------------------------------------------------

# Each query lists the runs that break one rule; all run in one snapshot (REPEATABLE READ).
INVARIANTS = {
    "attempts within maxAttempts": """
        SELECT id, attempt, max_attempts FROM runs_run WHERE attempt > max_attempts
    """,
    "one attempt row per attempt, numbered 1..attempt": """
        SELECT r.id, r.attempt, count(a.id), count(DISTINCT a.number), max(a.number)
        FROM runs_run r LEFT JOIN runs_attempt a ON a.run_id = r.id
        GROUP BY r.id, r.attempt
        HAVING count(a.id) <> r.attempt OR count(DISTINCT a.number) <> r.attempt
            OR coalesce(max(a.number), 0) <> r.attempt
    """,
    "fencing tokens grow with every attempt": """
        SELECT a.run_id, a.number, a.fencing_token, b.number, b.fencing_token
        FROM runs_attempt a JOIN runs_attempt b
          ON b.run_id = a.run_id AND b.number > a.number AND b.fencing_token <= a.fencing_token
    """,
    # Not a constraint in the database either (apps/runs/models.py): the token's sequence holds it.
    "no two attempts share a fencing token": """
        SELECT fencing_token, count(*) FROM runs_attempt GROUP BY fencing_token HAVING count(*) > 1
    """,
    "the run carries its latest attempt's token": """
        SELECT r.id, r.fencing_token, a.fencing_token
        FROM runs_run r JOIN runs_attempt a ON a.run_id = r.id AND a.number = r.attempt
        WHERE r.fencing_token IS DISTINCT FROM a.fencing_token
    """,
    "no run succeeded twice": """
        SELECT run_id, count(*) FROM runs_attempt WHERE outcome = 'succeeded'
        GROUP BY run_id HAVING count(*) > 1
    """,
    "a succeeded attempt is the run's last, and the run succeeded with its token": """
        SELECT r.id, r.state, r.attempt, a.number
        FROM runs_attempt a JOIN runs_run r ON r.id = a.run_id
        WHERE a.outcome = 'succeeded'
          AND (r.state <> 'succeeded' OR a.number <> r.attempt
               OR a.fencing_token <> r.fencing_token)
    """,
    "a succeeded run has a succeeded last attempt": """
        SELECT r.id, a.outcome FROM runs_run r
        LEFT JOIN runs_attempt a ON a.run_id = r.id AND a.number = r.attempt
        WHERE r.state = 'succeeded' AND a.outcome IS DISTINCT FROM 'succeeded'
    """,
    "only the current attempt of a leased run is open": """
        SELECT a.run_id, a.number, r.state, r.attempt
        FROM runs_attempt a JOIN runs_run r ON r.id = a.run_id
        WHERE (a.ended_at IS NULL) <> (r.state = 'leased' AND a.number = r.attempt)
    """,
    "a leased run has a lease": """
        SELECT id FROM runs_run WHERE state = 'leased'
          AND (lease_expires_at IS NULL OR fencing_token IS NULL)
    """,
    # Neither key is a constraint in the database (apps/runs/models.py): the writers hold it.
    "every run has its definition": """
        SELECT r.id, r.definition_id FROM runs_run r
        WHERE NOT EXISTS (SELECT 1 FROM jobs_jobdefinition d WHERE d.id = r.definition_id)
    """,
    "every attempt has its run": """
        SELECT a.run_id, a.number FROM runs_attempt a
        WHERE NOT EXISTS (SELECT 1 FROM runs_run r WHERE r.id = a.run_id)
    """,
    "one scheduled run per definition and due time": """
        SELECT definition_id, due_at, count(*) FROM runs_run
        WHERE trigger IN ('cron', 'catch_up', 'backfill')
        GROUP BY definition_id, due_at HAVING count(*) > 1
    """,
}


def check_invariants(db: Db, sampler: LeaseSampler | None = None) -> dict[int, int]:
    """Assert every rule above, and every concurrency limit against the sampled and the
    recorded peaks; return the sampled peaks by definition id."""
    broken: dict[str, list[tuple]] = {}
    limits: dict[int, int] = {}
    recorded: dict[int, int] = {}
    for url in db.urls:
        with psycopg.connect(url, application_name="faults:check") as conn:
            conn.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
            for rule, sql in INVARIANTS.items():
                rows = conn.execute(sql).fetchall()
                if rows:
                    broken.setdefault(rule, []).extend(rows[:10])
            limits.update(
                conn.execute(
                    "SELECT id, concurrency FROM jobs_jobdefinition WHERE concurrency IS NOT NULL"
                ).fetchall()
            )
            recorded.update(conn.execute("SELECT definition_id, peak FROM faults_lease_peak"))
    assert not broken, f"invariants broken: {broken}"
    peaks = dict(sampler.peaks) if sampler is not None else {}
    for definition_id, limit in limits.items():
        assert recorded.get(definition_id, 0) <= limit, (
            f"definition {definition_id}: {recorded[definition_id]} leased at a commit, limit {limit}"
        )
        assert peaks.get(definition_id, 0) <= limit, (
            f"definition {definition_id}: {peaks[definition_id]} leased in a sample, limit {limit}"
        )
    if sampler is not None:
        assert sampler.samples > 0, "the lease sampler never ran"
    return peaks


def read_ledger(path: Path) -> dict[str, dict[str, Any]]:
    """The handlers' effects by idempotency key (see examples.plain_worker.handlers)."""
    if not path.exists():
        return {}
    with closing(sqlite3.connect(path, timeout=30)) as ledger:
        ledger.row_factory = sqlite3.Row
        try:
            rows = ledger.execute("SELECT * FROM effects").fetchall()
        except sqlite3.OperationalError:
            return {}
    return {row["idempotency_key"]: dict(row) for row in rows}


RUN_COLUMNS = (
    "id, state, attempt, max_attempts, fencing_token, worker_id, result, last_error,"
    " idempotency_key, trigger, due_at"
)


def runs(db: Db, ids: Sequence[int]) -> dict[int, dict[str, Any]]:
    """The runs with these ids, by id, as dicts of RUN_COLUMNS."""
    found: dict[int, dict[str, Any]] = {}
    for conn in db.conns:
        cursor = conn.execute(f"SELECT {RUN_COLUMNS} FROM runs_run WHERE id = ANY(%s)", [list(ids)])
        names = [column.name for column in cursor.description]
        found.update((row[0], dict(zip(names, row, strict=True))) for row in cursor.fetchall())
    return found


def all_in(db: Db, ids: Sequence[int], *states: str) -> bool:
    found = runs(db, ids)
    return len(found) == len(ids) and all(run["state"] in states for run in found.values())


def attempts_of(db: Db, run_id: int) -> list[tuple[int, int, str, str, str]]:
    """(number, fencing token, worker id, outcome, error type) of a run's attempts, in order."""
    return db.rows(
        "SELECT number, fencing_token, worker_id, outcome, error_type FROM runs_attempt"
        " WHERE run_id = %s ORDER BY number",
        [run_id],
    )


def definition_url(definition_id: int) -> str:
    """The URL of the database that holds this definition and its runs (its id names its
    shard); the control database's with every shard on it."""
    from apps.runs import shards
    from tests.conftest import child_database_url

    return child_database_url(shards.alias_of_shard(definition_id % shards.ID_SPACE))


@contextmanager
def snapshot(db: Db, url: str | None = None) -> Iterator[psycopg.Connection]:
    """A connection whose reads all see one snapshot (a REPEATABLE READ transaction), so that
    processes writing meanwhile cannot make two reads disagree; on the database at `url` (the
    control database's by default)."""
    with psycopg.connect(url or db.url, application_name="faults:check") as conn:
        conn.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
        with conn.transaction():
            yield conn


def every_fire_time_once(db: Db, definition_id: int, first_due: Any, schedule: Any) -> None:
    """Assert that the definition's runs are exactly its fire times from `first_due` up to (not
    including) its next_due_at, one run each."""
    from apps.jobs import firetimes
    from apps.jobs import schedule as sched

    with psycopg.connect(definition_url(definition_id), application_name="faults:check") as conn:
        next_due, due = conn.execute(
            "SELECT d.next_due_at, array(SELECT due_at FROM runs_run"
            " WHERE definition_id = d.id ORDER BY due_at) FROM jobs_jobdefinition d"
            " WHERE d.id = %s",
            [definition_id],
        ).fetchone()
    expected = [
        f.utc
        for f in firetimes.fire_times_between(
            sched.parse_schedule(schedule),
            first_due - timedelta(seconds=1),
            next_due - timedelta(seconds=1),
            10_000,
        )
    ]
    assert due == expected, (definition_id, due, expected)


# --- processes ----------------------------------------------------------------------------------


def process_env(database_url: str, data_dir: Path, **extra: str) -> dict[str, str]:
    env = {
        **os.environ,
        "DATABASE_URL": database_url,
        "PYTHONPATH": os.pathsep.join([str(ROOT), str(CLIENT_DIR)]),
        "PYTHONUNBUFFERED": "1",
        "LOG_FORMAT": "plain",
        # Static files and payload blobs of the subprocesses stay out of the checkout.
        "SCHEDULER_DATA_DIR": str(data_dir),
        **extra,
    }
    env.pop("TEST_DATABASE_NAME", None)
    return env


class Proc:
    """A subprocess writing to its own log file; stopped for good by `stop()` or `kill()`."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], log_dir: Path) -> None:
        self.name = name
        self.argv = argv
        self.log_path = log_dir / f"{name}.log"
        with self.log_path.open("ab") as log:
            self.popen = subprocess.Popen(
                argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT
            )
        self.pid = self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def signal(self, signum: int) -> None:
        if self.alive():
            os.kill(self.pid, signum)

    def wait(self, timeout: float) -> int:
        return self.popen.wait(timeout=timeout)

    def kill(self) -> None:
        if self.alive():
            self.popen.kill()
        self.popen.wait(timeout=10)

    def stop(self, timeout: float = 5) -> int:
        """SIGTERM (after SIGCONT, in case it is frozen); SIGKILL if it is not gone in time."""
        if self.alive():
            os.kill(self.pid, signal.SIGCONT)
            os.kill(self.pid, signal.SIGTERM)
            try:
                self.popen.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.popen.kill()
        return self.popen.wait(timeout=10)

    def output(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""


def freeze(proc: Proc, db: Db, application_name: str) -> None:
    """SIGSTOP `proc` at a moment when its database connections are idle (not inside a
    statement or a transaction), so that the frozen process holds no lock."""
    for _ in range(300):
        proc.signal(signal.SIGSTOP)
        if not db.busy_backends(application_name):
            return
        proc.signal(signal.SIGCONT)
        time.sleep(0.01)
    raise AssertionError(f"{proc.name} never left the database idle")


@contextmanager
def frozen(proc: Proc, db: Db, application_name: str) -> Iterator[None]:
    """Freeze `proc` (see freeze) for the block, then SIGCONT it."""
    freeze(proc, db, application_name)
    try:
        yield
    finally:
        proc.signal(signal.SIGCONT)


def manage_argv(*args: str) -> list[str]:
    return [sys.executable, "manage.py", *args]


def worker_argv(url: str, token: str, queue: str, worker_id: str, *options: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "cronlease_client",
        "run",
        HANDLERS,
        "--queue",
        queue,
        "--url",
        url,
        "--token",
        token,
        "--worker-id",
        worker_id,
        *options,
    ]


def uvicorn_argv(port: int) -> list[str]:
    return [
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
        "--no-access-log",
    ]


def wait_http_ok(url: str, proc: Proc, timeout: float = 90) -> None:
    import httpx

    def answered() -> bool:
        assert proc.alive(), f"{proc.name} exited:\n{proc.output()[-3000:]}"
        try:
            return httpx.get(url, timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    wait_for(answered, timeout, f"{url} to answer 200", interval=0.1)


# --- a PostgreSQL server of the test's own -------------------------------------------------------


class OwnPostgres:
    """A throwaway PostgreSQL server (the `pgserver` package's binaries) that a test may restart.

    pgserver runs initdb and the first start (as the `pgserver` system user when we are root);
    restarts go through pg_ctl with the same options.
    """

    def __init__(self, root: Path) -> None:
        import pgserver

        self.root = root
        self.data = root / "pg"
        server = pgserver.get_server(self.data, cleanup_mode=None)
        # The test stops the server itself (see close); pgserver's exit hook has nothing to do.
        atexit.unregister(server._cleanup)
        self.url = server.get_uri()
        self.socket_dir = server.get_postmaster_info().socket_dir
        self.user = server.system_user
        self.pg_ctl_path = Path(pgserver.__file__).parent / "pginstall" / "bin" / "pg_ctl"

    def _pg_ctl(self, *args: str) -> None:
        subprocess.run(
            [str(self.pg_ctl_path), "-D", str(self.data), *args],
            user=self.user,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            check=True,
            timeout=60,
        )

    def stop(self) -> None:
        self._pg_ctl("-w", "-m", "fast", "stop")

    def start(self) -> None:
        self._pg_ctl(
            "-w",
            "-o",
            '-h ""',
            "-o",
            f"-k {self.socket_dir}",
            "-l",
            str(self.data / "log"),
            "start",
        )

    def close(self) -> None:
        try:
            self.stop()
        except subprocess.SubprocessError:
            pass
        shutil.rmtree(self.root, ignore_errors=True)
