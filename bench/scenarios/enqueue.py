"""(g) Enqueue: runs created per second by an application, through the real API, side by side
with Procrastinate's `defer` / `batch_defer` and Celery's `apply_async` / a Redis pipeline.

One producer process with 4 threads creates N runs at batch B ∈ {1, 100, 1000} (quick: N =
2 000 at B = 1, 20 000 otherwise; full: 10× that; `--runs N`: N, and N / 10 at B = 1). The
product's producer is the SDK's `Client.enqueue_many` (bench/workers/enqueuer.py) against
`manage.py web`, with the enqueue rate limit off. CPU per 1 000 counts the producer and, for
the product, its web processes; commits per 1 000 are the project's database's.

The product also at batch 1 000 with `runs=False` (answered by run id alone), and the HTTP
floor: the same producer sending `GET /healthz` where it would send a run of batch 1 (one
request a run costs at least that much, whatever the request does). Then
enqueue+drain: the same producer (batch 1 000; the product's asking for ids only) creates N
runs (quick: 40 000; full: 10× that) while W worker processes of each system (SDK workers for
the product) claiming B at a time drain them (`--workers` and `--batch`: 2 and 100 by
default); runs/s counts from the first handler start to the last completion, and due→start is
from each run's creation to its handler.
"""

from __future__ import annotations

import json
import statistics
import subprocess

import psutil

from bench import common
from bench.common import PYTHON, Row, log
from bench.systems import ProjectDatabase, make, measure

SYSTEMS = ("rest", "procrastinate", "celery")


def commits(url: str) -> int:
    with common.connect(url) as conn:
        conn.execute("SELECT pg_stat_clear_snapshot()")
        return conn.execute(
            "SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()"
        ).fetchone()[0]


def cpu(pids: list[int]) -> float:
    """The CPU seconds of these processes; `pids` holds the web processes' children already
    (Procs.pids), so none is counted twice."""
    total = 0.0
    for pid in pids:
        try:
            times = psutil.Process(pid).cpu_times()
            total += times.user + times.system
        except psutil.NoSuchProcess:
            pass
    return total


