"""The five systems under test and the one measurement loop they share.

- `rest`: this project through its real REST API: `manage.py web` (uvicorn) with N worker processes, SDK worker
  processes (cronlease_client.Worker) leasing and reporting in batches.
- `store`: this project's store layer (`apps.runs.store.claim` / `complete`) in worker
  processes, no HTTP.
- `raw`: the raw-SQL ceiling: claim N + complete N per statement with psycopg against the same
  `runs_run` table and indexes (bench/workers/raw_worker.py).
- `procrastinate`: Procrastinate 3 with its psycopg connector, in its own database.
- `celery`: Celery 5 with the local Redis as broker (database 15), no result backend.
- `http` (only when named): the HTTP ceiling, the same SDK worker processes against
  bench/workers/http_ceiling.py, a bare ASGI server whose answers PostgreSQL builds: what
  REST+SDK would reach if the web tier cost nothing per run.

The three project systems share one freshly migrated database per scenario (`bench_<scenario>`);
Procrastinate gets `bench_<scenario>_pq`. A measurement starts the workers, waits until every
process has imported and connected (a `ready-<pid>` file each), then creates the go file: all
start together. Throughput is runs completed / (last completion - first handler start).
"""

from __future__ import annotations

import concurrent.futures
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from bench import common
from bench.common import JOB, PYTHON, QUEUE, REDIS_URL, Procs, Row, RunDir, Sampler, log
from bench.recorder import read_pairs, read_progress

SYSTEMS = ("rest", "store", "raw", "procrastinate", "celery", "http")
# What `--systems` defaults to: `http` is measured when named.
DEFAULT_SYSTEMS = SYSTEMS[:5]
LABELS = {
    "dashboard": "cronlease dashboard",
    "rest": "cronlease REST+SDK",
    "store": "cronlease store",
    "raw": "raw SQL ceiling",
    "http": "HTTP ceiling (SDK)",
    "procrastinate": "Procrastinate",
    "celery": "Celery+Redis",
}

INSERT_RUNS = """
INSERT INTO runs_run (
    definition_id, team_id, queue, priority, shard, state, trigger, due_at, available_at,
    attempt, max_attempts, idempotency_key, lease_seconds, worker_id, dry_run, payload,
    payload_key, created_at
)
SELECT d.id, d.team_id, d.queue, d.priority, d.shard, 'scheduled', 'api', x.t, x.t,
       0, d.retry_max_attempts, %(tag)s || '-' || g, 60, '', d.dry_run, d.payload,
       d.payload_key, now()
FROM jobs_jobdefinition d
CROSS JOIN generate_series(%(first)s::bigint, %(last)s::bigint) AS g
CROSS JOIN LATERAL (SELECT to_timestamp(%(t0)s::float8 + g / %(rate)s::float8) AS t) AS x
WHERE d.name = %(job)s
"""


class ProjectDatabase:
    """`bench_<scenario>`: migrated, team `bench` with a worker+manage token, job `bench.noop`."""

    def __init__(self, scenario: str) -> None:
        self.name = f"bench_{scenario}"
        self.url = ""
        self.token = ""
        self._tag = 0

    def ensure(self) -> None:
        if self.url:
            return
        started = time.perf_counter()
        self.url, self.token = common.fresh_project_database(self.name)
        log(
            f"  {self.name}: ready (migrated, team, token, job) in {time.perf_counter() - started:.1f}s"
        )

    def execute(self, statement: str, params: Any = None) -> list[tuple]:
        with common.connect(self.url) as conn:
            cursor = conn.execute(statement, params)
            return cursor.fetchall() if cursor.description else []

    def reset(self) -> None:
        self.execute("TRUNCATE runs_attempt, runs_run")

    def insert_runs(self, n: int, t0: float, rate: float = 1e12, vacuum: bool = True) -> None:
        """Insert n claimable-at-their-time runs: run i is due (and available) at t0 + i/rate."""
        self._tag += 1
        with common.connect(self.url) as conn:
            step = 100_000
            for first in range(0, n, step):
                conn.execute(
                    INSERT_RUNS,
                    {
                        "tag": f"b{self._tag}",
                        "first": first,
                        "last": min(n, first + step) - 1,
                        "t0": t0,
                        "rate": rate,
                        "job": JOB,
                    },
                )
            if vacuum:
                conn.execute("VACUUM ANALYZE runs_run")
                conn.execute("VACUUM ANALYZE runs_attempt")


