"""(h) Shards: the same burn-down on one database and with the 16 shards on three servers.

Three private PostgreSQL servers A, B, C (bench/common.py `private_server`, with
pg_stat_statements loaded). Two layouts of the project, each its own databases:

- **1 database**: `bench_shards_one` on A holds the control tables and every shard (no
  `SCHEDULER_SHARD_DATABASES`, the default deployment);
- **3 databases**: the control database `bench_shards_control` on A holds no shard, and
  `bench_shards_data` on A, B and C hold shards 0-5, 6-10 and 11-15.

The workload: a backlog of N ready runs (quick 20 000, full 200 000) spread evenly over 64 no-op
jobs, four on each shard (bench/common.py `job_names`), drained by `--workers` processes claiming
`--batch` at a time, from the first handler start to the last completion, as in the burn-down.
Two systems: REST+SDK (`manage.py web` with the layout's map, SDK workers) and the store layer
(bench/workers/store_worker.py `--leasing`: apps/runs/leasing.py's claim from every shard
database, as the lease endpoint does, without HTTP). The sharded row's note gives its runs/s
against one database's.

The capacity model: with the shards elsewhere, what is left on the control database per run.
Each row's `per_1k_runs` (in the results file, and logged) gives, per database, per 1 000 runs:
commits (pg_stat_database `xact_commit`: every transaction, the connection pools' empty checks
too), statements sent (pg_stat_statements `calls`, BEGIN and COMMIT included, the per-row
foreign-key checks left out), milliseconds executing them (`total_exec_time`: planning, parsing
and the round trip not included) and milliseconds of CPU of its PostgreSQL processes (psutil,
as the CPU column). The sharded row's `shard_servers_per_control` divides the shard databases'
figure per run by the control database's: how many shard servers, each as busy as its own runs
make it, one control server of the same size keeps up with, by each measure.
"""

from __future__ import annotations

import contextlib
import subprocess
import time
from collections.abc import Iterator
from typing import Any, NamedTuple
from urllib.parse import urlparse

import psutil

from bench import common
from bench.common import Row, RunDir, Sampler, log
from bench.systems import ProjectDatabase, RestSystem, StoreSystem, System, measure

SYSTEMS = ("rest", "store")
JOBS_PER_SHARD = 4
# pg_stat_statements needs loading at start; every server of both layouts has it, so its cost
# (a hash and a counter update per statement) is the same on both sides.
STATEMENTS = "-c shared_preload_libraries=pg_stat_statements"
# A run id is `sequence value × ID_SPACE + shard` (apps/runs/shards.py): the store finds a run's
# database from its id, so the bench's own inserts make ids the same way.
ID_SPACE = 1024

INSERT_RUNS = f"""
INSERT INTO runs_run (
    id, definition_id, team_id, queue, priority, shard, state, trigger, due_at, available_at,
    attempt, max_attempts, idempotency_key, lease_seconds, worker_id, dry_run, payload,
    payload_key, created_at
)
SELECT nextval('runs_run_id_seq') * {ID_SPACE} + d.shard, d.id, d.team_id, d.queue, d.priority,
       d.shard, 'scheduled', 'api', to_timestamp(%(t0)s), to_timestamp(%(t0)s), 0,
       d.retry_max_attempts, %(tag)s || '-' || g, 60, '', d.dry_run, d.payload, d.payload_key,
       now()
FROM jobs_jobdefinition d
CROSS JOIN generate_series(1, %(per_job)s::bigint) AS g
WHERE d.name = ANY(%(jobs)s) AND d.shard = ANY(%(shards)s)
"""
COMPLETED = (
    "SELECT count(*) FILTER (WHERE state = 'succeeded'),"
    " coalesce(extract(epoch FROM max(finished_at))::float8, 0) FROM runs_run"
)
CLAIMS = (
    "SELECT count(*), count(DISTINCT (worker_id, started_at)) FROM runs_run"
    " WHERE started_at IS NOT NULL"
)
# Per database: commits (each a transaction, read-only and empty ones too: the pools' checks of a
# connection are an empty query), statements sent (pg_stat_statements, BEGIN and COMMIT
# included; not the foreign-key checks PostgreSQL runs for each row inside a statement, nor the
# bench's own reads) and the execution time of everything it ran.
COUNTERS = """
SELECT d.datname, d.xact_commit,
       coalesce(sum(s.calls) FILTER (
           WHERE s.query NOT LIKE '%% FOR KEY SHARE OF x' AND s.query NOT LIKE %(ours)s), 0),
       coalesce(sum(s.total_exec_time) FILTER (WHERE s.query NOT LIKE %(ours)s), 0)
FROM pg_stat_database d LEFT JOIN pg_stat_statements s ON s.dbid = d.datid
WHERE d.datname = ANY(%(names)s)
GROUP BY d.datname, d.xact_commit
"""
OURS = "SELECT count(*) FILTER (WHERE state = $1)%"