def produce(args: list[str], env: dict[str, str], count: int, batch: int) -> dict:
    """Run the producer process; its JSON line (count, seconds, cpu_s)."""
    out = subprocess.run(
        [
            PYTHON,
            "-m",
            "bench.workers.enqueuer",
            *args,
            "--count",
            str(count),
            "--batch",
            str(batch),
            "--threads",
            "4",
        ],
        env=env,
        capture_output=True,
        text=True,
    )
    if out.returncode:
        raise RuntimeError(f"the producer failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def run(opts) -> list[Row]:
    scale = 1 if opts.quick else 10
    n = opts.runs or 20_000 * scale
    # (batch, runs, variant): the product also at batch 1 000 answered by id alone, and the
    # HTTP floor beside its batch 1.
    points = [
        (1, n // 10, ""),
        (1, n // 10, "floor"),
        (100, n, ""),
        (1000, n, ""),
        (1000, n, "ids"),
    ]
    project = ProjectDatabase("enqueue")
    rows: list[Row] = []
    names = [s for s in opts.systems if s in SYSTEMS] or list(SYSTEMS)
    # `--rounds R`: the systems one after the other, R times over, enqueue+drain in the first
    # round only. This machine's speed drifts by a quarter between minutes, so a ratio of two
    # systems measured minutes apart is read from rounds (bench/README.md, "Rounds").
    for round_ in range(1, opts.rounds + 1):
        for name in names:
            rows += measure_system(name, project, points, opts, scale, round_)
    if opts.rounds > 1:
        log_rounds(rows)
    return rows


def measure_system(name: str, project, points, opts, scale: int, round_: int) -> list[Row]:
    """One system's points (batch, runs, variant), on a fresh set-up of it; enqueue+drain in
    round 1."""
    rows: list[Row] = []
    system = make(name, "enqueue", project, opts.web_workers)
    # Limits off: the producer measures the path, not the budget.
    extra_env = {
        "SCHEDULER_API_RATE_ENQUEUE": "1000000000/s",
        "SCHEDULER_API_RATE_MANAGE": "1000000000/s",
    }
    if name == "rest":
        system.web_env = extra_env
    system.setup()
    try:
        if name == "rest":
            args = ["rest", "--url", system.base_url, "--token", project.token]
            env = common.django_env(project.url)
            db_url, servers = project.url, list(system.procs.pids())
            # Unmeasured: each web worker's first requests import and build what the
            # API needs (seconds of CPU), which 2 000 measured runs would carry.
            produce(args, env, 400, 1)
        else:
            args = [name]
            env = {**common.django_env(project.url), **system.peer_env()}
            db_url = getattr(system, "pq_url", None)
            servers = []
        for batch, count, variant in points:
            if variant and name != "rest":
                continue
            system.reset()
            before_commits = commits(db_url) if db_url else None
            before_cpu = cpu(servers)
            flag = {"": [], "ids": ["--ids-only"], "floor": ["--http-floor"]}[variant]
            answer = produce(args + flag, env, count, batch)
            server_cpu = cpu(servers) - before_cpu
            row = Row(
                scenario="enqueue",
                system=system.label,
                config=f"batch {batch}" + (f" {variant}" if variant else ""),
                runs=answer["count"],
                seconds=answer["seconds"],
                cpu_s=answer["cpu_s"] + server_cpu,
                commits=(commits(db_url) - before_commits) if db_url else None,
                note={
                    "rest": {
                        "": "Client.enqueue_many → POST /api/v1/runs",
                        "ids": "Client.enqueue_many → POST /api/v1/runs (runs=False: ids only)",
                        "floor": "GET /healthz per run: the HTTP floor, no run made",
                    }[variant],
                    "procrastinate": "defer" if batch == 1 else "batch_defer",
                    "celery": "apply_async" if batch == 1 else "Redis pipeline",
                }[name],
            )
            row.extra["round"] = round_
            log(f"  {system.label:<20} {row.config:<16}: {row.rate:,.0f} runs/s")
            rows.append(row)
        if round_ == 1:
            rows.append(drain(system, opts, scale))
    finally:
        system.teardown()
    return rows


def log_rounds(rows: list[Row]) -> None:
    """Each configuration's median over the rounds, and the product's ratio to each peer's
    batch of the same size, round by round (the two measured minutes apart, not hours)."""
    by: dict[tuple[str, str], dict[int, float]] = {}
    for row in rows:
        if row.scenario == "enqueue" and row.rate:
            by.setdefault((row.system, row.config), {})[row.extra["round"]] = row.rate
    for (system, config), rates in by.items():
        log(
            f"  {system:<20} {config:<16}: median {statistics.median(rates.values()):,.0f} "
            f"runs/s over {len(rates)} rounds"
        )
    ours = {
        config: rates for (system, config), rates in by.items() if system.startswith("cronlease")
    }
    for (system, config), theirs in by.items():
        if system.startswith("cronlease"):
            continue
        for mine in (config, f"{config} ids"):
            if mine in ours:
                ratios = [ours[mine][r] / theirs[r] for r in sorted(theirs) if r in ours[mine]]
                log(
                    f"  ×{system} at {mine}: "
                    + ", ".join(f"{x:.2f}" for x in ratios)
                    + f" (median {statistics.median(ratios):.2f})"
                )


def drain(system, opts, scale: int, batch: int = 1000) -> Row:
    """Producers and workers at once: runs created through the system's producer API while its
    workers (`--workers`, claiming `--batch`) drain them, end to end."""
    count = 40_000 * scale
    workers, claim = opts.workers, opts.batch
    system.reset()
    row = measure(
        system,
        scenario="enqueue+drain",
        config=f"batch {batch} b={claim} w={workers}",
        expected=count,
        workers=workers,
        batch=claim,
        deadline_after_go=opts.cap or 60.0 * scale,
        producer={
            "enqueue": True,
            "count": count,
            "batch": batch,
            "threads": 4,
            **({"ids_only": True} if system.name == "rest" else {}),
        },
        keep=opts.keep,
    )
    log(f"  {system.label:<20} enqueue+drain: {row.runs} runs, {(row.rate or 0):,.0f}/s {row.note}")
    return row