class System:
    name = ""
    peer = False

    def __init__(self, scenario: str, project: ProjectDatabase, web_workers: int = 2) -> None:
        self.scenario = scenario
        self.project = project
        self.procs = Procs()
        self.web_workers = web_workers
        self.monitor_commits = 0
        # Put before the web command (bench profile: py-spy record … --).
        self.web_prefix: list[str] = []
        # Settings of the web processes (bench enqueue turns the enqueue rate limit off).
        self.web_env: dict[str, str] = {}

    @property
    def label(self) -> str:
        return LABELS[self.name]

    @property
    def databases(self) -> list[str]:
        return [self.project.name]

    def extra_pids(self) -> dict[int, str]:
        return {}

    def xact_commits(self) -> int:
        """Committed transactions of the system's databases so far (pg_stat_database)."""
        return common.xact_commits(self.databases)

    def flush_backends(self) -> None:
        """End the sessions on the system's databases, so that their commits are counted."""
        common.flush_backends(self.databases)

    def sampler(self) -> Sampler:
        """The CPU and RSS sampler of a measurement."""
        return Sampler(self.procs, self.databases, self.extra_pids())

    def setup(self) -> None:
        self.project.ensure()

    def teardown(self) -> None:
        self.procs.stop()

    def reset(self) -> None:
        self.project.reset()

    def load(self, n: int) -> None:
        """A backlog of n runs, claimable now."""
        self.project.insert_runs(n, time.time() - 1.0)

    def schedule(self, n: int, t0: float, rate: float) -> None:
        """n runs falling due at `rate` per second from t0 (materialised ahead, as cron runs are).

        Then one NOTIFY on the product's channel, as `insert_runs` sends for claimable runs, so
        long-polling lease requests recompute when the next run falls due."""
        self.project.insert_runs(n, t0, rate)
        self.project.execute("SELECT pg_notify('runs_ready', %s)", [QUEUE])

    def worker_args(self, batch: int, run_dir: RunDir) -> tuple[list[str], dict[str, str]]:
        raise NotImplementedError

    def start_workers(self, workers: int, batch: int, run_dir: RunDir) -> None:
        for _ in range(workers):
            args, env = self.worker_args(batch, run_dir)
            self.procs.start("worker", args, env, run_dir.logs("workers"))

    def peer_env(self) -> dict[str, str]:
        """The environment of the system's producer process."""
        return common.django_env(self.project.url)

    def enqueuer_target(self) -> list[str]:
        """The system's arguments of bench.workers.enqueuer."""
        return [self.name]

    def producer_args(self, run_dir: RunDir, **kwargs: Any) -> list[str] | None:
        """A producer process: with `enqueue=True` an application creating runs through the
        system's own producer API (bench.workers.enqueuer); otherwise the peers' timed producer
        (the product's timed runs are inserted by the bench itself)."""
        if not kwargs.pop("enqueue", False):
            return None
        args = [
            PYTHON,
            "-m",
            "bench.workers.enqueuer",
            *self.enqueuer_target(),
            "--go",
            str(run_dir.go),
        ]
        for key, value in kwargs.items():
            flag = "--" + key.replace("_", "-")
            args += [flag] if value is True else [flag, str(value)]
        return args

    def completed(self) -> tuple[int, float]:
        """(runs completed so far, epoch time of the last completion), as the system records it."""
        self.monitor_commits += 1
        count, end = self.project.execute(
            "SELECT count(*) FILTER (WHERE state = 'succeeded'),"
            " extract(epoch FROM max(finished_at))::float8 FROM runs_run"
        )[0]
        return int(count), float(end or 0.0)

    def diagnostics(self) -> dict[str, Any]:
        (row,) = self.project.execute(
            "SELECT count(*)::float8 / nullif(count(DISTINCT (worker_id, started_at)), 0)"
            " FROM runs_run WHERE started_at IS NOT NULL"
        )
        return {"mean_claim_size": round(row[0], 1) if row[0] else None}