class Counters(NamedTuple):
    commits: int
    statements: int
    exec_ms: float


class Place:
    """One database of a layout: its server, name, and the shards it holds."""

    def __init__(self, label: str, server: str, name: str, shards: range | None) -> None:
        self.label = label
        self.server = server
        self.name = name
        self.shards = shards
        self.url = server.rsplit("/", 1)[0] + f"/{name}"

    def query(self, statement: str, params: Any = None) -> list[tuple]:
        with common.connect(self.url) as conn:
            cursor = conn.execute(statement, params)
            return cursor.fetchall() if cursor.description else []


class Layout(ProjectDatabase):
    """The project's databases in one layout: `places[0]` is the control database; the places
    with shards hold them (the control database too when it is the only one)."""

    def __init__(self, label: str, places: list[Place]) -> None:
        super().__init__("shards")
        self.label = label
        self.places = places
        self.url = places[0].url
        self._tag = 0

    @property
    def shard_places(self) -> list[Place]:
        return [place for place in self.places if place.shards is not None]

    @property
    def env(self) -> dict[str, str]:
        """The settings of the layout's product processes: its shard map, if it has one."""
        if self.shard_places == self.places[:1]:
            return {}
        entries = [f"{p.shards[0]}-{p.shards[-1]}={p.url}" for p in self.shard_places]
        return {"SCHEDULER_SHARD_DATABASES": ";".join(entries)}

    def ensure(self) -> None:
        """Built by `build`, before any system starts."""

    def reset(self) -> None:
        for place in self.shard_places:
            place.query("TRUNCATE runs_attempt, runs_run")

    def load(self, n: int) -> None:
        """A backlog of n runs, claimable now, spread evenly over the jobs of every shard."""
        self._tag += 1
        jobs = common.job_names(JOBS_PER_SHARD)
        for place in self.shard_places:
            place.query(
                INSERT_RUNS,
                {
                    "t0": time.time() - 1.0,
                    "tag": f"s{self._tag}",
                    "per_job": n // len(jobs),
                    "jobs": jobs,
                    "shards": list(place.shards),
                },
            )
            place.query("VACUUM ANALYZE runs_run")
            place.query("VACUUM ANALYZE runs_attempt")

    def counters(self) -> dict[str, Counters]:
        """Each database's counters so far, by its label, read from `postgres` of its server so
        that the reading does not count itself."""
        found: dict[str, Counters] = {}
        for server in dict.fromkeys(place.server for place in self.places):
            here = {place.name: place.label for place in self.places if place.server == server}
            with common.connect(server) as conn:
                conn.execute("SELECT pg_stat_clear_snapshot()")
                rows = conn.execute(COUNTERS, {"names": list(here), "ours": OURS}).fetchall()
            for name, commits, statements, exec_ms in rows:
                found[here[name]] = Counters(int(commits), int(statements), float(exec_ms))
        return found


class PlaceSampler(Sampler):
    """The measurement's sampler, which also adds up the CPU of each database's PostgreSQL
    processes (backends, autovacuum workers): by the database its title names and the port of
    its server (its parent, the postmaster, started with `-p PORT`)."""

    def __init__(self, system: OnLayout) -> None:
        super().__init__(system.procs, system.databases, system.extra_pids())
        self.label_of = {
            (str(urlparse(place.server).port), place.name): place.label
            for place in system.project.places
        }
        self.place_of: dict[int, str] = {}

    def _pg(self) -> dict[int, str]:
        found = super()._pg()
        for pid in found.keys() - self.place_of.keys():
            try:
                process = psutil.Process(pid)
                title = " ".join(process.cmdline()) + " "
                server = process.parent().cmdline() if process.parent() else []
            except psutil.Error:
                continue
            port = server[server.index("-p") + 1] if "-p" in server else ""
            for (at, name), label in self.label_of.items():
                if at == port and f" {name} " in title:
                    self.place_of[pid] = label
        return found

    def cpu_by_place(self) -> dict[str, float]:
        """CPU seconds of each database's processes since the first sample."""
        cpu = dict.fromkeys(self.label_of.values(), 0.0)
        for pid, label in self.place_of.items():
            cpu[label] += max(0.0, self.last.get(pid, 0.0) - self.base.get(pid, 0.0))
        return cpu


