"""(f) Dashboard: server time of each page with N runs stored (1 M; 100 000 in --quick).

The project only (neither peer has a comparable dashboard in the packages used here). Runs
bench/workers/dashboard_pages.py in `bench_pages` (a clone of the bench template; bench/
dashboard.py, the dashboard author's own per-screen benchmark, keeps `bench_dashboard`).
One row per address: p50, p99 and max of the timed requests; the note says how many SQL
statements the page ran and flags pages over the 300 ms target.
"""

from __future__ import annotations

import json
import subprocess

from bench import common
from bench.common import PYTHON, REPO, Row, RunDir, latency_summary, log

TARGET = 0.300


def run(opts) -> list[Row]:
    if "rest" not in opts.systems and "store" not in opts.systems:
        return []
    n = opts.runs or (100_000 if opts.quick else 1_000_000)
    requests = 5 if opts.quick else 20
    url, _ = common.fresh_project_database("bench_pages")
    scratch = RunDir("dashboard")
    out = scratch.path / "pages.json"
    load = common.load_average()[0]
    done = subprocess.run(
        [
            PYTHON,
            "-m",
            "bench.workers.dashboard_pages",
            "--runs",
            str(n),
            "--requests",
            str(requests),
            "--out",
            str(out),
        ],
        cwd=REPO,
        env=common.django_env(url, SCHEDULER_APPLICATION_NAME="bench:dashboard"),
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode:
        raise RuntimeError(f"dashboard pages failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    figures = json.loads(out.read_text())
    scratch.cleanup()
    log(f"  loaded {n:,} runs in {figures['load_seconds']:.0f}s")
    rows = []
    for page in figures["pages"]:
        if "skipped" in page:
            rows.append(
                Row("dashboard", "dashboard", page["page"], note=f"skipped: {page['skipped']}")
            )
            continue
        s = latency_summary(page["timings"])
        over = s["p99"] is not None and s["p99"] > TARGET
        statuses = ",".join(str(x) for x in page["statuses"])
        rows.append(
            Row(
                "dashboard",
                "dashboard",
                page["page"],
                runs=n,
                p50=s["p50"],
                p99=s["p99"],
                max=s["max"],
                load=[load, common.load_average()[0]],
                note=f"{len(page['timings'])} req, HTTP {statuses}, {page['queries']} queries"
                + ("; OVER 300 ms" if over else ""),
                extra={"path": page["path"], "queries": page["queries"]},
            )
        )
        log(
            f"  {page['page']:<22} p50 {s['p50'] * 1000:6.1f} ms  p99 {s['p99'] * 1000:6.1f} ms  "
            f"{page['queries']} queries"
        )
    return rows