class RestSystem(System):
    name = "rest"

    def setup(self) -> None:
        super().setup()
        self.port = common.free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        env = common.django_env(self.project.url, **self.web_env)
        self.log_path = Path(f"/tmp/bench-uvicorn-{self.scenario}.log")
        self.procs.start("web", [*self.web_prefix, *self.web_command()], env, self.log_path)
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{self.base_url}/readyz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline or self.procs.dead():
                raise RuntimeError(f"uvicorn did not come up; see {self.log_path}")
            time.sleep(0.2)
        log(f"  {self.label}: web ×{self.web_workers} on :{self.port}")

    def web_command(self) -> list[str]:
        return [
            PYTHON,
            "manage.py",
            "web",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--workers",
            str(self.web_workers),
            "--no-access-log",
            "--log-level",
            "warning",
        ]

    def reset(self) -> None:
        super().reset()
        # The previous measurement ended by terminating every session of the database (so that
        # PostgreSQL reports their commits), the web processes' pooled connections too. A pool
        # that finds its connections dead waits 1 s, then 2 s, between checks before it has
        # fresh ones: take that wait here, in every web process, not in the next measurement.
        with concurrent.futures.ThreadPoolExecutor(8 * self.web_workers) as pool:
            list(
                pool.map(
                    lambda _: httpx.get(f"{self.base_url}/readyz", timeout=30),
                    range(8 * self.web_workers),
                )
            )

    def enqueuer_target(self) -> list[str]:
        return ["rest", "--url", self.base_url, "--token", self.project.token]

    def worker_args(self, batch: int, run_dir: RunDir) -> tuple[list[str], dict[str, str]]:
        return (
            [
                PYTHON,
                "-m",
                "bench.workers.sdk_worker",
                "--url",
                self.base_url,
                "--token",
                self.project.token,
                "--batch",
                str(batch),
                "--out",
                str(run_dir.path),
                "--go",
                str(run_dir.go),
            ],
            common.django_env(self.project.url),
        )


class HttpCeilingSystem(RestSystem):
    """The SDK workers against bench/workers/http_ceiling.py: the web tier's floor."""

    name = "http"

    def web_command(self) -> list[str]:
        return [
            PYTHON,
            "-m",
            "bench.workers.http_ceiling",
            "--url",
            self.project.url,
            "--port",
            str(self.port),
            "--workers",
            str(self.web_workers),
        ]


class StoreSystem(System):
    name = "store"

    def worker_args(self, batch: int, run_dir: RunDir) -> tuple[list[str], dict[str, str]]:
        return (
            [
                PYTHON,
                "-m",
                "bench.workers.store_worker",
                "--batch",
                str(batch),
                "--out",
                str(run_dir.path),
                "--go",
                str(run_dir.go),
            ],
            common.django_env(self.project.url, SCHEDULER_APPLICATION_NAME="bench:store"),
        )


class RawSystem(System):
    name = "raw"
    runs_only = False

    def worker_args(self, batch: int, run_dir: RunDir) -> tuple[list[str], dict[str, str]]:
        args = [
            PYTHON,
            "-m",
            "bench.workers.raw_worker",
            "--url",
            self.project.url,
            "--batch",
            str(batch),
            "--out",
            str(run_dir.path),
            "--go",
            str(run_dir.go),
        ]
        if self.runs_only:
            args.append("--runs-only")
        return args, common.django_env(self.project.url)


class PeerSystem(System):
    peer = True

    def peer_env(self) -> dict[str, str]:
        return common.django_env(
            self.project.url,
            BENCH_PQ_URL=getattr(self, "pq_url", ""),
            BENCH_REDIS_URL=REDIS_URL,
            BENCH_CELERY_QUEUE=f"bench.{self.scenario}",
        )

    def worker_args(self, batch: int, run_dir: RunDir) -> tuple[list[str], dict[str, str]]:
        return (
            [
                PYTHON,
                "-m",
                "bench.workers.peer_worker",
                self.name,
                "--batch",
                str(batch),
                "--out",
                str(run_dir.path),
                "--go",
                str(run_dir.go),
            ],
            self.peer_env(),
        )

    def _produce(self, *args: str) -> None:
        proc = Procs().start(
            "producer", [PYTHON, "-m", "bench.workers.producer", self.name, *args], self.peer_env()
        )
        if proc.wait() != 0:
            raise RuntimeError(f"{self.name} producer failed ({proc.returncode})")

    def load(self, n: int) -> None:
        self._produce("--count", str(n), "--load")

    def schedule(self, n: int, t0: float, rate: float) -> None:
        raise NotImplementedError("peers get their jobs from a producer process")

    def waiting(self) -> int:
        raise NotImplementedError

    def top_up(self, n: int) -> None:
        """Bring the backlog back to n jobs (loading 20 000 Procrastinate jobs takes longer
        than a quick burn-down point measures)."""
        missing = n - self.waiting()
        if missing > 0:
            self.load(missing)

    def producer_args(self, run_dir: RunDir, **kwargs: Any) -> list[str]:
        if kwargs.get("enqueue"):
            return super().producer_args(run_dir, **kwargs)
        args = [PYTHON, "-m", "bench.workers.producer", self.name, "--go", str(run_dir.go)]
        for key, value in kwargs.items():
            flag = "--" + key.replace("_", "-")
            args += [flag] if value is True else [flag, str(value)]
        return args

    def diagnostics(self) -> dict[str, Any]:
        return {}