class OnLayout(System):
    """What a system does differently on a layout of several databases: count and read every
    database of the layout, on every server."""

    project: Layout

    def __init__(self, project: Layout, web_workers: int) -> None:
        super().__init__("shards", project, web_workers)
        # The counters at each `xact_commits` call: `measure` calls it before and after.
        self.snapshots: list[dict[str, Counters]] = []
        self.last_sampler: PlaceSampler | None = None

    @property
    def databases(self) -> list[str]:
        return list(dict.fromkeys(place.name for place in self.project.places))

    def load(self, n: int) -> None:
        self.project.load(n)

    def xact_commits(self) -> int:
        self.snapshots.append(self.project.counters())
        return sum(counters.commits for counters in self.snapshots[-1].values())

    def sampler(self) -> PlaceSampler:
        self.last_sampler = PlaceSampler(self)
        return self.last_sampler

    def flush_backends(self) -> None:
        for server in dict.fromkeys(place.server for place in self.project.places):
            common.flush_backends(self.databases, server)

    def completed(self) -> tuple[int, float]:
        # One statement, so one commit, on every shard database per call; `measure` subtracts
        # `monitor_commits` from the total, `capacity` each database's share.
        self.monitor_commits += len(self.project.shard_places)
        counts = [place.query(COMPLETED)[0] for place in self.project.shard_places]
        return sum(int(c) for c, _ in counts), max(float(end) for _, end in counts)

    def diagnostics(self) -> dict[str, Any]:
        claims = [place.query(CLAIMS)[0] for place in self.project.shard_places]
        leased, distinct = sum(c for c, _ in claims), sum(d for _, d in claims)
        out: dict[str, Any] = {"mean_claim_size": round(leased / distinct, 1) if distinct else None}
        if len(self.snapshots) >= 2 and leased:
            reads = self.monitor_commits // len(self.project.shard_places)
            cpu = self.last_sampler.cpu_by_place() if self.last_sampler else {}
            out.update(capacity(self.project, *self.snapshots[-2:], cpu, reads, leased))
        return out


class LayoutRest(OnLayout, RestSystem):
    def setup(self) -> None:
        self.web_env = {**self.web_env, **self.project.env}
        super().setup()

    def worker_args(self, batch: int, run_dir: RunDir) -> tuple[list[str], dict[str, str]]:
        args, env = super().worker_args(batch, run_dir)
        return [*args, "--jobs-per-shard", str(JOBS_PER_SHARD)], env


class LayoutStore(OnLayout, StoreSystem):
    def worker_args(self, batch: int, run_dir: RunDir) -> tuple[list[str], dict[str, str]]:
        args, env = super().worker_args(batch, run_dir)
        return [*args, "--leasing"], {**env, **self.project.env}


def capacity(
    layout: Layout,
    before: dict[str, Counters],
    after: dict[str, Counters],
    cpu: dict[str, float],
    monitor_reads: int,
    runs: int,
) -> dict[str, Any]:
    """Commits, statements, execution time and CPU of PostgreSQL per 1 000 runs of each
    database, and how many shard databases as busy as these one control database keeps up
    with."""
    per_1k: dict[str, dict[str, float]] = {}
    for place in layout.places:
        # The bench's reads of progress: one commit on each shard database per read.
        own = monitor_reads if place.shards is not None else 0
        commits = after[place.label].commits - before[place.label].commits - own
        statements = after[place.label].statements - before[place.label].statements
        exec_ms = after[place.label].exec_ms - before[place.label].exec_ms
        per_1k[place.label] = {
            "commits": round(1000 * commits / runs, 1),
            "statements": round(1000 * statements / runs, 1),
            "exec_ms": round(1000 * exec_ms / runs, 2),
            "cpu_ms": round(1e6 * cpu.get(place.label, 0.0) / runs, 1),
        }
    out: dict[str, Any] = {"per_1k_runs": per_1k}
    control = per_1k[layout.places[0].label]
    if layout.places[0].shards is None:
        # Per shard database, as the model asks how many of them one control database serves.
        shards = [per_1k[place.label] for place in layout.shard_places]
        out["shard_servers_per_control"] = {
            key: round(sum(s[key] for s in shards) / control[key], 1) if control[key] else None
            for key in ("commits", "exec_ms", "cpu_ms")
        }
    return out


