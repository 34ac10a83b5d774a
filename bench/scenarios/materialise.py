"""(d) Materialisation: N hourly definitions all due in the same minute, turned into runs.

- cronlease store: bench/materialise.py (the scheduler's own step methods, one node, all 16
  shards, in-process), with its --json figures.
- cronlease REST+SDK column: the real `manage.py scheduler` daemon, two processes splitting
  the shards (the definitions stay paused until both hold shards, then are resumed at once),
  timed from the first run inserted until all N exist (polled every 0.25 s).
- raw SQL: one set-based INSERT … SELECT + UPDATE per batch of 5 000 (workers/raw_materialise.py).
- Procrastinate: its PeriodicDeferrer, K `@app.periodic` entries; Celery: beat's scheduler, K
  entries (workers/peer_periodic.py). K = min(N, 20 000) in --quick, min(N, 100 000) otherwise,
  and a time cap: both defer or send one entry per call, so their rate is what counts.

The definitions are loaded once (untimed, by bench/materialise.py --load-only, due 4 minutes
ahead) and each project variant runs on its own copy of that database (CREATE DATABASE …
TEMPLATE), dropped afterwards.
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

from bench import common
from bench.common import PYTHON, REPO, Procs, Row, RunDir, Sampler, log
from bench.systems import ProjectDatabase, make

DUE_MINUTES = 4  # every variant must be done before the definitions fall due


def _materialise_py(url: str, n: int, *extra: str) -> None:
    done = subprocess.run(
        [
            PYTHON,
            "bench/materialise.py",
            "--no-recreate",
            "--database-url",
            url,
            "--definitions",
            str(n),
            *extra,
        ],
        cwd=REPO,
        env=common.django_env(url, SCHEDULER_APPLICATION_NAME="bench:materialise"),
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode:
        raise RuntimeError(f"bench/materialise.py failed:\n{done.stdout}\n{done.stderr}")


def _oneshot(
    label: str,
    args: list[str],
    env: dict[str, str],
    databases: list[str],
    extra_pids: dict[int, str] | None = None,
    timeout: float = 600,
) -> tuple[dict, dict, int | None]:
    """Run a process that waits for the go file and writes result.json; sample it meanwhile."""
    run_dir = RunDir(label)
    procs = Procs()
    procs.start(
        "worker",
        [*args, "--out", str(run_dir.path), "--go", str(run_dir.go)],
        env,
        run_dir.logs("worker"),
    )
    common.wait_ready(run_dir.path, 1, procs)
    before = common.xact_commits(databases) if databases else None
    sampler = Sampler(procs, databases, extra_pids).start()
    run_dir.go.touch()
    deadline = time.time() + timeout
    result = run_dir.path / "result.json"
    while not result.exists():
        if procs.dead() and not result.exists():
            raise RuntimeError(f"{label} failed: see {run_dir.path}")
        if time.time() > deadline:
            raise RuntimeError(f"{label} timed out")
        time.sleep(0.1)
    usage = sampler.stop()
    procs.stop()
    commits = None
    if databases:
        common.flush_backends(databases)
        commits = common.xact_commits(databases) - before
    figures = json.loads(result.read_text())
    run_dir.cleanup()
    return figures, usage, commits


def run(opts) -> list[Row]:
    n = opts.definitions or (100_000 if opts.quick else 1_000_000)
    k = min(n, 20_000 if opts.quick else 100_000)
    cap = opts.cap or (4.0 if opts.quick else 120.0)
    project = ProjectDatabase("materialise")
    project.ensure()
    if {"rest", "store", "raw"} & set(opts.systems):
        started = time.perf_counter()
        _materialise_py(project.url, n, "--load-only", "--due-minutes", str(DUE_MINUTES))
        log(f"  loaded {n:,} definitions in {time.perf_counter() - started:.0f}s")
    rows: list[Row] = []
    config = "hourly defs due now"
    for name in opts.systems:
        load = [common.load_average()[0]]
        clone = None
        if name in ("rest", "store", "raw"):
            # Each variant on its own copy of the loaded database.
            clone = ProjectDatabase(f"materialise_{name}")
            clone.url = common.clone_database(project.name, clone.name)
            url = clone.url
        if name == "store":
            scratch = RunDir("materialise-store")
            out = scratch.path / "figures.json"
            _materialise_py(url, n, "--skip-load", "--json", str(out))
            f = json.loads(out.read_text())
            scratch.cleanup()
            row = Row(
                "materialise",
                name,
                config,
                runs=f["runs"],
                seconds=round(f["seconds"], 3),
                cpu_s=round(f["cpu_s_python"] + f["cpu_s_backend"], 2),
                commits=f["commits"],
                rss_mb={k2: round(v, 1) for k2, v in f["rss_mb"].items()},
                note=f"{n:,} defs; Scheduler steps in-process, 1 node",
                extra={"cpu_s_python": f["cpu_s_python"], "cpu_s_backend": f["cpu_s_backend"]},
            )
        elif name == "rest":
            row = _daemons(clone, n, cap_after_start=max(cap, 120.0))
        elif name == "raw":
            figures, usage, commits = _oneshot(
                "materialise-raw",
                [PYTHON, "-m", "bench.workers.raw_materialise", "--url", url],
                common.django_env(url),
                [clone.name],
            )
            row = Row(
                "materialise",
                name,
                config,
                runs=figures["runs"],
                seconds=round(figures["seconds"], 3),
                cpu_s=usage["cpu_s"],
                commits=commits,
                rss_mb=usage["rss_mb"],
                note=f"{n:,} defs; set-based, batches of 5 000",
            )
        else:
            system = make(name, "materialise", project)
            system.setup()
            system.reset()
            try:
                figures, usage, commits = _oneshot(
                    f"materialise-{name}",
                    [
                        PYTHON,
                        "-m",
                        "bench.workers.peer_periodic",
                        name,
                        "--count",
                        str(k),
                        "--cap",
                        str(cap),
                    ],
                    system.peer_env(),
                    system.databases,
                    system.extra_pids(),
                )
            finally:
                system.teardown()
            what = "PeriodicDeferrer" if name == "procrastinate" else "beat Scheduler.tick"
            row = Row(
                "materialise",
                name,
                config,
                runs=figures["runs"],
                seconds=round(figures["seconds"], 3),
                cpu_s=usage["cpu_s"],
                commits=commits,
                rss_mb=usage["rss_mb"],
                note=f"{k:,} entries; {what}"
                + (f"; capped at {cap:.0f}s" if figures["runs"] < k else ""),
            )
        if clone is not None:
            common.drop_database(clone.name)
        row.load = load + [common.load_average()[0]]
        log(f"  {name:<14} {row.runs:,} runs in {row.seconds:.1f}s ({(row.rate or 0):,.0f}/s)")
        rows.append(row)
    return rows


def _daemons(project: ProjectDatabase, n: int, cap_after_start: float) -> Row:
    url = project.url
    procs = Procs()
    before = common.xact_commits([project.name])
    sampler = Sampler(procs, [project.name])
    env = common.django_env(
        url, SCHEDULER_LOOKAHEAD_SECONDS="300", SCHEDULER_APPLICATION_NAME="bench:scheduler"
    )
    log_path = Path(f"/tmp/bench-scheduler-{project.name}.log")
    # In service the definitions fall due while the nodes run, each holding its share of the
    # shards. Started together on due definitions, the first node to come up would hold all 16
    # shards and materialise everything alone before the second got any. So: paused until both
    # nodes hold shards, then resumed in one statement (not timed).
    with common.connect(url) as conn:
        conn.execute("UPDATE jobs_jobdefinition SET paused = true")
    for _ in range(2):
        procs.start("scheduler", [PYTHON, "manage.py", "scheduler"], env, log_path)
    with common.connect(url) as conn:
        deadline = time.time() + 60
        while (
            conn.execute(
                "SELECT count(DISTINCT owner) FROM scheduler_shardlease"
                " WHERE owner <> '' AND expires_at > now()"
            ).fetchone()[0]
            < 2
        ):
            if time.time() > deadline or procs.dead():
                raise RuntimeError(f"the two schedulers did not share the shards; see {log_path}")
            time.sleep(0.2)
        conn.execute("UPDATE jobs_jobdefinition SET paused = false")
    sampler.start()
    started = time.time()
    polls = 0
    count = 0
    done_at = None
    with common.connect(url) as conn:
        while time.time() - started < cap_after_start:
            polls += 1
            count = conn.execute("SELECT count(*) FROM runs_run").fetchone()[0]
            if count >= n:
                done_at = time.time()
                break
            if procs.dead():
                raise RuntimeError(f"scheduler died; see {log_path}")
            time.sleep(0.25)
        polls += 1
        first = conn.execute(
            "SELECT extract(epoch FROM min(created_at))::float8 FROM runs_run"
        ).fetchone()[0]
    usage = sampler.stop()
    procs.stop(grace=10)
    common.flush_backends([project.name])
    commits = common.xact_commits([project.name]) - before - polls
    end = done_at or time.time()
    return Row(
        "materialise",
        "rest",
        "hourly defs due now",
        runs=count,
        seconds=round(end - first, 3) if first else 0.0,
        cpu_s=usage["cpu_s"],
        commits=commits,
        rss_mb=usage["rss_mb"],
        note=f"{n:,} defs; `manage.py scheduler` ×2" + ("" if done_at else " (capped)"),
        extra={"cpu_s_by_role": usage["cpu_s_by_role"]},
    )