class ProcrastinateSystem(PeerSystem):
    name = "procrastinate"

    @property
    def databases(self) -> list[str]:
        return [f"bench_{self.scenario}_pq"]

    def setup(self) -> None:
        self.pq_url = common.recreate_database(self.databases[0])
        os.environ["BENCH_PQ_URL"] = self.pq_url
        from bench.workers import peers

        app, _ = peers.procrastinate_app()
        with app.open():
            app.schema_manager.apply_schema()

    def execute(self, statement: str) -> list[tuple]:
        with common.connect(self.pq_url) as conn:
            cursor = conn.execute(statement)
            return cursor.fetchall() if cursor.description else []

    def reset(self) -> None:
        self.execute(
            "TRUNCATE procrastinate_events, procrastinate_periodic_defers, procrastinate_jobs,"
            " procrastinate_workers CASCADE"
        )

    def load(self, n: int) -> None:
        super().load(n)
        self.execute("VACUUM ANALYZE procrastinate_jobs")

    def waiting(self) -> int:
        return self.execute("SELECT count(*) FROM procrastinate_jobs WHERE status = 'todo'")[0][0]

    def completed(self) -> tuple[int, float]:
        self.monitor_commits += 1
        count, end = self.execute(
            "SELECT (SELECT count(*) FROM procrastinate_jobs WHERE status = 'succeeded'),"
            " (SELECT extract(epoch FROM max(at))::float8 FROM procrastinate_events"
            "  WHERE type = 'succeeded')"
        )[0]
        return int(count), float(end or 0.0)


class CelerySystem(PeerSystem):
    name = "celery"

    @property
    def databases(self) -> list[str]:
        return []

    def extra_pids(self) -> dict[int, str]:
        return common.redis_server_pid()

    def setup(self) -> None:
        self.reset()

    def reset(self) -> None:
        import redis

        client = redis.Redis.from_url(REDIS_URL)
        queue = f"bench.{self.scenario}"
        keys = [queue, "unacked", "unacked_index", "unacked_mutex"]
        keys += [k for k in client.scan_iter(match=f"{queue}*")]
        client.delete(*keys)

    def teardown(self) -> None:
        super().teardown()
        self.reset()

    def waiting(self) -> int:
        import redis

        return redis.Redis.from_url(REDIS_URL).llen(f"bench.{self.scenario}")

    def completed(self) -> tuple[int, float]:
        return self.run_dir_progress()

    def run_dir_progress(self) -> tuple[int, float]:
        return read_progress(self.current_dir.path) if self.current_dir else (0, 0.0)

    current_dir: RunDir | None = None


def make(name: str, scenario: str, project: ProjectDatabase, web_workers: int = 2) -> System:
    cls = {
        "rest": RestSystem,
        "store": StoreSystem,
        "raw": RawSystem,
        "http": HttpCeilingSystem,
        "procrastinate": ProcrastinateSystem,
        "celery": CelerySystem,
    }[name]
    return cls(scenario, project, web_workers)


# --------------------------------------------------------------------------------------------
# The measurement