@contextlib.contextmanager
def build() -> Iterator[tuple[Layout, Layout]]:
    """Start the three servers and make both layouts' databases; yield the two layouts."""
    with contextlib.ExitStack() as stack:
        started = time.perf_counter()
        a, b, c = (stack.enter_context(common.private_server(STATEMENTS)) for _ in range(3))
        for server in (a, b, c):
            with common.connect(server) as conn:
                conn.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
        log(f"  three private servers in {time.perf_counter() - started:.1f}s")
        one = Layout("1 database", [Place("A: control+shards", a, "bench_shards_one", range(16))])
        three = Layout(
            "3 databases",
            [
                Place("A: control", a, "bench_shards_control", None),
                Place("A: shards 0-5", a, "bench_shards_data", range(0, 6)),
                Place("B: shards 6-10", b, "bench_shards_data", range(6, 11)),
                Place("C: shards 11-15", c, "bench_shards_data", range(11, 16)),
            ],
        )
        with common.on_server(a):
            # The template on A is migrated once, then copied: within A as a template, to B
            # and C by pg_dump.
            for place in [*one.places, *three.places[:2]]:
                _, token = common.fresh_project_database(place.name)
            template = common.db_url(common.TEMPLATE)
        for place in three.places[2:]:
            common.copy_database(template, place.url)
        for layout in (one, three):
            layout.token = token
            done = subprocess.run(
                [
                    common.PYTHON,
                    "-m",
                    "bench.workers.setup_project",
                    "--jobs-per-shard",
                    str(JOBS_PER_SHARD),
                ],
                cwd=common.REPO,
                env=common.django_env(layout.url, **layout.env),
                check=False,
            )
            if done.returncode:
                raise RuntimeError(f"setting up the jobs of {layout.label} failed")
        log(f"  both layouts ready in {time.perf_counter() - started:.1f}s")
        yield one, three


def run(opts) -> list[Row]:
    jobs = len(common.job_names(JOBS_PER_SHARD))
    n = (opts.runs or (20_000 if opts.quick else 200_000)) // jobs * jobs  # the same per job
    cap = opts.cap or (10.0 if opts.quick else 90.0)
    names = [s for s in opts.systems if s in SYSTEMS] or list(SYSTEMS)
    rows: list[Row] = []
    with build() as layouts:
        for name in names:
            measured = []
            for layout in layouts:
                system = {"rest": LayoutRest, "store": LayoutStore}[name](layout, opts.web_workers)
                system.setup()
                try:
                    system.reset()
                    row = measure(
                        system,
                        scenario="shards",
                        config=f"{layout.label} b={opts.batch} w={opts.workers}",
                        expected=n,
                        workers=opts.workers,
                        batch=opts.batch,
                        deadline_after_go=cap,
                        due_is_go=True,
                        setup_while_starting=lambda system=system: system.load(n),
                        keep=opts.keep,
                    )
                finally:
                    system.teardown()
                log(
                    f"  {system.label:<20} {layout.label}: {row.runs} runs, "
                    f"{(row.rate or 0):,.0f}/s {row.note}"
                )
                for label, figures in row.extra.get("per_1k_runs", {}).items():
                    log(
                        f"    {label:<18} per 1 000 runs: {figures['commits']:,.0f} commits, "
                        f"{figures['statements']:,.0f} statements, "
                        f"{figures['exec_ms']:,.1f} ms executing, "
                        f"{figures['cpu_ms']:,.0f} ms CPU"
                    )
                measured.append(row)
            one, three = measured
            if one.rate and three.rate:
                three.extra["x_one_database"] = round(three.rate / one.rate, 2)
                three.note = " ".join(
                    filter(None, [three.note, f"×{three.rate / one.rate:.2f} of 1 database"])
                )
                per_control = three.extra.get("shard_servers_per_control", {})
                log(
                    f"  {name}: 3 databases at {three.rate / one.rate:.2f}× one database; "
                    f"shard servers per control server: {per_control.get('commits')} by commits, "
                    f"{per_control.get('exec_ms')} by execution time, "
                    f"{per_control.get('cpu_ms')} by CPU"
                )
            rows.extend(measured)
    return rows
