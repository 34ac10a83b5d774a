"""Where the time goes (not part of `all`): py-spy profiles and EXPLAIN (ANALYZE, BUFFERS).

    python -m bench profile [--runs 20000] [--seconds 12]

1. A backlog of runs; one store-layer worker (batch 100) under `py-spy record`, summarised
   as the functions with the most samples (own and including callees).
2. The same backlog through the REST API: uvicorn with one worker process under py-spy while
   two SDK workers (batch 100) drain it.
3. EXPLAIN (ANALYZE, BUFFERS) of the claim and complete statements (store and raw), on a
   fresh backlog of the same size.
Everything goes to stdout and to bench/results/profile-*.txt.
"""

from __future__ import annotations

import collections
import shutil
import signal
import subprocess
import time
from pathlib import Path

import psutil

from bench import common
from bench.common import PYTHON, REPO, RESULTS_DIR, Procs, RunDir, log
from bench.recorder import read_progress
from bench.systems import ProjectDatabase, make


def summarise(
    raw_path: Path,
    within: tuple[str, ...] = (),
    top: int = 25,
    without: tuple[str, ...] = ("_find_and_load",),
) -> str:
    """py-spy's raw format: one collapsed stack per line, `frame;frame;… count`.

    `within`: keep only the stacks that pass through one of these functions (the work loop,
    not start-up or an idle event loop); `without`: drop those through any of these (imports:
    a uvicorn worker's first requests import the API, which made a fifth of its samples);
    percentages are of the samples kept."""
    own: collections.Counter[str] = collections.Counter()
    total: collections.Counter[str] = collections.Counter()
    samples = 0
    for line in raw_path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack:
            continue
        n = int(count)
        samples += n
        frames = [
            f.split(" (")[0]
            + " ("
            + f.split(" (")[1]
            .split(":")[0]
            .replace(str(REPO) + "/", "")
            .replace(".venv/lib/python3.11/site-packages/", "")
            + ")"
            if " (" in f
            else f
            for f in stack.split(";")
        ]
        if within and not any(any(w in frame for w in within) for frame in frames):
            continue
        if any(any(w in frame for w in without) for frame in frames):
            continue
        own[frames[-1]] += n
        for frame in set(frames):
            total[frame] += n
    kept = sum(own.values())
    lines = [f"{kept} samples" + (f" (of {samples}) inside {', '.join(within)}" if within else "")]
    samples = kept or 1
    lines.append("  own%  function")
    lines += [f"{100 * n / samples:6.1f}  {name}" for name, n in own.most_common(top)]
    lines.append("  incl%  function")
    lines += [f"{100 * n / samples:6.1f}  {name}" for name, n in total.most_common(top + 45)]
    return "\n".join(lines)


def pyspy_command(out: Path) -> list[str]:
    """py-spy record in raw (collapsed) format; only samples of threads that are running or
    waiting on I/O are kept (py-spy's default drops idle threads). py-spy starts the process
    itself: this machine's Python is built so that py-spy cannot attach to a running one."""
    exe = shutil.which("py-spy") or str(Path(PYTHON).parent / "py-spy")
    return [exe, "record", "--format", "raw", "--rate", "250", "--nonblocking", "-o", str(out)]


def pyspy(args: list[str], out: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    return subprocess.Popen(
        [*pyspy_command(out), *args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        cwd=REPO,
        env=env,
    )


def run(opts) -> list:
    n = opts.runs or 20_000
    seconds = opts.seconds or 12.0
    project = ProjectDatabase("profile")
    project.ensure()
    report: list[str] = [f"machine: {common.server_facts()}, load {common.load_average()}"]

    # 1. the store layer
    project.reset()
    project.insert_runs(n, time.time() - 1)
    run_dir = RunDir("profile-store")
    raw = run_dir.path / "store.raw"
    spy = pyspy(
        [
            "--",
            PYTHON,
            "-m",
            "bench.workers.store_worker",
            "--batch",
            "100",
            "--out",
            str(run_dir.path),
        ],
        raw,
        common.django_env(project.url),
    )
    _wait(run_dir, n, seconds)
    spy.send_signal(signal.SIGINT)
    spy.wait(30)
    for child in psutil.Process().children(recursive=True):
        if "store_worker" in " ".join(child.cmdline()):
            child.kill()
    report.append("\n### py-spy: store-layer worker (claim 100 + complete 100), one process\n")
    report.append(
        summarise(
            raw,
            (
                "claim (apps/runs/store.py)",
                "complete (apps/runs/store.py)",
                "next_available_at (apps/runs/store.py)",
            ),
        )
    )

    # 2. the web process under the REST API
    project.reset()
    project.insert_runs(n, time.time() - 1)
    system = make("rest", "profile", project, web_workers=1)
    run_dir = RunDir("profile-rest")
    raw = run_dir.path / "web.raw"
    # The uvicorn worker is a child process of `manage.py web`.
    system.web_prefix = [*pyspy_command(raw), "--subprocesses", "--"]
    system.setup()
    try:
        workers = Procs()
        sdk_raw = run_dir.path / "sdk.raw"
        for index in range(2):
            args, env = system.worker_args(100, run_dir)
            args = [a for a in args if a not in ("--go", str(run_dir.go))]
            # The first SDK worker under py-spy too (its samples include waits on the socket
            # and on locks: tell CPU by the bench's CPU columns, not by these shares).
            workers.start(
                "worker", [*pyspy_command(sdk_raw), "--", *args] if index == 0 else args, env
            )
        _wait(run_dir, n, seconds)
        for _, proc in workers.items[:1]:
            proc.send_signal(signal.SIGINT)
            proc.wait(30)
        workers.stop()
        spy = system.procs.items[0][1]
        spy.send_signal(signal.SIGINT)  # py-spy writes its profile on SIGINT, not on SIGTERM
        spy.wait(30)
    finally:
        system.teardown()
    report.append("\n### py-spy: the uvicorn worker process serving two SDK workers (batch 100)\n")
    # The views run on asgiref's threads (thread_handler), the protocol on the event loop.
    report.append(
        summarise(
            raw,
            (
                "handle (scheduler_site/asgi.py)",
                "run (uvicorn/server.py)",
                "thread_handler (asgiref/sync.py)",
            ),
        )
    )
    report.append("\n### py-spy: one of the two SDK workers (batch 100, a no-op handler)\n")
    report.append(summarise(sdk_raw))

    # 3. plans
    project.reset()
    project.insert_runs(n, time.time() - 1)
    for batch in (1, 100):
        done = subprocess.run(
            [PYTHON, "-m", "bench.workers.explain", "--batch", str(batch)],
            cwd=REPO,
            env=common.django_env(project.url),
            capture_output=True,
            text=True,
            check=True,
        )
        report.append(f"\n### EXPLAIN (ANALYZE, BUFFERS), batch {batch}, {n} waiting runs\n")
        report.append(done.stdout)
    text = "\n".join(report)
    print(text)
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"profile-{time.strftime('%Y%m%d-%H%M%S')}.txt"
    path.write_text(text)
    log(f"profile written to {path}")
    return []


def _wait(run_dir: RunDir, n: int, seconds: float) -> None:
    deadline = time.time() + seconds + 20
    first = None
    while time.time() < deadline:
        handled, _ = read_progress(run_dir.path)
        if handled and first is None:
            first = time.time()
            deadline = min(deadline, first + seconds)
        if handled >= n:
            break
        time.sleep(0.1)