def measure(
    system: System,
    *,
    scenario: str,
    config: str,
    expected: int,
    workers: int,
    batch: int,
    deadline_after_go: float,
    producer: dict[str, Any] | None = None,
    t0_after_go: float | None = None,
    due_is_go: bool = False,
    on_tick: Callable[[RunDir, float, int], bool] | None = None,
    cap_from_first: bool = True,
    deadline_at: float | None = None,
    prepare: Callable[[], float] | None = None,
    setup_while_starting: Callable[[], None] | None = None,
    keep: bool = False,
) -> Row:
    """Start the workers (and a producer), give the go, wait for `expected` handler calls or the
    deadline, then collect throughput, latency, CPU, commits and RSS."""
    run_dir = RunDir(f"{scenario}-{system.name}")
    if isinstance(system, CelerySystem):
        system.current_dir = run_dir
    system.start_workers(workers, batch, run_dir)
    if setup_while_starting is not None:
        # Untimed work (loading a backlog) while the workers import and connect; they touch
        # nothing before the go.
        setup_while_starting()
    ready = workers
    if producer is not None:
        producer = {k: (str(run_dir.path) if v == "DIR" else v) for k, v in producer.items()}
        args = system.producer_args(run_dir, ready=run_dir.path / "ready-producer", **producer)
        system.procs.start("producer", args, system.peer_env(), run_dir.logs("producer"))
        ready += 1
    common.wait_ready(run_dir.path, ready, system.procs)
    if prepare is not None:
        # Work that must not be timed but must come after the workers are up (inserting runs
        # that fall due at a given time): returns the measurement's deadline (epoch).
        deadline_at = prepare()
    system.monitor_commits = 0
    commits_before = system.xact_commits() if system.databases else None
    sampler = system.sampler().start()
    load_before = common.load_average()
    t_go = time.time()
    t0 = t_go + t0_after_go if t0_after_go is not None else None
    run_dir.go.write_text(f"{t0:.6f}" if t0 else "")
    # The cap counts from the first handler call (some systems take a moment to connect);
    # a system that never starts gets the cap plus 20 s.
    deadline = t_go + deadline_after_go + (20 if cap_from_first else 0)
    if deadline_at is not None:
        deadline = deadline_at
    capped = False
    row_note = ""
    seen_first = False
    while True:
        handled, _ = read_progress(run_dir.path)
        if handled >= expected:
            break
        now = time.time()
        if handled and not seen_first and cap_from_first:
            seen_first = True
            deadline = min(deadline, now + deadline_after_go)
        if now > deadline:
            capped = True
            break
        dead = [d for d in system.procs.dead() if d[0] in ("worker", "web")]
        if dead:
            raise RuntimeError(f"{system.name}: process died {dead}; logs in {run_dir.path}")
        if on_tick and on_tick(run_dir, now, handled):
            row_note = "stopped early"
            break
        time.sleep(0.05)
    t_stop = time.time()
    # Handlers have run; wait (briefly) for the system to record the completions.
    done, end = system.completed()
    settle = time.time() + 10
    while done < min(handled, expected) and time.time() < settle:
        time.sleep(0.1)
        done, end = system.completed()
    usage = sampler.stop()
    load_after = common.load_average()
    system.procs.stop(["worker", "producer"], grace=0.0)
    commits = None
    if commits_before is not None:
        system.flush_backends()
        commits = system.xact_commits() - commits_before - system.monitor_commits
    pairs = read_pairs(run_dir.path)
    first_start = min((start for _, start in pairs), default=t_go)
    if capped:
        end = max(end, deadline) if done < expected else end
    seconds = max(1e-6, end - first_start) if done else 0.0
    due_of = (lambda due: t_go) if due_is_go else (lambda due: due)
    latencies = [start - due_of(due) for due, start in pairs]
    summary = common.latency_summary(latencies)
    row = Row(
        scenario=scenario,
        system=system.name,
        config=config,
        runs=done,
        seconds=round(seconds, 3),
        p50=summary["p50"],
        p99=summary["p99"],
        max=summary["max"],
        cpu_s=usage["cpu_s"],
        commits=commits,
        rss_mb=usage["rss_mb"],
        load=[load_before[0], load_after[0]],
        note=f"capped at {deadline_after_go:.0f}s" if capped else row_note,
        extra={
            "expected": expected,
            "started": len(pairs),
            "cpu_s_by_role": usage["cpu_s_by_role"],
            "first_start_after_go": round(first_start - t_go, 3),
            **system.diagnostics(),
        },
    )
    if t0 is not None:
        row.extra["t0_after_go"] = t0_after_go
    row.extra["_pairs"] = pairs  # for scenario-specific figures; dropped before saving
    row.extra["_t_go"] = t_go
    row.extra["_t_stop"] = t_stop
    if isinstance(system, CelerySystem):
        system.current_dir = None
    run_dir.cleanup(keep)
    return row
